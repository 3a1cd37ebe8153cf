"""Custom kernels: the Triton one for CUDA in its own module, and the C++ ones for the CPU
(csrc/, loaded by cpu_extension.py); each keeps a plain-torch path that its tests compare against.

Nothing is imported here: a kernel module pulls in triton, which a CPU-only
process may not have or want.
"""
