"""gemv: one row (a batch-1 decode step) or a few (a batch) times each weight of the
Llama-3-8B shape, cuBLAS against the Triton GEMV's variants (one row) or the skinny GEMM's
tiles (2-64 rows, as the engine uses it; up to 256 without split-K, beside cuBLAS at a large
decode batch), in TB/s of weight bytes.

Each weight is copied until the copies outgrow the L2 cache, and the calls cycle through
them inside one CUDA graph, as a decode step's layers do: what is timed is weights coming
from HBM, without launch gaps. Every variant's result is checked against F.linear.

    llmlab bench gemv                                   # the H200: all variants
    llmlab bench gemv --shapes 256x512 --configs n16-k512-w4-s2   # CPU: the interpreter, a check
    llmlab bench gemv --rows 64 --shapes 4096x4096 --skinny-configs n32-k256-w4-s4,n128-k128-w4-s4-split4
    llmlab bench gemv --rows 128,192,256 --skinny-configs none   # cuBLAS at a large decode batch
    llmlab bench gemv --rows 128,192,256 --shapes 6144x4096      # the skinny GEMM's grid beside it

On the H200 each row also gives TFLOP/s and the share of its bound, max(bytes / 4.27 TB/s,
FLOPs / 790 TFLOP/s), that the time reaches (`experiments/roofline.py`'s ceilings): where a
batch of a hundred-odd rows sits at the ridge, the bound the offline benchmark compares with.
"""
from __future__ import annotations

from llmlab.bench.common import LLAMA3_8B_WEIGHTS, graph_replay_ms, write_json


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", default=None, help="comma-separated NxK (default: Llama-3-8B's five)")
    parser.add_argument("--configs", default=None, help="comma-separated GEMV_CONFIGS names (default: all)")
    parser.add_argument("--rows", default="1", help="rows of x: 1 times the GEMV, 2-64 the skinny GEMM")
    parser.add_argument("--skinny-configs", default=None,
                        help="for rows > 1: comma-separated tiles nN-kK-wW-sS for the skinny GEMM (default: a grid; "
                             "none: cuBLAS alone)")
    parser.add_argument("--out", default=None)


# Split-K tiles for the narrow-output weights (4096 and 6144 outputs; K 4096 and 14336): a
# 128-wide tile reads x 4x less often than a 32-wide one, and splitting K keeps ~128 programs
SPLIT_K_CANDIDATES = ("n128-k128-w4-s4-split4", "n128-k128-w8-s4-split4", "n128-k64-w4-s6-split4",
                      "n64-k128-w4-s5-split2", "n64-k128-w4-s5-split4", "n128-k128-w4-s4-split2",
                      "n128-k128-w8-s4-split8", "n64-k256-w4-s3-split4")


def skinny_configs(args, rows: int = 64):
    """The skinny GEMM's tiles to time at `rows` rows: --skinny-configs (GemvConfig names,
    nN-kK-wW-sS with an optional -splitS), else a grid of those whose stages fit in shared
    memory, and up to 64 rows the split-K candidates (the kernel splits K for 64 rows at most)."""
    from llmlab.kernels.dense.gemv import GemvConfig

    if args.skinny_configs == "none":
        return []
    if args.skinny_configs:
        return [GemvConfig.from_name(name) for name in args.skinny_configs.split(",")]
    if rows <= 64:
        grid = [GemvConfig(n, bk, w, st) for n in (32, 64, 128) for bk in (64, 128, 256) for w in (4, 8)
                for st in (3, 4, 5) if (w == 4 or n == 128) and (64 + n) * bk * 2 * st <= 200 * 1024]
        return grid + [GemvConfig.from_name(name) for name in SPLIT_K_CANDIDATES]
    # past 64 rows: every row in one tile (padded to a power of two) or tiles of 64 / 128 rows
    padded = 1 << (rows - 1).bit_length()
    return [GemvConfig(n, bk, w, st, block_m=bm) for bm in (0, 64, 128) if bm < padded
            for n in (64, 128) for bk in (64, 128) for w in (4, 8) for st in (3, 4)
            if ((bm or padded) + n) * bk * 2 * st <= 200 * 1024]


def main(args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from llmlab.kernels.dense.gemv import GEMV_CONFIGS, gemv
    from llmlab.experiments.roofline import H200_TB_S, H200_TFLOP_S
    from llmlab.kernels.dense.skinny_gemm import skinny_gemm

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = ({f"{s}": tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")}
              if args.shapes else LLAMA3_8B_WEIGHTS)
    unknown = [name for name in (args.configs or "").split(",") if name and name not in GEMV_CONFIGS]
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; known: {sorted(GEMV_CONFIGS)}")
    configs = [GEMV_CONFIGS[name] for name in args.configs.split(",")] if args.configs else list(GEMV_CONFIGS.values())
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for label, (n, k) in shapes.items():
        copies = max(2, -(-4 * 50 * 2**20 // (n * k * 2))) if cuda else 1   # 4x a 50 MB L2
        weights = [torch.randn(n, k, generator=gen, device=device).mul_(0.02).to(dtype) for _ in range(copies)]
        nbytes = n * k * weights[0].element_size()
        for m in rows:
            x = torch.randn(m, k, generator=gen, device=device).to(dtype)
            expected = F.linear(x, weights[0])
            methods = [("cublas", lambda w, x=x: F.linear(x, w))]
            if m == 1:
                methods += [(f"triton {c.name}", lambda w, x=x, c=c: gemv(x, w, c)) for c in configs]
            else:
                methods += [(f"skinny {c.name}", lambda w, x=x, c=c: skinny_gemm(x, w, c))
                            for c in skinny_configs(args, m)]
            for name, fn in methods:
                try:
                    got = fn(weights[0])
                except Exception as err:   # a tile that does not fit in shared memory
                    print(f"{label:8} rows {m:>3} {name:32} skipped: {str(err)[:60]}")
                    continue
                err = (got.float() - expected.float()).abs().max().item()
                scale = expected.float().abs().max().item()
                row = {"shape": label, "n": n, "k": k, "rows": m, "method": name, "max_abs_err": err,
                       "ok": err <= 2e-2 * scale + 1e-3}
                if cuda:
                    ms = graph_replay_ms([lambda w=w, fn=fn: fn(w) for w in weights] * 3)
                    flops, moved = 2 * m * n * k, nbytes + (m * k + m * n) * x.element_size()
                    bound_ms = max(moved / H200_TB_S / 1e9, flops / H200_TFLOP_S / 1e9)
                    row.update(ms=ms, tb_s=nbytes / ms / 1e9, tflop_s=flops / ms / 1e9,
                               of_h200_bound=round(bound_ms / ms, 3))
                # the same bits after the timed replays: split-K's tile counters were left at 0
                row["repeatable"] = bool(torch.equal(fn(weights[0]), got))
                row["ok"] = row["ok"] and (row["repeatable"] or name == "cublas")
                results.append(row)
                print(f"{label:8} {n:>6}x{k:<6} rows {m:>3} {name:32} "
                      + (f"{row['ms'] * 1000:8.1f} us {row['tb_s']:5.2f} TB/s {row['tflop_s']:6.1f} TFLOP/s "
                         f"{row['of_h200_bound']:6.1%} of bound " if cuda else "")
                      + f"err {err:.2e}{'' if row['repeatable'] else '  NOT REPEATABLE'}"
                      + f"{'' if row['ok'] else '  MISMATCH'}", flush=True)
        del weights
    write_json(args.out, results, indent=2)
    return results
