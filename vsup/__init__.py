"""vsup: plan, launch, supervise and explain the process tree of an LLM server."""

__version__ = "0.1.0"
