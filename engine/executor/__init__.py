"""How an engine core runs its steps: on one worker in its own process (executor.py, in-process
mode), or on a group of worker processes (worker_group.py) through the ring (engine/ring/)."""
