"""The prefill-attention kernel's launch variants (tile shapes, warps, stages, and whether a
program takes all query heads of a kv head), by name. `llmlab bench prefill-variants` times
them all against the reference and the peers; `knobs.prefill_config`
($LLMLAB_PREFILL_CONFIG; or `prefill_config(name)`) picks one; `prefill_attention.prefill_attention`
runs it."""
from __future__ import annotations

import dataclasses

from ..tuning import check_variant, knobs


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillConfig:
    """How the prefill kernel tiles queries and keys."""
    block_m: int        # query rows per program
    block_n: int        # keys per tile
    num_warps: int
    num_stages: int     # tiles of K/V in flight (Triton's software pipeline)
    pack_gqa: bool = False   # a program's rows are the query heads of one kv head x block_m / group tokens,
    #                          so those heads share every K/V tile it loads (and dequantizes): fewer padded
    #                          rows for short chunks, as many tile loads per FLOP for long prompts; where the
    #                          group is not a power of two or leaves under 16 tokens a tile: one head
    dequant_first: bool = False   # over an 8-bit cache: dequantize the sequences' blocks once into a
    #                               16-bit scratch cache, then run the 16-bit kernel (16-bit caches: no change)
    warp_specialized: bool = False  # the Gluon kernel for Hopper (gluon/prefill_attention.py): a loader
    #                                 warpgroup and two consumer warpgroups, 128 x 128 tiles, num_stages
    #                                 K/V stages; where it does not apply, the Triton kernel with 8 warps

    @property
    def name(self) -> str:
        return (f"m{self.block_m}-n{self.block_n}-w{self.num_warps}-s{self.num_stages}"
                + ("-gqa" if self.pack_gqa else "") + ("-ws" if self.warp_specialized else "")
                + ("-dq" if self.dequant_first else ""))


# Register use at head size 128, bf16 queries (ptxas -v for sm_90a, Triton 3.6): 128 x 128 tiles
# with 8 warps fill the 255 registers a thread may have and, over an 8-bit cache, spill 300
# bytes; 128 x 64 tiles need 183 (bf16) and 255 without spilling (8-bit). Not listed, as they
# spill: 64 x 128 tiles with 4 warps (180 bytes in bf16), and 256-row tiles with 16 warps,
# which cap a thread at 128 registers (kilobytes).
_VARIANTS = [
    PrefillConfig(128, 128, 8, 3),    # the default over 16-bit caches
    PrefillConfig(128, 128, 8, 2), PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 64, 8, 4),
    PrefillConfig(64, 64, 4, 3),
    PrefillConfig(128, 128, 8, 3, True), PrefillConfig(128, 64, 8, 3, True), PrefillConfig(64, 64, 4, 3, True),
    # Dequantizing in the kernel repeats the work: every (query head, query tile) program converts
    # each K/V tile it reads, so a 4k prompt converts 32 heads x 528 (query, key) tile pairs =
    # 16,896 tiles of the 8 kv heads x 32 = 256 there are, 66 times each on average. Once, into
    # a scratch cache, is one pass over the context's codes.
    PrefillConfig(128, 128, 8, 3, dequant_first=True), PrefillConfig(128, 64, 8, 3, dequant_first=True),
    # FlashAttention-3's structure in Gluon (Hopper only): 12 warps, 2 or 3 stages of K and V
    # (160 or 224 KB of shared memory). Compiled for sm_90a with Triton 3.6: 168 registers at
    # launch, the consumers raised to 240 by setmaxnreg, no spills. Not timed yet.
    PrefillConfig(128, 128, 12, 2, warp_specialized=True), PrefillConfig(128, 128, 12, 3, warp_specialized=True),
    PrefillConfig(128, 128, 12, 2, warp_specialized=True, dequant_first=True),
]
PREFILL_CONFIGS = {config.name: config for config in _VARIANTS}
check_variant("prefill_config", knobs.prefill_config, PREFILL_CONFIGS)   # $LLMLAB_PREFILL_CONFIG, at import
# Tuned on an H200 (Llama-3-8B shapes, 4k causal): two warpgroups per 128-query tile, 128-key
# tiles, loads issued two tiles ahead; over an 8-bit cache, the blocks dequantized first
# (`bench prefill-variants`, 2026-12-05: int8 / fp8 0.436 / 0.434 ms against bf16's 0.431 for
# a 4k prompt, 0.958 / 1.046 converting in the kernel; 0.099 against 0.098 for a 512-token
# chunk after 3.5k). Packing GQA heads (-gqa) took 0.397 for the 4k prompt but 0.100 for the chunk.
DEFAULT_PREFILL_CONFIG = "m128-n128-w8-s3-dq"       # 16-bit queries on a GPU; -dq: no change over 16-bit caches
FLOAT32_CONFIG = PrefillConfig(64, 32, 4, 2)        # fp32 tiles are twice the bytes: three stay in shared memory
INTERPRETER_CONFIG = PrefillConfig(64, 32, 4, 1)    # few, large programs; a small block_n exercises multi-tile paths


def prefill_config(name: str | None = None) -> PrefillConfig:
    """The named variant, else knobs.prefill_config ($LLMLAB_PREFILL_CONFIG), else the default."""
    name = name or knobs.prefill_config or DEFAULT_PREFILL_CONFIG
    if name not in PREFILL_CONFIGS:
        raise ValueError(f"unknown prefill-attention config {name!r}; known: {sorted(PREFILL_CONFIGS)}")
    return PREFILL_CONFIGS[name]
