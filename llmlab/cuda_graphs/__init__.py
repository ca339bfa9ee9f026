"""The model's forward replayed from CUDA graphs: a layer on the eager forward, which the
ModelRunner builds at start-up and asks each step (off with `enforce_eager`, and on a CPU).
decode.py captures decode steps per batch size, prompt.py steps that hold a prompt per token
count. Multi-rank decode graphs are in engine/parallel/cuda_graphs.py."""
