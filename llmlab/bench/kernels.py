"""Kernel micro-benchmarks: each Triton kernel on Llama-3-8B shapes against what torch
would do eagerly (F.rms_norm, F.silu(a) * b, SDPA's flash and cuDNN backends, ...).

    from llmlab.bench.kernels import run
    rows = run("kernels.json")      # or `llmlab bench kernels`

Memory-bound kernels report achieved TB/s (the fewest bytes the op must move, over the
median time) and its share of COPY_TB_S; prefill reports TFLOP/s. Decode and prefill also
run on int8 (and, from compute capability 8.9, fp8) KV caches: their bytes are the 8-bit
codes plus the float32 scales actually read, and decode rows carry their speed-up over the
bf16 cache's row with the same splits, measured in the same run. Inputs are random
(never zeros) and, where one call's data would fit in L2, rotated among enough copies
that every call reads from HBM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlab import kernels
from llmlab.bench.common import (BLOCK_SIZE, DTYPE, HEAD_DIM, HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS,
                                 kernel_time_ms, paged_cache, quantize_paged_cache, quantized_cache_dtypes, write_json)
from llmlab.kernels import reference
from llmlab.machine import versions
# the roofline here: the H200's measured ceilings (their one home: experiments/roofline.py)
from llmlab.experiments.roofline import H200_TB_S as COPY_TB_S, H200_TFLOP_S as MATMUL_TFLOP_S

NUM_TOKENS = 8192


def _randn(*shape, dtype=DTYPE):
    return torch.randn(shape, device="cuda", dtype=dtype)


def _row(rows, kernel, shape, impl, times, num_bytes=None, flops=None, **extra):
    ms, ms_eager = times
    row = {"kernel": kernel, "shape": shape, "impl": impl, "ms": round(ms, 4), "ms_eager": round(ms_eager, 4), **extra}
    if num_bytes is not None:
        row["tb_s"] = round(num_bytes / ms / 1e9, 3)
        row["pct_roofline"] = round(100 * row["tb_s"] / COPY_TB_S, 1)
    if flops is not None:
        row["tflop_s"] = round(flops / ms / 1e9, 1)
        row["pct_roofline"] = round(100 * row["tflop_s"] / MATMUL_TFLOP_S, 1)
    rows.append(row)
    print(_format(row), flush=True)


def _try(rows, kernel, shape, impl, fn):
    """Run one measurement; a failing peer (an SDPA backend missing here) becomes a row
    that says why instead of stopping the whole benchmark."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 -- report and go on
        rows.append({"kernel": kernel, "shape": shape, "impl": impl, "error": f"{type(error).__name__}: {error}"[:200]})
        print(f"| {kernel} | {shape} | {impl} | failed: {rows[-1]['error']} |", flush=True)


def _format(row):
    rate = f"{row['tb_s']} TB/s" if "tb_s" in row else f"{row.get('tflop_s', '')} TFLOP/s"
    speedup = f" ({row['speedup_vs_bf16']}x bf16)" if "speedup_vs_bf16" in row else ""
    return (f"| {row['kernel']} | {row['shape']} | {row['impl']}{speedup} | {row['ms']:.4f} | {row['ms_eager']:.4f} "
            f"| {rate} | {row.get('pct_roofline', '')} |")


# ----------------------------------------------------------------------------- elementwise

def _bench_copy(rows):
    n = 1 << 29  # 1 GiB of bf16
    src, dst = _randn(n), torch.empty(n, device="cuda", dtype=DTYPE)
    _row(rows, "copy", "1 GiB", "torch", kernel_time_ms(lambda i: lambda: dst.copy_(src), graph=False),
         num_bytes=2 * 2 * n)


