"""Matrix products, y = x W^T: the CPU's (onednn.py: oneDNN with prepacked weights, the torch
backend's `linear` on a CPU) and decode steps' on a GPU in Triton (gemv.py: one row;
skinny_gemm.py: 33-64 rows), which the Triton backend's `linear` (triton/linear.py) routes
to. The model reaches them through the contract's `linear`."""
