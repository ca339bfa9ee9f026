"""Every 8-bit decode-attention variant (`Q8_CONFIGS`: conversion x tile shape) against the
bf16 kernel, v1 and v2, in one run, so the winner can be picked from one GPU session.

    llmlab bench decode-variants --out decode_variants.json            # H200: Llama-3-8B heads
    llmlab bench decode-variants --shapes 2x40 --num-heads 4 --num-kv-heads 2 --head-dim 64 \\
        --configs packed-n64-w4-s2 --splits 1,3                          # CPU: the interpreter, seconds

Each row: ms (CUDA-graph replay on a GPU; wall time of an interpreted call on a CPU), TB/s
of the bytes the kernel must read (codes + one float32 scale per row for 8-bit caches),
the speed-up over the bf16 row with the same splits, and the largest difference from
`reference.decode_attention` on the same cache (a variant that is fast but wrong says so
in `ok`). A variant that fails to compile becomes a row with its error. The summary's
fastest 8-bit row per shape also has `speedup_vs_best_bf16`: against the bf16 kernel at its
own fastest split count in the run (v1 at batch 64 x 4k), the comparison the KV-quantization
aim is about.
"""
from __future__ import annotations

import itertools
import math

import torch

from llmlab.bench.common import (BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, QUANTIZED_CACHE_DTYPES,
                                 cache_dtype_names, paged_cache, quantize_paged_cache, variant_setup, variant_time_ms,
                                 write_json)
from llmlab.kernels import reference
from llmlab.machine import versions

# outputs are averages of N(0, 1) values; 16-bit dots and outputs (bench_kernels' bf16 tolerance)
TOLERANCE = dict(atol=2e-2, rtol=2e-2)


