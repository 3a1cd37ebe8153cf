"""A worker owns the weights and the forward pass of one device.

`Worker` runs in any process; `WorkerProc` is the same wrapped as the process
that `vsup serve` starts (`python -m engine.worker`).
"""
