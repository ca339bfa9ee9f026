"""Multi-process parallelism around the one-device engine: rank 0's executor (executor.py),
the spawned workers (worker.py), who holds what (placement.py), the step's broadcast
(wire.py), pipeline stages (pipeline.py) and decode graphs captured on every rank
(cuda_graphs.py). ARCHITECTURE.md, "Parallelism"."""
