"""The Triton sampler's launches replayed as one CUDA graph per batch bucket.

A top-p call is about ten kernel launches and a few small tensor ops: ~1.5 ms of Python on
the host for ~0.25 ms of GPU work (llmlab bench sampler). Captured once per shape, a call
is a copy of the logits into a static buffer, one host->device copy of the row
parameters, and a replay. Batches are padded to a bucket (rows past the batch are greedy
padding), and a graph holds every pass, whatever the batch asks for: a pass no row needs
exits at once (~2 us of GPU), which is cheaper than one graph per set of passes, and keeps
the graphs few enough (two per bucket: with an argmax for greedy rows or without) for the
engine's warm-up to capture them all (`Sampler.warm_up`), so none is captured mid-run.
Graphs share one memory pool and one logits buffer: they replay one at a time on one
stream, and each call's tokens are copied out before the next replay can overwrite them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tuning import knobs
from . import sample_passes as ts


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    floats: torch.Tensor        # [rows, 4] static inputs the graph reads
    ints: torch.Tensor          # [2, rows]
    tokens: torch.Tensor        # [rows] the graph's output
    scratch: list               # keeps the graph's scratch memory alive
    # pinned host copies of (floats, ints) and the event of their last upload, taking turns:
    # a fresh pinned tensor per call costs a cudaHostAlloc whenever the host allocator's
    # cache meets a new size (the first steps of a run), and a slot is reused only once
    # its copy has run
    staging: list
    turn: int = 0


_graphs: dict = {}
_logits: dict = {}              # (device, dtype, V) -> static logits buffer [capacity, V]
_pool: dict = {}                # device -> the graphs' shared memory pool


def bucket(S: int) -> int:
    """Padded batch size: powers of two up to 16, then multiples of 16."""
    return 1 << (S - 1).bit_length() if S <= 16 else -(-S // 16) * 16


def _static_logits(device, dtype, V, rows):
    key = (device, dtype, V)
    buffer = _logits.get(key)
    if buffer is None or buffer.shape[0] < rows:
        # a bigger buffer: the graphs that read the old one are dropped and captured again
        for graph_key in [k for k in _graphs if k[:3] == key]:
            del _graphs[graph_key]
        buffer = _logits[key] = torch.zeros(max(rows, 256), V, dtype=dtype, device=device)
    return buffer


def _capture(device, dtype, V, rows, flags) -> _Graph:
    logits = _static_logits(device, dtype, V, rows)[:rows]
    floats = torch.zeros(rows, 4, dtype=torch.float32, device=device)
    ints = torch.zeros(2, rows, dtype=torch.int64, device=device)
    P, _, levels = ts.layout(rows, V, dtype)
    rounds = max(knobs.sample_rounds, 1) if flags[2] else 1
    sizes = ts.scratch_shapes(rows, P, levels, rounds)
    scratch = [torch.empty(shape, dtype=dt, device=device) for shape, dt in sizes]
    floats[:, 0] = 1.0                      # every row sampled: the warm-up run compiles every pass
    floats[:, 1] = 0.5 if flags[1] else 1.0
    ts.launch(logits, floats, ints, flags, scratch)      # compiles outside the capture
    floats.zero_()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_pool.get(device)):
        tokens = ts.launch(logits, floats, ints, flags, scratch)
    _pool[device] = graph.pool()
    staging = [(torch.empty_like(floats, device="cpu").pin_memory(), torch.empty_like(ints, device="cpu").pin_memory(),
                torch.cuda.Event()) for _ in range(2)]
    return _Graph(graph, floats, ints, tokens, scratch, staging)


def graphed_sample(logits, flags, temperature, top_k, top_p, min_p, seeds, positions):
    S, V = logits.shape
    rows = bucket(S)
    flags = (True, True, True, flags[3])       # every pass; an argmax only if a row is greedy
    key = (logits.device, logits.dtype, V, rows, flags, knobs.sample_top_k_cap)   # the cap sizes the scratch
    _static_logits(logits.device, logits.dtype, V, rows)          # may drop stale graphs first
    entry = _graphs.get(key)
    if entry is None:
        entry = _graphs[key] = _capture(logits.device, logits.dtype, V, rows, flags)
    _logits[key[:3]][:S].copy_(logits)
    floats, ints = ts.pack(temperature, top_k, top_p, min_p, seeds, positions, rows=rows)
    host_floats, host_ints, uploaded = entry.staging[entry.turn]
    entry.turn ^= 1
    uploaded.synchronize()                      # this slot's previous upload has run
    host_floats.copy_(floats)
    host_ints.copy_(ints)
    entry.floats.copy_(host_floats, non_blocking=True)
    entry.ints.copy_(host_ints, non_blocking=True)
    uploaded.record()
    entry.graph.replay()
    return entry.tokens[:S].clone()
