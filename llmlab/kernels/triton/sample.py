"""sample, the Triton backend's entry: the batch's sampling passes (sample_passes.py: the
algorithm, kernels_explained/sampling.md), launched eagerly or, on a GPU, replayed as one
CUDA graph per padded batch size (sample_graph.py)."""
from __future__ import annotations

import torch

from ..tuning import knobs

from .sample_graph import graphed_sample
from .sample_passes import launch, layout, pack, row_flags, scratch_shapes

_workspace: dict = {}       # device -> a byte buffer the per-call scratch tensors are cut from
_views: dict = {}           # (device, layout) -> the views of that buffer


def _scratch(device, shapes_dtypes):
    """Views of one cached buffer (no allocations per call), each 256-byte aligned."""
    cache_key = (device, tuple(shapes_dtypes))
    views = _views.get(cache_key)
    if views is not None and views[0] is _workspace.get(device):
        return views[1]
    sizes = [(-(-torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size() // 256)) * 256
             for shape, dtype in shapes_dtypes]
    buffer = _workspace.get(device)
    if buffer is None or buffer.numel() < sum(sizes):
        buffer = _workspace[device] = torch.empty(max(sum(sizes), 1 << 20), dtype=torch.uint8, device=device)
    views, offset = [], 0
    for (shape, dtype), size in zip(shapes_dtypes, sizes):
        count = torch.Size(shape).numel()
        views.append(buffer[offset:offset + size].view(dtype)[:count].view(shape))
        offset += size
    if len(_views) > 1024:
        _views.clear()
    _views[cache_key] = (buffer, views)
    return views


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions):
    """Same contract as reference.sample. The parameter tensors may be on the host (the
    Sampler builds them there): then passes no row needs are not launched at all, and on a
    GPU the launches replay as one CUDA graph (`sample_graph.py`)."""
    S, V = logits.shape
    if S == 0:
        return logits.argmax(dim=-1)
    flags = row_flags(temperature, top_k, top_p, min_p, V)
    if logits.is_cuda and not top_k.is_cuda and knobs.sample_graphs and not torch.cuda.is_current_stream_capturing():
        return graphed_sample(logits, flags, temperature, top_k, top_p, min_p, seeds, positions)
    if logits.stride(-1) != 1 or logits.stride(0) % 8 or logits.storage_offset():
        logits = logits.contiguous().clone()   # own aligned storage: no new kernel variant
    floats, ints = pack(temperature, top_k, top_p, min_p, seeds, positions)
    if floats.device != logits.device:
        floats, ints = (t.pin_memory().to(logits.device, non_blocking=True) for t in (floats, ints))
    P, CH, levels = layout(S, V, logits.dtype)
    rounds = max(knobs.sample_rounds, 1) if flags[2] else 1
    return launch(logits, floats, ints, flags, _scratch(logits.device, scratch_shapes(S, P, levels, rounds)))
