"""Matrix products of decode steps in Triton: the GEMV for one row (gemv.py) and the skinny
GEMM for 33-64 rows (skinny_gemm.py). The model reaches them through the contract's
`linear`."""
