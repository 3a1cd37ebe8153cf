"""vsup's front for a stock vLLM: the public port, held and resumed requests."""
