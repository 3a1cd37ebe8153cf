"""Structured outputs in the engine core: grammars compiled off the step loop, one matcher per request."""