def run(out_path=None, shapes=((64, 4096), (64, 512)), configs=None, splits=(1, 2, 4), cache_dtypes=None,
        num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE, device=None,
        scale_layouts=("slot",), engine=False) -> dict:
    """Time the bf16 (fp16 on a CPU) kernel and every named 8-bit config on each
    (batch, context) shape; print a table, return {"device", "rows", "best"} (also as
    JSON to out_path). scale_layouts: "slot" (the cache's: a slot's kv-head scales side
    by side) and/or "head" (a kv head's scales of a block side by side, the same logical
    [blocks, block_size, kv_heads] tensor with other strides; the Gluon kernel only).
    engine: also time what the engine runs at each shape, the split count
    `kernels.decode_num_splits` gives and, over an 8-bit cache, the variant
    `q8_configs.q8_config` picks for it (rows "engine: NAME"; the summary's "engine")."""
    from llmlab import kernels
    from llmlab.kernels.triton import decode_attention as triton_decode_attention
    from llmlab.kernels.triton.q8_configs import Q8_CONFIGS, q8_config

    device, on_gpu, dtype, cache_dtypes, names = variant_setup(device, cache_dtypes, configs, Q8_CONFIGS)
    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    rows = []
    header = "| variant | cache | shape | splits | ms | TB/s | vs bf16 | max err |\n|---|---|---|---|---|---|---|---|"
    software = versions()
    print(f"{torch.cuda.get_device_name() if on_gpu else 'cpu (Triton interpreter)'}, torch {software['torch']}, "
          f"triton {software['triton']}, heads {num_heads}/{num_kv_heads} x {head_dim}, "
          f"block size {block_size}\n{header}", flush=True)

    header_info = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", **software,
                   "heads": [num_heads, num_kv_heads, head_dim], "block_size": block_size}

    def measure(row, make_call, num_bytes, expected, baseline_ms=None):
        """Fill row with the timing, the speed-up over baseline_ms and the error against
        `expected`, or with the error message."""
        row["bytes_read"] = num_bytes
        try:
            out = make_call(0)()
            error = (out.float() - expected).abs().max().item()
            row.update(max_abs_err=round(error, 6), ok=bool(torch.allclose(out.float(), expected, **TOLERANCE)))
            ms, ms_eager = variant_time_ms(make_call, num_bytes, on_gpu)
            row.update(ms=round(ms, 4), ms_eager=round(ms_eager, 4), tb_s=round(num_bytes / ms / 1e9, 3))
            if baseline_ms:
                row["speedup_vs_bf16"] = round(baseline_ms / ms, 2)
        except Exception as error:  # noqa: BLE001 -- a variant that does not compile here is a finding
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        rows.append(row)
        write_json(out_path, {**header_info, "rows": rows})   # after every row: a run cut short keeps them
        rate = f"{row['ms']:.4f} | {row['tb_s']}" if "ms" in row else f"failed: {row['error'][:80]} |"
        print(f"| {row['variant']} | {row['cache']} | {row['batch']}x{row['context']} | {row['num_splits']} | {rate} "
              f"| {row.get('speedup_vs_bf16', '')} | {row.get('max_abs_err', '')}{'' if row.get('ok', True) else ' NOT OK'} |",
              flush=True)

    for batch, context in shapes:
        rows_read = 2 * batch * context * num_kv_heads  # K and V rows, each read once
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
        # Enough input sets that one pass over them does not fit in L2 (on a GPU).
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) if on_gpu else 0
        num_sets = max(1, min(8, math.ceil(4 * l2 / (rows_read * (head_dim + 4)))))
        caches = [paged_cache([context] * batch, num_kv_heads, head_dim, block_size, dtype, device, gen)
                  for _ in range(num_sets)]
        shape = dict(batch=batch, context=context)

        bf16_ms = {}
        expected = reference.decode_attention(q, *caches[0], seq_lens, scale).float()
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else None
        engine_splits = {quantized: kernels.decode_num_splits(batch, num_kv_heads, context, num_sms, quantized)
                         for quantized in (False, True)}
        bf16_runs = [(f"{str(dtype)[6:]} (unchanged kernel)", n) for n in splits]
        if engine:
            bf16_runs.append((f"engine: {str(dtype)[6:]}", engine_splits[False]))
        for label, num_splits in bf16_runs:
            row = dict(variant=label, cache=str(dtype)[6:], num_splits=num_splits, **shape)
            measure(row, lambda i, n=num_splits: (lambda k, v, t: lambda: triton_decode_attention.decode_attention(
                q, k, v, t, seq_lens, scale, n))(*caches[i % num_sets]), rows_read * head_dim * dtype.itemsize,
                expected)
            if "ms" in row:
                bf16_ms[num_splits] = min(row["ms"], bf16_ms.get(num_splits, row["ms"]))

        for cache_name in cache_dtypes:
            cache_dtype = QUANTIZED_CACHE_DTYPES[cache_name]
            quantized = [quantize_paged_cache(*cache, cache_dtype) for cache in caches]
            k_codes, v_codes, block_tables, k_scales, v_scales = quantized[0]
            expected = reference.decode_attention(q, k_codes, v_codes, block_tables, seq_lens, scale, 1,
                                                  k_scales, v_scales).float()
            by_layout = {"slot": quantized,
                         "head": [(k, v, t, _head_major(ks), _head_major(vs)) for k, v, t, ks, vs in quantized]}
            runs = [(layout, name, num_splits, "") for layout, name, num_splits
                    in itertools.product(scale_layouts, names, splits)]
            if engine:
                num_splits = engine_splits[True]
                runs.append(("slot", q8_config(None, batch, num_kv_heads, num_splits).name, num_splits, "engine: "))
            for layout, name, num_splits, prefix in runs:
                config = Q8_CONFIGS[name]
                if layout == "head" and (config.dequant != "gluon" or not on_gpu):  # where Gluon runs
                    continue
                label = prefix + name + ("" if layout == "slot" else " (head-major scales)")
                row = dict(variant=label, cache=cache_name, num_splits=num_splits, dequant=config.dequant,
                           scale_layout=layout, block_n=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages, **shape)

                def make_call(i, name=name, num_splits=num_splits, sets=by_layout[layout]):
                    k, v, t, ks, vs = sets[i % num_sets]
                    return lambda: triton_decode_attention.decode_attention(q, k, v, t, seq_lens, scale, num_splits,
                                                                           ks, vs, q8_variant=name)
                measure(row, make_call, rows_read * (head_dim * cache_dtype.itemsize + 4), expected,
                        bf16_ms.get(num_splits))
            del quantized, by_layout, expected
        del caches
        if on_gpu:
            torch.cuda.empty_cache()

    best = {}
    for row in rows:
        key = f"{row['cache']} {row['batch']}x{row['context']}"
        if row.get("ok") and (key not in best or row["ms"] < best[key]["ms"]):
            best[key] = {k: row[k] for k in ("variant", "num_splits", "ms", "tb_s", "speedup_vs_bf16") if k in row}
    baseline = str(dtype)[6:]
    for key, row in best.items():
        cache, shape_key = key.split(" ", 1)
        full = best.get(f"{baseline} {shape_key}")
        if cache != baseline and full is not None:
            row["speedup_vs_best_bf16"] = round(full["ms"] / row["ms"], 3)
    print("fastest correct variant per cache and shape:")
    for key, row in best.items():
        print(f"  {key}: {row}")
    chosen = {}
    for row in rows:   # the engine's 8-bit choice against the best full-precision row of its shape
        full = best.get(f"{baseline} {row['batch']}x{row['context']}")
        if row["variant"].startswith("engine: ") and row["cache"] != baseline and "ms" in row and full:
            chosen[f"{row['cache']} {row['batch']}x{row['context']}"] = {
                "variant": row["variant"][8:], "num_splits": row["num_splits"], "ms": row["ms"], "ok": row["ok"],
                "speedup_vs_best_bf16": round(full["ms"] / row["ms"], 3)}
    if chosen:
        print("what the engine runs:")
        for key, row in chosen.items():
            print(f"  {key}: {row}")
    result = {**header_info, "rows": rows, "best": best, **({"engine": chosen} if chosen else {})}
    write_json(out_path, result)
    return result


