"""`--engine vllm`: vsup's plan, names, flags and start-up hook for an unmodified `vllm serve`.

Everything here but help.py is pure, and nothing imports vLLM: vLLM runs in an
interpreter of its own (docs/vllm.md).
"""
