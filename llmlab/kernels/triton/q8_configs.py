"""The 8-bit decode-attention variants: how codes become numbers and how the context is
tiled, by name. `llmlab bench decode-variants` times them all; `knobs.q8_decode` ($LLMLAB_Q8_DECODE; or
`q8_config(name)`) picks one for every step, else `default_q8_config` picks by the step's shape;
`decode_attention.decode_attention` runs it."""
from __future__ import annotations

import dataclasses

from ..tuning import check_variant, knobs


@dataclasses.dataclass(frozen=True, slots=True)
class Q8Config:
    """How the 8-bit decode kernel converts codes and tiles the context."""
    dequant: str        # "cast": codes.to(fp16); "magic": per code, int16 add; "packed": 4 codes per int32;
    #                     "prmt": 4 codes per byte-permute pair (PTX; fp8: the hardware cvt);
    #                     "legacy": the first kernel (codes.to(q.dtype), in triton_decode_attention.py);
    #                     "gluon": codes straight into MMA registers (gluon_decode_attention_q8.py; one warp)
    block_n: int        # keys per tile
    num_warps: int
    num_stages: int
    max_registers: int | None = None   # ptxas's cap per thread (maxnreg): 128 fits 4 programs of 4 warps per SM

    @property
    def name(self) -> str:
        cap = f"-r{self.max_registers}" if self.max_registers else ""
        return f"{self.dequant}-n{self.block_n}-w{self.num_warps}-s{self.num_stages}{cap}"


_VARIANTS = [
    Q8Config("legacy", 64, 4, 2),            # what BENCHMARKS.md measured: the same-run baseline
    Q8Config("cast", 64, 4, 2), Q8Config("magic", 128, 4, 2),
    Q8Config("packed", 64, 4, 2), Q8Config("packed", 128, 4, 2), Q8Config("packed", 128, 2, 2),
    Q8Config("packed", 256, 8, 1),
    Q8Config("prmt", 64, 4, 2), Q8Config("prmt", 64, 2, 2), Q8Config("prmt", 128, 4, 2),
    Q8Config("prmt", 128, 4, 3), Q8Config("prmt", 128, 2, 2), Q8Config("prmt", 256, 8, 1),
    Q8Config("prmt", 64, 4, 2, 128), Q8Config("prmt", 128, 4, 1, 128),  # 4 programs per SM
    # one warp per program; num_stages is the number of tiles staged in shared memory
    Q8Config("gluon", 16, 1, 2), Q8Config("gluon", 16, 1, 3), Q8Config("gluon", 16, 1, 4),
    Q8Config("gluon", 16, 1, 2, 112), Q8Config("gluon", 32, 1, 2, 144), Q8Config("gluon", 32, 1, 3),
    Q8Config("gluon", 64, 1, 3), Q8Config("gluon", 32, 1, 2),
]
Q8_CONFIGS = {config.name: config for config in _VARIANTS}
check_variant("q8_decode", knobs.q8_decode, Q8_CONFIGS)   # $LLMLAB_Q8_DECODE, at import
# Measured on the H200 (llmlab bench decode-variants, batch 64 x ctx 4096, Llama-3-8B heads):
# the Gluon kernel at 32-token tiles (two blocks, a TMA copy each) and 2 stages, 2 splits,
# 0.135 ms for int8 against 0.145 for 16-token tiles at their best (4 splits) and bf16's
# 0.246 (BENCHMARKS.md, eighth session); this file's best, "prmt" at 128-key tiles,
# 4 warps, 2 stages, took 0.231-0.249. Where Gluon does not run (the
# interpreter, head sizes other than 128, GQA groups over 8) the default runs "prmt"
# ("packed" in the interpreter).
DEFAULT_Q8_CONFIG = "gluon-n32-w1-s2"
GLUON_FALLBACK = "prmt-n128-w4-s2"  # where the Gluon kernel does not run (CPU, other head sizes)
SMALL_TILE_Q8_CONFIG = "gluon-n16-w1-s2"
# The shortest context range an 8-bit decode split takes (kernels.decode_num_splits): a
# 1,000-token context splits in two, 512 tokens do not. H200, 2026-12-05, int8 (`bench
# decode-variants --engine`, ms): 64 x 512 one split 0.0244, two 0.0258; 64 x 1000 two
# splits 0.0422 (the best of 1-8); 32 x 2000 four 0.0418 / 0.0434, two 0.0508 / 0.0433.
Q8_MIN_SPLIT_TOKENS = 500


def small_tiles_win(num_programs: int, num_splits: int) -> bool:
    """Whether 16-token tiles beat 32-token ones for a step of `num_programs` (sequence, kv
    head) pairs run in `num_splits` splits: when the batch alone gives 1,024 programs or more
    (8 per SM on 132 SMs; no split). H200, 2026-12-05, int8, ms at 16 / 32-token tiles: 128 x
    1000, one split, 0.0713 / 0.0976 and 0.0737 / 0.0980 (two calls); 256 x 1000 one split,
    16-token tiles the best of 1-8 splits (0.1408). Where a step is split, 32-token tiles win
    (64 x 4096, two splits: 0.1393 against 0.1511)."""
    return num_splits == 1 and num_programs >= 1024


def default_q8_config(num_seqs: int | None = None, num_kv_heads: int | None = None, num_splits: int = 1) -> str:
    """The default variant for a decode step's shape: DEFAULT_Q8_CONFIG, or SMALL_TILE_Q8_CONFIG
    where the measurements below put 16-token tiles ahead."""
    if num_seqs is not None and num_kv_heads is not None and small_tiles_win(num_seqs * num_kv_heads, num_splits):
        return SMALL_TILE_Q8_CONFIG
    return DEFAULT_Q8_CONFIG


def q8_config(name: str | None = None, num_seqs: int | None = None, num_kv_heads: int | None = None,
              num_splits: int = 1) -> Q8Config:
    """The named variant, else knobs.q8_decode ($LLMLAB_Q8_DECODE), else the default for the
    step's shape (`default_q8_config`; without a shape, DEFAULT_Q8_CONFIG)."""
    name = name or knobs.q8_decode or default_q8_config(num_seqs, num_kv_heads, num_splits)
    if name not in Q8_CONFIGS:
        raise ValueError(f"unknown 8-bit decode config {name!r}; known: {sorted(Q8_CONFIGS)}")
    return Q8_CONFIGS[name]