def _head_major(scales):
    """The same [blocks, block_size, kv_heads] scales, stored kv head by kv head within a block."""
    return scales.transpose(1, 2).contiguous().transpose(1, 2)


def _ints(text):
    return tuple(int(x) for x in text.split(","))


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--shapes", default="64x4096,64x512", help="BATCHxCONTEXT,... (default: %(default)s)")
    parser.add_argument("--configs", default=None, help="comma-separated Q8_CONFIGS names (default: all)")
    parser.add_argument("--splits", default="1,2,4", help="num_splits to run each variant with (default: %(default)s)")
    parser.add_argument("--cache-dtypes", default=None,
                        help="int8,fp8 (fp8_e4m3 names fp8 too; default: those the device converts)")
    parser.add_argument("--num-heads", type=int, default=NUM_HEADS)
    parser.add_argument("--num-kv-heads", type=int, default=NUM_KV_HEADS)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--device", default=None, help="cuda, cpu or auto (default: cuda when there is one)")
    parser.add_argument("--engine", action="store_true",
                        help="also time the split count and 8-bit variant the engine picks at each shape")
    parser.add_argument("--scale-layouts", default="slot",
                        help="slot,head: also time the Gluon kernel on scales stored kv head by kv head")


def main(args) -> dict:
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    return run(args.out, shapes, args.configs.split(",") if args.configs else None, _ints(args.splits),
               cache_dtype_names(args.cache_dtypes) if args.cache_dtypes else None, args.num_heads, args.num_kv_heads,
               args.head_dim, args.block_size, args.device, tuple(args.scale_layouts.split(",")), args.engine)
