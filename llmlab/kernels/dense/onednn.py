"""The CPU's matrix product, y = x W^T + b: the torch backend's `linear` on a CPU.

On an x86 CPU, `F.linear` calls MKL, which is slow on the few rows a decode step has (one per
sequence). oneDNN, the library behind torch.compile's CPU backend, is faster, and faster
again when each weight is first reordered into its blocked layout: streaming SmolLM2's
float32 weights once takes (2-core Zen 4, ms)

    rows           1    16    64
    MKL           45    69   138
    oneDNN        20    40    99
    oneDNN, packed 17   24    78      (bfloat16: 10, 14, 42)

One row is the exception: which library wins there depends on the processor. On a 2-core
Xeon with AVX-512 MKL is the faster (SmolLM2's 30 layers at one row: MKL 8.95 ms, oneDNN
packed 13.5; at 16 rows 26.1 against 19.6). So the first float32 one-row product of a
process times both on a probe bigger than the caches and keeps the faster for every one-row
product after it (`one_row_library`; LLMLAB_CPU_ONE_ROW=mkl or onednn decides instead).

So on a CPU each weight gets a packed copy on its first use, kept beside the plain tensor
(which everything else -- hooks, sharding, notebooks -- keeps reading) and rebuilt if
the weight is modified in place. The ops are `torch.ops.mkldnn._reorder_linear_weight`
and `_linear_pointwise`, the ones torch.compile emits; a one-time probe checks that they
exist and agree with F.linear, for float32 and for bfloat16 apart (oneDNN's bfloat16 needs
AVX-512 or AVX-NE-CONVERT, which some x86 CPUs lack), and falls back to F.linear if not.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..tuning import knobs

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
_PACK_FOR_ROWS = 16           # oneDNN picks its blocking for this many rows; 1-512 all gain
_onednn_works: dict = {}      # dtype -> whether oneDNN's ops work for it here (onednn_works)
_one_row: str | None = None   # "mkl" or "onednn", once decided (one_row_library)
_packed: dict = {}            # id(weight) -> (weak ref to it, its version, packed copy)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in], weight [out, in], bias [out] or None -> [..., out]: oneDNN with the packed
    weight on a CPU (MKL for a float32 row where it measured faster), F.linear elsewhere."""
    if x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and weight.dtype == x.dtype and onednn_works(x.dtype):
        if x.dtype == torch.float32 and x.numel() == x.shape[-1] and one_row_library() == "mkl":
            return F.linear(x, weight, bias)   # one row, where MKL measured faster on this machine
        return torch.ops.mkldnn._linear_pointwise(x, packed(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


def packed(weight: torch.Tensor) -> torch.Tensor:
    """weight in oneDNN's blocked layout, made once and reused while the weight is unchanged."""
    if weight.is_inference() or not weight.is_contiguous():   # no version counter to watch
        return weight
    key = id(weight)
    entry = _packed.get(key)
    if entry is not None and entry[0]() is weight and entry[1] == weight._version:
        return entry[2]
    with torch.inference_mode():
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_FOR_ROWS)
    # forget the copy when the weight itself goes away
    _packed[key] = (weakref.ref(weight, lambda _: _packed.pop(key, None)), weight._version, blocked)
    return blocked


def prepack(weights) -> None:
    """Pack these weights now (the engine does this at load time on a CPU) rather than on
    their first use."""
    for weight in weights:
        if weight.device.type == "cpu" and weight.dtype in _ONEDNN_DTYPES and onednn_works(weight.dtype):
            packed(weight)


def one_row_library() -> str:
    """"mkl" or "onednn": the faster library for a float32 product of one row on this
    machine, timed once per process (knobs.cpu_one_row, LLMLAB_CPU_ONE_ROW=mkl or onednn: no timing). The probe
    streams six 2048 x 1024 weights (48 MB, more than a small machine's caches, as a model's
    layers are), each library's best of three passes. On the Xeon measured the two differed
    by 1.5x, far beyond the probe's noise (it chose MKL in five runs of five)."""
    global _one_row
    if _one_row is None:
        choice = (knobs.cpu_one_row or "").lower()
        if choice not in ("mkl", "onednn"):
            choice = _time_one_row()
        _one_row = choice
    return _one_row


def _time_one_row() -> str:
    import time

    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        weights = [torch.randn(2048, 1024, generator=gen) for _ in range(6)]
        blocked = [torch.ops.mkldnn._reorder_linear_weight(w, _PACK_FOR_ROWS) for w in weights]
        x = torch.randn(1, 1024, generator=gen)
        calls = {"mkl": lambda w, b: F.linear(x, w),
                 "onednn": lambda w, b: torch.ops.mkldnn._linear_pointwise(x, b, None, "none", [], "")}
        best = {}
        for _ in range(3):
            for name, call in calls.items():
                start = time.perf_counter()
                for w, b in zip(weights, blocked):
                    call(w, b)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    return min(best, key=best.get)


def onednn_works(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build has oneDNN's linear ops for `dtype` on this CPU and they agree
    with F.linear (probed once per dtype)."""
    if dtype not in _onednn_works:
        atol = 1e-5 if dtype == torch.float32 else 5e-2    # bfloat16 keeps 8 bits of mantissa
        try:
            gen = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((3, 8), (5, 8), (5,)))
            expected = F.linear(x, w, b).float()
            plain = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "").float()
            blocked = torch.ops.mkldnn._linear_pointwise(
                x, torch.ops.mkldnn._reorder_linear_weight(w, _PACK_FOR_ROWS), b, "none", [], "").float()
            _onednn_works[dtype] = (torch.backends.mkldnn.is_available() and torch.allclose(plain, expected, atol=atol)
                                    and torch.allclose(blocked, expected, atol=atol))
        except (AttributeError, RuntimeError, NotImplementedError):
            _onednn_works[dtype] = False
    return _onednn_works[dtype]
