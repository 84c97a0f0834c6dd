"""Tensor parallelism over torch.distributed: process groups (group.py), which slice of every
weight a rank holds (sharding.py), sharded layer types (layers.py), a rank and its worker loop
(worker.py), the engine's side (executor.py) and the torchrun entry point (launch.py)."""
