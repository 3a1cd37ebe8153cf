"""vsup's installed version, as the API server reports it."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    """vsup's installed version (the API server reads the package metadata, not vsup's code)."""
    try:
        return metadata.version("vsup")
    except metadata.PackageNotFoundError:
        return "unknown"
