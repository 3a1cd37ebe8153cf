"""Several vLLM replicas' /metrics as one Prometheus text: each sample labelled with its replica. Pure.

Each replica's vLLM exports the same metric names; concatenated as they are, they would
clash. Every sample gets `replica="rN"` as its first label, and each family's HELP and
TYPE lines are kept once, before all of that family's samples.
"""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?(?P<rest>\s.*)$")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_info")


def merge_replicas(texts: dict[int, str]) -> str:
    """{replica: its /metrics text} -> one text, families in the order first seen."""
    meta: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for r, text in sorted(texts.items()):
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                meta.setdefault(family, [])
                if not any(m.split()[1] == line.split()[1] for m in meta[family]):
                    meta[family].append(line)
                samples.setdefault(family, [])
                continue
            match = _SAMPLE.match(line)
            if not match:
                continue
            name = match["name"]
            owner = family if family and name.startswith(family) else _family(name, samples)
            labels = f'replica="r{r}"' + (f",{match['labels']}" if match["labels"] else "")
            samples.setdefault(owner, []).append(f"{name}{{{labels}}}{match['rest']}")
    out = []
    for family, lines in samples.items():
        out += meta.get(family, [])
        out += lines
    return "\n".join(out) + "\n" if out else ""


def _family(name: str, known: dict) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[:-len(suffix)] in known:
            return name[:-len(suffix)]
    return name
