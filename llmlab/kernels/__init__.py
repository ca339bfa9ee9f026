"""llmlab's kernels behind one contract (ARCHITECTURE.md, "Kernel contract").

Every kernel has one signature and three implementations, chosen by backend name:

- "reference": the pure-torch spec in `reference.py`, written to be read;
- "torch": `torch_backend.py`, the same math in fewer, fused torch ops (the CPU default);
- "triton": a Triton kernel in `triton/<name>.py` (the GPU default).

The functions here dispatch on `backend=` or, by default, on the global backend:
"triton" when CUDA is available, "torch" otherwise. On a machine without CUDA the
Triton kernels run through Triton's interpreter, which llmlab switches on by itself.

    from llmlab import kernels
    out = kernels.rms_norm(x, w, 1e-5)                    # default backend
    out = kernels.rms_norm(x, w, 1e-5, backend="triton")  # force one
    with kernels.override(decode_attention=my_kernel):    # plug in your own (exercises)
        llm.generate(...)

`rope_store_kv` is rope and store_kv fused into one kernel, one launch fewer per layer
(the model calls it); while `rope` or `store_kv` is overridden it runs that pair instead,
so a kernel plugged in for either still runs. A decode-only step goes one further:
`rope_store_decode_attention` is rope_store_kv and decode_attention in one kernel, and runs
as the two (each through its override or backend) while any of its parts is overridden.
`norm_linear` and `linear_residual` are not kernels of their own either: rms_norm before a
product and the residual add after one, which the Triton GEMV and skinny GEMM can fold in
(`folds_add_norm`, knobs.fold_norms), run as the parts everywhere else.
"""
from __future__ import annotations

import contextlib
import importlib
import time

import torch

from . import reference, torch_backend
from .interpreter import enable_interpreter_if_no_cuda  # noqa: F401  (public: kernels.enable_interpreter_if_no_cuda)
from .tuning import knobs  # noqa: F401  (the fast path's switches, one table: tuning.py)
from .triton import prefill_configs, q8_configs  # noqa: F401,E402  (they check their knob's name now)

enable_interpreter_if_no_cuda()   # now, before anything else imports Triton (transformers does)

KERNEL_NAMES = ("linear", "rms_norm", "rope", "silu_mul", "store_kv", "rope_store_kv", "prefill_attention",
                "decode_attention", "rope_store_decode_attention", "sample")
BACKENDS = ("reference", "torch", "triton")

_default_backend: str | None = None
_overrides: dict = {}
_triton_impls: dict = {}
# While `time_kernels` is active, every call is timed: CUDA events around it on a GPU,
# perf_counter on a CPU. None means no timing and no cost.
_timings: dict | None = None
_pending_events: list = []     # (name, start event, end event), resolved when timing stops


def default_backend() -> str:
    return _default_backend or ("triton" if torch.cuda.is_available() else "torch")


def set_backend(name: str | None) -> None:
    """Set the global default backend ("reference" | "torch" | "triton"); None restores the
    automatic choice."""
    global _default_backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _default_backend = name


def _triton_module(name):
    """kernels/triton/<name>.py, imported on first use (after the interpreter switch)."""
    enable_interpreter_if_no_cuda()
    return importlib.import_module(f"{__name__}.triton.{name}")


def _triton_impl(name):
    if name not in _triton_impls:
        _triton_impls[name] = getattr(_triton_module(name), name)
    return _triton_impls[name]


def get_kernel(name: str, backend: str | None = None):
    """The function that runs kernel `name`: an override if one is installed, else the
    chosen backend's implementation."""
    if name in _overrides:
        return _overrides[name]
    backend = backend or default_backend()
    if backend == "torch":
        return getattr(torch_backend, name)
    if backend == "reference":
        return getattr(reference, name)
    if backend == "triton":
        return _triton_impl(name)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def is_overridden(name: str) -> bool:
    """Whether `override` has replaced kernel `name` (fused paths that include it must not run)."""
    return name in _overrides


@contextlib.contextmanager
def override(**kernels):
    """Use the given functions instead of llmlab's kernels inside the `with` block.
    Each must have the same signature as the kernel it replaces (see reference.py)."""
    unknown = set(kernels) - set(KERNEL_NAMES)
    if unknown:
        raise ValueError(f"unknown kernel(s) {sorted(unknown)}; kernels are {KERNEL_NAMES}")
    saved = dict(_overrides)
    _overrides.update(kernels)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


@contextlib.contextmanager
def time_kernels():
    """Collect per-kernel wall time (seconds) into the yielded dict while active."""
    global _timings
    saved, _timings = _timings, {}
    timings = _timings
    try:
        yield timings
    finally:
        if _pending_events:
            torch.cuda.synchronize()
            for name, start, end in _pending_events:
                timings[name] = timings.get(name, 0.0) + start.elapsed_time(end) / 1000
            _pending_events.clear()
        _timings = saved