def _bench_rms_norm(rows):
    shape = f"{NUM_TOKENS}x{HIDDEN}"
    nbytes = 2 * NUM_TOKENS * HIDDEN * 2  # read x, write out
    weight = _randn(HIDDEN)

    def inputs(i):
        return _randn(NUM_TOKENS, HIDDEN)

    for impl, fn in [("triton", lambda x: kernels.rms_norm(x, weight, 1e-5, backend="triton")),
                     ("torch F.rms_norm", lambda x: F.rms_norm(x, (HIDDEN,), weight, 1e-5))]:
        _try(rows, "rms_norm", shape, impl, lambda: _row(
            rows, "rms_norm", shape, impl, kernel_time_ms(lambda i: (lambda x: lambda: fn(x))(inputs(i)), nbytes),
            nbytes))

    nbytes = 4 * NUM_TOKENS * HIDDEN * 2  # read x and residual, write out and x + residual
    for impl, fn in [("triton", lambda x, r: kernels.rms_norm(x, weight, 1e-5, r, backend="triton")),
                     ("torch add + F.rms_norm", lambda x, r: F.rms_norm(x + r, (HIDDEN,), weight, 1e-5))]:
        _try(rows, "rms_norm+residual", shape, impl, lambda: _row(
            rows, "rms_norm+residual", shape, impl,
            kernel_time_ms(lambda i: (lambda x, r: lambda: fn(x, r))(inputs(i), inputs(i)), nbytes), nbytes))


