"""The step's ring buffer, below the executor that writes it and the workers that read it.

shm_broadcast.py: shared memory on one node (one writer, TP x PP readers; shm_segment.py is its
layout); tcp_broadcast.py: the same stream for workers on other nodes.
"""