def _call(name, backend, *args, **kwargs):
    return _run(name, get_kernel(name, backend), *args, **kwargs)


def _run(name, fn, *args, **kwargs):
    """fn(*args, **kwargs), timed under `name` while time_kernels is active."""
    if _timings is None:
        return fn(*args, **kwargs)
    if args[0].is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(*args, **kwargs)
        end.record()
        _pending_events.append((name, start, end))
        return result
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    _timings[name] = _timings.get(name, 0.0) + time.perf_counter() - start
    return result


def linear(x, weight, bias=None, *, backend=None):
    return _call("linear", backend, x, weight, bias)


def swiglu(x, gate_up, *, backend=None):
    """silu_mul(linear(x, gate_up)): the first half of the MLP, gate_up = [gate; up] rows.
    The Triton backend runs it as one kernel where it can (LLMLAB_SWIGLU_GEMM=1, 33-64 rows
    on a GPU), unless linear or silu_mul is overridden."""
    if (backend or default_backend()) == "triton" and "linear" not in _overrides and "silu_mul" not in _overrides:
        fused = _triton_module("linear").swiglu(x, gate_up)
        if fused is not None:
            return fused
    return silu_mul(linear(x, gate_up, backend=backend), backend=backend)


# The kernels a folded step takes over: while any of them is overridden (an exercise, a spy),
# the model runs them one by one, so the plugged-in kernel runs.
_FOLDED_PARTS = ("linear", "rms_norm", "silu_mul")


def folds_add_norm(x, *, backend=None) -> bool:
    """Whether products over x's rows fold each rms_norm into the product after it and each
    residual add into the product before it (norm_linear and linear_residual below; the
    model's `folded_decoder_layers` asks for its decode steps): the Triton backend on a GPU,
    at the rows its own products take (1, and 33-64 in bf16), with none of linear, rms_norm
    and silu_mul overridden, and knobs.fold_norms on (triton/linear.py)."""
    return ((backend or default_backend()) == "triton" and not any(name in _overrides for name in _FOLDED_PARTS)
            and _triton_module("linear").folds(x))


def norm_linear(x, norm_weight, eps, weight, bias=None, *, out_dtype=None, backend=None):
    """linear(rms_norm(x, norm_weight, eps), weight, bias), then .to(out_dtype) if given (the
    logits' float32): one launch where folds_add_norm(x) and there is no bias (the row's
    1 / rms scales the product's sum instead of x, so the bits differ from the pair's in the
    last place of bf16), else the pair."""
    if bias is None and folds_add_norm(x, backend=backend):
        out = _run("norm_linear", _triton_module("linear").norm_linear, x, norm_weight, eps, weight, out_dtype)
        if out is not None:
            return out
    out = linear(rms_norm(x, norm_weight, eps, backend=backend), weight, bias, backend=backend)
    return out if out_dtype is None else out.to(out_dtype)


def linear_residual(x, weight, residual, *, silu_mul_first=False, backend=None):
    """residual + linear(x, weight), the product rounded to x's dtype before the sum (as
    rms_norm's residual add takes it); of silu_mul(x) with silu_mul_first. One launch where
    folds_add_norm(x) (at 33-64 rows silu_mul stays its own), else the parts."""
    if folds_add_norm(x, backend=backend):
        out = _run("linear_residual", _triton_module("linear").linear_residual, x, weight, residual, silu_mul_first)
        if out is not None:
            return out
    if silu_mul_first:
        x = silu_mul(x, backend=backend)
    return linear(x, weight, backend=backend) + residual


def prepack(weights) -> None:
    """Give each CPU weight its oneDNN blocked layout now (the runner does this at load time)
    rather than on its first product (kernels/dense/onednn.py)."""
    from .dense import onednn

    onednn.prepack(weights)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int | None,
                      quantized: bool = False) -> int:
    """How many flash-decoding splits a decode step of `num_seqs` sequences (the longest
    `max_seq_len` tokens) runs with: 1 (PagedAttention v1) unless the Triton kernels run on a
    GPU of `num_sms` SMs (None: not), else `choose_num_splits` (kernels/triton/flash_decoding.py)
    rounded down to a power of two, so that few CUDA graphs cover every context length. The
    one place the split count is decided: the runner's steps, the warm-up's plans and its
    CUDA graphs all ask here; the model runs its fused decode path only at 1."""
    if num_sms is None:
        return 1
    from .triton.flash_decoding import choose_num_splits
    from .triton.q8_configs import Q8_MIN_SPLIT_TOKENS

    # the 8-bit (Gluon) kernel wants more programs per SM and longer ranges (flash_decoding.py)
    splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms,
                               programs_per_sm=8 if quantized else 4,
                               min_split_tokens=Q8_MIN_SPLIT_TOKENS if quantized else 128)
    return 1 << (splits.bit_length() - 1)


