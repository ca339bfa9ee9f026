"""Every prefill-attention launch variant (`PREFILL_CONFIGS`: tiles, warps, stages, packed
GQA heads) over a 16-bit and both 8-bit caches, in one run, so the config of each cache can
be picked from one GPU session.

    llmlab bench prefill-variants --out prefill_variants.json           # H200: Llama-3-8B heads
    llmlab bench prefill-variants --shapes 1x40x40,2x24x72 --num-heads 4 --num-kv-heads 2 \\
        --head-dim 64 --configs m64-n64-w4-s3,m64-n64-w4-s3-gqa          # CPU: the interpreter, seconds

A shape is SEQSxQUERIESxCONTEXT: SEQS sequences, each QUERIES new tokens attending causally
over CONTEXT cached tokens (its own included): 1x4096x4096 is a whole 4k prompt, 1x512x4096
a 512-token chunk of a prompt after 3,584 tokens (chunked prefill, a prefix-cache hit).

Configs ending in `-dq` dequantize an 8-bit cache's blocks into a 16-bit scratch first (the
scratch's pass included in their time, in the timed graph too: `scratch_in_graphs`); over the
16-bit cache they are their base config and are not repeated.

Each row: ms (CUDA-graph replay on a GPU; wall time of an interpreted call on a CPU), TFLOP/s
(4 x heads x head_dim per query-key pair the causal mask keeps), the speed-up over the
default config on the 16-bit cache (`vs_default`: the kernel as the engine runs it, named in
its row: on a GPU DEFAULT_PREFILL_CONFIG or $LLMLAB_PREFILL_CONFIG, in the interpreter its own
small tiles), the query heads a program takes (`heads_per_program`: a `-gqa` config whose
group does not pack runs one), and the largest
difference from `reference.prefill_attention` (`ok`). Whole prompts on one sequence also
get SDPA's flash and cuDNN kernels as same-run peers (contiguous K/V, not paged). The
summary's fastest correct row per cache and shape also has `vs_best_16bit`, against the
16-bit cache's fastest config: #32's "8-bit prefill >= 0.9x bf16" compares those two.
"""
from __future__ import annotations

import math

import torch

from llmlab.bench.common import (BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, QUANTIZED_CACHE_DTYPES,
                                 cache_dtype_names, paged_cache, quantize_paged_cache, variant_setup, variant_time_ms,
                                 write_json)
from llmlab.kernels import reference
from llmlab.machine import versions

# outputs are averages of N(0, 1) values; 16-bit dots and outputs (bench kernels' bf16 tolerance)
TOLERANCE = dict(atol=2e-2, rtol=2e-2)
DEFAULT_SHAPES = "1x4096x4096,1x512x4096"


def causal_flops(num_seqs: int, queries: int, context: int, num_heads: int, head_dim: int) -> float:
    """QK^T and PV over the query-key pairs a causal chunk keeps: query j of `queries` (at
    position context - queries + j) sees context - queries + j + 1 keys."""
    pairs = queries * (context - queries) + queries * (queries + 1) / 2
    return 4.0 * num_heads * head_dim * pairs * num_seqs


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for shape in text.split(","):
        try:
            seqs, queries, context = (int(x) for x in shape.split("x"))
        except ValueError:
            raise ValueError(f"--shapes: SEQSxQUERIESxCONTEXT, e.g. 1x4096x4096, got {shape!r}") from None
        if not (seqs >= 1 and 1 <= queries <= context):
            raise ValueError(f"--shapes {shape!r}: need SEQS >= 1 and 1 <= QUERIES <= CONTEXT")
        shapes.append((seqs, queries, context))
    return shapes