def _bench_silu_mul(rows):
    shape = f"{NUM_TOKENS}x2x{INTERMEDIATE}"
    nbytes = 3 * NUM_TOKENS * INTERMEDIATE * 2  # read gate and up, write out

    def torch_silu_mul(x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    for impl, fn in [("triton", lambda x: kernels.silu_mul(x, backend="triton")), ("torch F.silu(a) * b", torch_silu_mul)]:
        _try(rows, "silu_mul", shape, impl, lambda: _row(
            rows, "silu_mul", shape, impl,
            kernel_time_ms(lambda i: (lambda x: lambda: fn(x))(_randn(NUM_TOKENS, 2 * INTERMEDIATE)), nbytes), nbytes))


def _bench_rope(rows):
    shape = f"{NUM_TOKENS} tokens, {NUM_HEADS}/{NUM_KV_HEADS} heads x {HEAD_DIM}"
    nbytes = 2 * NUM_TOKENS * (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM * 2  # read q, k; write both
    positions = torch.randint(0, 8192, (NUM_TOKENS,), device="cuda")
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

    def inputs(i):
        return _randn(NUM_TOKENS, NUM_HEADS, HEAD_DIM), _randn(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM)

    for impl, fn in [("triton", lambda q, k: kernels.rope(q, k, positions, 500000.0, scaling, backend="triton")),
                     ("torch eager (reference)", lambda q, k: reference.rope(q, k, positions, 500000.0, scaling))]:
        _try(rows, "rope", shape, impl, lambda: _row(
            rows, "rope", shape, impl, kernel_time_ms(lambda i: (lambda qk: lambda: fn(*qk))(inputs(i)), nbytes),
            nbytes))


def _bench_store_kv(rows):
    shape = f"{NUM_TOKENS} tokens, {NUM_KV_HEADS} kv heads x {HEAD_DIM}"
    nbytes = 2 * 2 * NUM_TOKENS * NUM_KV_HEADS * HEAD_DIM * 2  # read k, v; write both into the caches
    num_blocks = NUM_TOKENS // BLOCK_SIZE

    def inputs(i):
        k, v = _randn(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM), _randn(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM)
        caches = [_randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in range(2)]
        return k, v, *caches, torch.randperm(NUM_TOKENS, device="cuda")

    # The reference's boolean-mask indexing reads a count on the host: it cannot be graphed.
    for impl, fn, graph in [("triton", lambda *a: kernels.store_kv(*a, backend="triton"), True),
                            ("torch index_put (reference)", reference.store_kv, False)]:
        _try(rows, "store_kv", shape, impl, lambda: _row(
            rows, "store_kv", shape, impl,
            kernel_time_ms(lambda i: (lambda a: lambda: fn(*a))(inputs(i)), nbytes, graph=graph), nbytes))

    rows_written = 2 * NUM_TOKENS * NUM_KV_HEADS
    for name, cache_dtype in quantized_cache_dtypes().items():
        qbytes = rows_written * (HEAD_DIM * 2 + HEAD_DIM * cache_dtype.itemsize + 4)  # read bf16; write codes, scale

        def quantized_inputs(i, cache_dtype=cache_dtype):
            k, v, _, _, slots = inputs(i)
            caches = [torch.empty(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=cache_dtype)
                      for _ in range(2)]
            scales = [torch.empty(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, device="cuda") for _ in range(2)]
            return k, v, *caches, slots, *scales

        impl = f"triton, {name} cache"
        _try(rows, "store_kv", shape, impl, lambda impl=impl, make=quantized_inputs: _row(
            rows, "store_kv", shape, impl,
            kernel_time_ms(lambda i: (lambda a: lambda: kernels.store_kv(*a, backend="triton"))(make(i)), qbytes),
            qbytes))


# ----------------------------------------------------------------------------- attention

def _sdpa_rows(rows, kernel, shape, q, k, v, is_causal, num_bytes=None, flops=None):
    """SDPA's flash and cuDNN backends on contiguous [B, heads, L, D] tensors (k and v
    rotated with fresh random copies when they would fit in L2)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for impl, backend in [("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)]:
        def make_call(i, backend=backend):
            k_i, v_i = (k, v) if i == 0 else (torch.randn_like(k), torch.randn_like(v))

            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k_i, v_i, is_causal=is_causal, enable_gqa=True)
            return call

        def measure(impl=impl, make_call=make_call):
            make_call(0)()  # fail here, outside timing, if the backend refuses these inputs
            _row(rows, kernel, shape, impl, kernel_time_ms(make_call, num_bytes or 0),
                 num_bytes=num_bytes, flops=flops)
        _try(rows, kernel, shape, impl, measure)


def _bench_decode(rows, batch, context, splits):
    shape = f"batch {batch} x ctx {context}"
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = _randn(batch, NUM_HEADS, HEAD_DIM)
    rows_read = 2 * batch * context * NUM_KV_HEADS  # K and V rows, each read once
    nbytes = rows_read * HEAD_DIM * 2

    def triton_call(num_splits, cache_dtype=None):
        def make_call(i):
            k_cache, v_cache, block_tables = paged_cache([context] * batch)
            scales = ()
            if cache_dtype is not None:
                k_cache, v_cache, block_tables, *scales = quantize_paged_cache(k_cache, v_cache, block_tables,
                                                                               cache_dtype)
            return lambda: kernels.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, HEAD_DIM ** -0.5,
                                                    num_splits, *scales, backend="triton")
        return make_call

    bf16_ms = {}
    for impl, num_splits in splits:
        def measure(impl=impl, num_splits=num_splits):
            times = kernel_time_ms(triton_call(num_splits), nbytes)
            bf16_ms[num_splits] = times[0]
            _row(rows, "decode_attention", shape, impl, times, num_bytes=nbytes)
        _try(rows, "decode_attention", shape, impl, measure)
    for name, cache_dtype in quantized_cache_dtypes().items():
        qbytes = rows_read * (HEAD_DIM * cache_dtype.itemsize + 4)  # codes + one float32 scale per row
        for impl, num_splits in splits:
            def measure(impl=f"{impl}, {name} cache", num_splits=num_splits):
                times = kernel_time_ms(triton_call(num_splits, cache_dtype), qbytes)
                extra = {"speedup_vs_bf16": round(bf16_ms[num_splits] / times[0], 2)} if num_splits in bf16_ms else {}
                _row(rows, "decode_attention", shape, impl, times, num_bytes=qbytes, **extra)
            _try(rows, "decode_attention", shape, f"{impl}, {name} cache", measure)
        torch.cuda.empty_cache()
    torch.cuda.empty_cache()
    k, v = _randn(batch, NUM_KV_HEADS, context, HEAD_DIM), _randn(batch, NUM_KV_HEADS, context, HEAD_DIM)
    _sdpa_rows(rows, "decode_attention", shape, q[:, :, None, :], k, v, False, num_bytes=nbytes)


def _bench_prefill(rows, context=4096):
    shape = f"batch 1 x {context} causal"
    flops = 2 * 2 * NUM_HEADS * HEAD_DIM * context * context / 2  # QK^T and PV, half the square
    k_cache, v_cache, block_tables = paged_cache([context])
    q = _randn(context, NUM_HEADS, HEAD_DIM)
    cu_seqlens_q = torch.tensor([0, context], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    _try(rows, "prefill_attention", shape, "triton (paged)", lambda: _row(
        rows, "prefill_attention", shape, "triton (paged)",
        kernel_time_ms(lambda i: lambda: kernels.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                                   seq_lens, HEAD_DIM ** -0.5, backend="triton")),
        flops=flops))
    for name, cache_dtype in quantized_cache_dtypes().items():
        quantized = quantize_paged_cache(*paged_cache([context]), cache_dtype)
        impl = f"triton (paged), {name} cache"
        _try(rows, "prefill_attention", shape, impl, lambda quantized=quantized, impl=impl: _row(
            rows, "prefill_attention", shape, impl,
            kernel_time_ms(lambda i: lambda: kernels.prefill_attention(q, *quantized[:3], cu_seqlens_q, seq_lens,
                                                                       HEAD_DIM ** -0.5, *quantized[3:],
                                                                       backend="triton")),
            flops=flops))
    k, v = _randn(1, NUM_KV_HEADS, context, HEAD_DIM), _randn(1, NUM_KV_HEADS, context, HEAD_DIM)
    _sdpa_rows(rows, "prefill_attention", shape, q.transpose(0, 1)[None].contiguous(), k, v, True, flops=flops)


def run(out_path=None) -> list[dict]:
    """Run every kernel benchmark on the current CUDA device; print a markdown table and
    return its rows (also written as JSON to out_path when given)."""
    if not torch.cuda.is_available():
        raise RuntimeError("kernel benchmarks need a CUDA device")
    from llmlab.kernels.triton.decode_attention import choose_num_splits

    torch.manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    software = versions()
    print(f"{torch.cuda.get_device_name()}, torch {software['torch']}, triton {software['triton']}")
    print("| kernel | shape | impl | ms (graph) | ms (eager) | rate | % roofline |\n|---|---|---|---|---|---|---|",
          flush=True)
    rows = []
    _bench_copy(rows)
    _bench_rms_norm(rows)
    _bench_silu_mul(rows)
    _bench_rope(rows)
    _bench_store_kv(rows)
    splits_64 = choose_num_splits(64, NUM_KV_HEADS, 4096, num_sms)
    _bench_decode(rows, 64, 4096, [("triton v1", 1), ("triton v2 (4 splits)", 4)] +
                  ([(f"triton v2 ({splits_64} splits, chosen)", splits_64)] if splits_64 > 1 else []))
    for batch in (1, 2, 4):
        splits = choose_num_splits(batch, NUM_KV_HEADS, 32768, num_sms)
        _bench_decode(rows, batch, 32768, [("triton v1", 1), (f"triton v2 ({splits} splits)", splits)])
    _bench_prefill(rows)
    write_json(out_path, rows)
    return rows


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None, help="write the rows as JSON here")


def main(args) -> list[dict]:
    if not torch.cuda.is_available():
        raise ValueError("bench kernels times compiled Triton kernels; it needs a CUDA device")
    return run(args.out)


if __name__ == "__main__":
    run()