def prefill_scratch_bytes(quantized: bool) -> int:
    """The most memory a prefill-attention call takes beside its output: over an 8-bit cache
    the Triton kernel may first dequantize the sequences' blocks into a 16-bit scratch
    (`triton/prefill_attention.py`, DEQUANT_SCRATCH_MAX_BYTES); what the runner's memory
    profile, which runs a 16-bit cache, adds for it; 0 when the prefill config in use
    ($LLMLAB_PREFILL_CONFIG or the default) converts in the kernel instead."""
    if not quantized or not prefill_configs.prefill_config().dequant_first:
        return 0
    from .triton.prefill_attention import DEQUANT_SCRATCH_MAX_BYTES

    return DEQUANT_SCRATCH_MAX_BYTES


def filter_logits(x, top_k, top_p, min_p, *, backend=None):
    """The sampling filters (top-k, top-p, min-p) on scaled logits, as `Sampler.probabilities`
    and processed logprobs need them. The torch backend finds the spec's cut among a row's top
    candidates (what the torch sampler does); the others run the spec (`reference.filter_logits`,
    a sort of every row), also "triton": the candidate search reads how far to widen on the
    host, and on a GPU that wait stalls the overlapped steps more than the sort costs (H200,
    256 sampled rows with logprobs: 0.57x against 0.74x of the run without)."""
    if (backend or default_backend()) == "torch":
        return torch_backend.filter_logits(x, top_k, top_p, min_p)
    return reference.filter_logits(x, top_k, top_p, min_p)


def token_logprobs(logits, token_ids, num_top, scale=None, *, backend=None):
    """Log-probabilities of chosen tokens under log_softmax(logits * scale) and each row's
    `num_top` most likely tokens (`reference.token_logprobs`): what `SamplingParams.logprobs`
    and `prompt_logprobs` return. Not a contract kernel one overrides (like `filter_logits`):
    "triton" reads the logits once (`triton/logprobs.py`), the others run the spec."""
    if (backend or default_backend()) == "triton":
        return _triton_module("logprobs").token_logprobs(logits, token_ids, num_top, scale)
    return reference.token_logprobs(logits, token_ids, num_top, scale)


def rms_norm(x, weight, eps, residual=None, *, backend=None):
    return _call("rms_norm", backend, x, weight, eps, residual)


def rope(q, k, positions, theta, scaling=None, *, backend=None):
    return _call("rope", backend, q, k, positions, theta, scaling)


def silu_mul(x, *, backend=None):
    return _call("silu_mul", backend, x)


# A quantized cache's scales are passed on only when there are some, so a full-precision
# cache calls every implementation (and an override written before KV quantization) as before.
def _scales(k_scales, v_scales):
    return () if k_scales is None and v_scales is None else (k_scales, v_scales)


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None, *, backend=None):
    return _call("store_kv", backend, k, v, k_cache, v_cache, slot_mapping, *_scales(k_scales, v_scales))


def rope_store_kv(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping,
                  k_scales=None, v_scales=None, *, backend=None):
    if "rope_store_kv" not in _overrides and ("rope" in _overrides or "store_kv" in _overrides):
        # someone plugged in their own rope or store_kv (an exercise, a spy): the fused kernel
        # would bypass it, so run the pair, each through its override or its backend
        q, k = rope(q, k, positions, theta, scaling, backend=backend)
        store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales, backend=backend)
        return q
    return _call("rope_store_kv", backend, q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping,
                 k_scales, v_scales)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                      k_scales=None, v_scales=None, *, backend=None):
    return _call("prefill_attention", backend, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                 *_scales(k_scales, v_scales))


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=1,
                     k_scales=None, v_scales=None, *, backend=None):
    return _call("decode_attention", backend, q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits,
                 *_scales(k_scales, v_scales))


_DECODE_PARTS = ("rope", "store_kv", "rope_store_kv", "decode_attention")


def rope_store_decode_attention(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping,
                                block_tables, seq_lens, scale, num_splits=1, k_scales=None, v_scales=None,
                                *, backend=None):
    if "rope_store_decode_attention" not in _overrides and any(name in _overrides for name in _DECODE_PARTS):
        # a student's decode_attention (or rope, store_kv) must run: the parts, one by one
        q = rope_store_kv(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping, k_scales, v_scales,
                          backend=backend)
        return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales,
                                backend=backend)
    return _call("rope_store_decode_attention", backend, q, k, v, positions, theta, scaling, k_cache, v_cache,
                 slot_mapping, block_tables, seq_lens, scale, num_splits, *_scales(k_scales, v_scales))


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions, *, backend=None):
    return _call("sample", backend, logits, temperature, top_k, top_p, min_p, seeds, positions)


for _name in KERNEL_NAMES:
    globals()[_name].__doc__ = getattr(reference, _name).__doc__