def run(out_path=None, shapes=((1, 4096, 4096), (1, 512, 4096)), configs=None, cache_dtypes=None,
        num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
        device=None) -> dict:
    """Time the default config and every named config on the 16-bit cache (bf16 on a GPU,
    fp16 in the interpreter) and on each 8-bit cache, for each shape; print a table, return
    {"device", ..., "rows", "best"} (also as JSON to out_path, after every row)."""
    from llmlab.kernels.triton import prefill_attention as triton_prefill
    from llmlab.kernels.triton.prefill_configs import PREFILL_CONFIGS

    device, on_gpu, dtype, cache_dtypes, names = variant_setup(device, cache_dtypes, configs, PREFILL_CONFIGS)
    full = str(dtype).removeprefix("torch.")
    if not (num_heads >= 1 and num_kv_heads >= 1) or num_heads % num_kv_heads:
        raise ValueError(f"--num-heads {num_heads} must be a positive multiple of --num-kv-heads {num_kv_heads}")
    for flag, value, least in (("--head-dim", head_dim, 16), ("--block-size", block_size, 1)):
        if value < least or value & (value - 1):
            raise ValueError(f"{flag} {value}: the kernel takes a power of two >= {least}")
    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    software = versions()
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu (Triton interpreter)"
    header_info = {"device": name, **software, "heads": [num_heads, num_kv_heads, head_dim], "block_size": block_size}
    print(f"{name}, torch {software['torch']}, triton {software['triton']}, heads {num_heads}/{num_kv_heads} x "
          f"{head_dim}, block size {block_size}\n| variant | cache | shape | ms | TFLOP/s | vs default | max err |\n"
          f"|---|---|---|---|---|---|---|", flush=True)
    rows = []

    def measure(row, make_call, num_bytes, expected, flops, baseline_ms=None):
        """Fill row with the timing and the error against `expected`, or the error message."""
        name = row["variant"]
        if not row.get("peer"):
            launch = PREFILL_CONFIGS[name] if name in PREFILL_CONFIGS else triton_prefill._launch_config(dtype, device)
            row["heads_per_program"] = triton_prefill._heads_per_program(launch, num_heads // num_kv_heads)
        try:
            out = make_call(0)()
            if expected is not None:
                error = (out.float() - expected).abs().max().item()
                row.update(max_abs_err=round(error, 6), ok=bool(torch.allclose(out.float(), expected, **TOLERANCE)))
            ms, ms_eager = variant_time_ms(make_call, num_bytes, on_gpu)
            row.update(ms=round(ms, 4), ms_eager=round(ms_eager, 4), tflop_s=float(f"{flops / ms / 1e9:.4g}"))
            if baseline_ms:
                row["vs_default"] = round(baseline_ms / ms, 3)
        except Exception as error:  # noqa: BLE001 -- a variant that does not compile here is a finding
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        rows.append(row)
        write_json(out_path, {**header_info, "rows": rows})   # after every row: a run cut short keeps them
        rate = f"{row['ms']:.4f} | {row['tflop_s']}" if "ms" in row else f"failed: {row['error'][:80]} |"
        print(f"| {row['variant']}{' (' + row['kernel'] + ')' if 'kernel' in row else ''} | {row['cache']} | {row['shape']} | {rate} | {row.get('vs_default', '')} | "
              f"{row.get('max_abs_err', '')}{'' if row.get('ok', True) else ' NOT OK'} |", flush=True)
        return row.get("ms")

    for seqs, queries, context in shapes:
        shape = f"{seqs}x{queries}x{context}"
        flops = causal_flops(seqs, queries, context, num_heads, head_dim)
        kv_bytes = 2 * seqs * context * num_kv_heads * head_dim * dtype.itemsize
        # enough input sets that one pass over them does not fit in L2 (on a GPU)
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) if on_gpu else 0
        num_sets = max(1, min(8, math.ceil(4 * l2 / kv_bytes)))
        caches = [paged_cache([context] * seqs, num_kv_heads, head_dim, block_size, dtype, device, gen)
                  for _ in range(num_sets)]
        q = torch.randn(seqs * queries, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
        cu_seqlens_q = torch.arange(0, seqs + 1, dtype=torch.int32, device=device) * queries
        seq_lens = torch.full((seqs,), context, dtype=torch.int32, device=device)
        base = dict(shape=shape, seqs=seqs, queries=queries, context=context, flops=flops)

        def kernel(row, config, cache):
            """Which kernel a -ws config ran: the Gluon one where it applies, else the Triton one."""
            if config and PREFILL_CONFIGS[config].warp_specialized:
                row["kernel"] = "gluon" if triton_prefill.runs_gluon(q, cache, cache) else "triton"
            return row

        def calls(sets, config, scales=False):
            def make_call(i):
                k, v, t, *s = sets[i % num_sets]
                return lambda: triton_prefill.prefill_attention(q, k, v, t, cu_seqlens_q, seq_lens, scale,
                                                                *(s if scales else ()), config=config,
                                                                scratch_in_graphs=True)
            return make_call

        expected = reference.prefill_attention(q, *caches[0], cu_seqlens_q, seq_lens, scale).float()
        default_name = f"default ({triton_prefill._launch_config(dtype, device).name})"   # on a CPU the interpreter's
        default_ms = measure(dict(variant=default_name, cache=full, **base), calls(caches, None), kv_bytes, expected,
                             flops)
        for config in names:
            if not PREFILL_CONFIGS[config].dequant_first:   # over a 16-bit cache, the same as without
                measure(kernel(dict(variant=config, cache=full, **base), config, caches[0][0]), calls(caches, config),
                        kv_bytes, expected, flops, default_ms)
        if on_gpu and seqs == 1 and queries == context:
            _sdpa_peers(measure, base, q, caches[0], seq_lens, block_size, num_heads, kv_bytes, flops, default_ms, full)
        del expected
        for cache_name in cache_dtypes:
            quantized = [quantize_paged_cache(*cache, QUANTIZED_CACHE_DTYPES[cache_name]) for cache in caches]
            k_codes, v_codes, tables, k_scales, v_scales = quantized[0]
            expected = reference.prefill_attention(q, k_codes, v_codes, tables, cu_seqlens_q, seq_lens, scale,
                                                   k_scales, v_scales).float()
            q_bytes = kv_bytes // dtype.itemsize * (1 + 4 / head_dim)   # codes and a float32 scale per row
            for config in [None] + names:
                row = kernel(dict(variant=config or default_name, cache=cache_name, **base), config, k_codes)
                if row.get("kernel") == "gluon" and not PREFILL_CONFIGS[config].dequant_first:
                    row["kernel"] = "triton"   # no scratch: the Triton kernel converts the codes itself
                measure(row, calls(quantized, config, scales=True), q_bytes, expected, flops, default_ms)
            del quantized, expected
        del caches
        if on_gpu:
            torch.cuda.empty_cache()

    best = _best(rows, full)
    print("fastest correct variant per cache and shape:")
    for key, row in best.items():
        print(f"  {key}: {row}")
    result = {**header_info, "rows": rows, "best": best}
    write_json(out_path, result)
    return result


def _sdpa_peers(measure, base, q, cache, seq_lens, block_size, num_heads, kv_bytes, flops, default_ms, full):
    """SDPA's flash and cuDNN kernels on the same K/V, gathered into contiguous [1, heads, L, D]."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k_cache, v_cache, table = cache
    context = int(seq_lens[0])
    slots = (table[0].long()[:, None] * block_size + torch.arange(block_size, device=q.device)).flatten()[:context]
    k, v = (c.flatten(0, 1)[slots].transpose(0, 1)[None].contiguous() for c in (k_cache, v_cache))
    qs = q.transpose(0, 1)[None].contiguous()
    for impl, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        def make_call(i, backend=backend):
            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
            return call
        measure(dict(variant=impl, cache=full, peer=True, **base), make_call, kv_bytes, None, flops, default_ms)


def _best(rows, full: str) -> dict:
    """The fastest correct kernel row (peers aside) per cache and shape; 8-bit rows also
    against the 16-bit cache's fastest (`vs_best_16bit`)."""
    best = {}
    for row in rows:
        key = f"{row['cache']} {row['shape']}"
        if row.get("ok") and not row.get("peer") and (key not in best or row["ms"] < best[key]["ms"]):
            best[key] = {k: row[k] for k in ("variant", "ms", "tflop_s", "vs_default") if k in row}
    for key, row in best.items():
        cache, shape = key.split(" ", 1)
        fastest_full = best.get(f"{full} {shape}")
        if cache != full and fastest_full is not None:
            row["vs_best_16bit"] = round(fastest_full["ms"] / row["ms"], 3)
    return best


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="SEQSxQUERIESxCONTEXT,... (default: %(default)s: a 4k prompt, a 512-token chunk "
                             "after 3.5k)")
    parser.add_argument("--configs", default=None, help="comma-separated PREFILL_CONFIGS names (default: all)")
    parser.add_argument("--cache-dtypes", default=None,
                        help="int8,fp8 (fp8_e4m3 names fp8 too; default: those the device converts)")
    parser.add_argument("--num-heads", type=int, default=NUM_HEADS)
    parser.add_argument("--num-kv-heads", type=int, default=NUM_KV_HEADS)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--device", default=None, help="cuda, cpu or auto (default: cuda when there is one)")


def main(args) -> dict:
    return run(args.out, parse_shapes(args.shapes), args.configs.split(",") if args.configs else None,
               cache_dtype_names(args.cache_dtypes) if args.cache_dtypes else None, args.num_heads, args.num_kv_heads,
               args.head_dim, args.block_size, args.device)
