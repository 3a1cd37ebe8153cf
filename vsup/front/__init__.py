"""vsup's front for a stock vLLM: the public port, held and resumed requests (DESIGN.md section 8)."""
