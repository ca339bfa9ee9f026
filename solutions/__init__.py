"""Solutions to exercises/: the same files with the same public signatures, solved.

Teaching versions -- clear before fast; llmlab/kernels/ holds the tuned kernels."""
