"""Custom kernels, each in its own module with a plain-torch reference beside it.

Nothing is imported here: a kernel module pulls in triton, which a CPU-only
process may not have or want.
"""
