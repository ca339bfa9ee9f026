"""The fast path's knobs, in one table: every performance switch of the kernels, each with
the environment variable that sets it.

Each fast path is a layer on the readable path; these turn layers off or retune them
(`llmlab bench ...` sweeps them). The variables are read once, when llmlab is imported;
after that the one object `knobs` holds them, and code (a benchmark, a notebook, a test)
may set a field directly:

    from llmlab.kernels import knobs
    knobs.gemv = False          # what LLMLAB_GEMV=0 does, from now on

| field           | variable             | default | what it does |
|-----------------|----------------------|---------|--------------|
| gemv            | LLMLAB_GEMV          | on      | GPU decode steps: 1 row to the Triton GEMV, 33-64 rows to the skinny GEMM (off: cuBLAS) |
| fold_norms      | LLMLAB_FOLD_NORMS    | off     | GPU decode steps of 1 or 33-64 rows: rms_norm and the residual add folded into the GEMV / skinny GEMM (triton/linear.py; not yet timed on a GPU) |
| combine_in_launch | LLMLAB_COMBINE_IN_LAUNCH | off | split decode attention (16-bit cache) combines its ranges in its own launch, not a second kernel (triton/decode_attention_bf16.py; not yet timed on a GPU) |
| swiglu_gemm     | LLMLAB_SWIGLU_GEMM   | off     | gate_up and silu_mul in one skinny-GEMM launch for 33-64 rows (measured no faster) |
| pdl             | LLMLAB_PDL           | on      | programmatic dependent launch of decode kernels on Hopper (triton/pdl.py) |
| prefetch_kb     | LLMLAB_PREFETCH      | 32      | KB of its weight rows a skinny-GEMM program asks L2 for before its PDL wait (0: none) |
| q8_decode       | LLMLAB_Q8_DECODE     | (none)  | the 8-bit decode-attention variant by name (triton/q8_configs.py; none: the default for the step's shape; an unknown name fails at import) |
| cpu_one_row     | LLMLAB_CPU_ONE_ROW   | (none)  | "mkl" or "onednn" for a float32 one-row product on a CPU (none: timed once per process) |
| sample_graphs   | LLMLAB_SAMPLE_GRAPHS | on      | the Triton sampler's launches replayed as CUDA graphs |
| sample_block    | LLMLAB_SAMPLE_BLOCK  | 512     | tokens per block in the sampler's passes |
| sample_warps    | LLMLAB_SAMPLE_WARPS  | 8       | warps per program of the sampler's passes |
| sample_programs | LLMLAB_SAMPLE_PROGRAMS | 512   | programs per batch the sampler aims for (chunks per row = this / rows) |
| sample_rounds   | LLMLAB_SAMPLE_ROUNDS | 3       | rejection checks before the sampler's radix fallback |
| sample_top_k_cap | LLMLAB_SAMPLE_TOP_K_CAP | 1024 | largest top_k the sampler's candidates path takes (0: every top-k row to the radix passes) |
| prompt_graphs   | LLMLAB_PROMPT_GRAPHS | on      | GPU steps that hold a prompt (up to 512 tokens) replay as CUDA graphs, attention included (cuda_graphs/prompt.py) |
| prefill_config  | LLMLAB_PREFILL_CONFIG | (none) | the prefill-attention launch variant by name, 16-bit queries on a GPU (triton/prefill_configs.py; none: the default; an unknown name fails at import) |

Knobs that the engine decides per run (CUDA graphs, async scheduling, the KV cache's
dtype, ...) are `EngineConfig` fields instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

ENVIRONMENT = {   # field -> the variable that sets it
    "gemv": "LLMLAB_GEMV", "fold_norms": "LLMLAB_FOLD_NORMS", "combine_in_launch": "LLMLAB_COMBINE_IN_LAUNCH",
    "swiglu_gemm": "LLMLAB_SWIGLU_GEMM", "pdl": "LLMLAB_PDL",
    "prefetch_kb": "LLMLAB_PREFETCH", "q8_decode": "LLMLAB_Q8_DECODE", "cpu_one_row": "LLMLAB_CPU_ONE_ROW",
    "sample_graphs": "LLMLAB_SAMPLE_GRAPHS", "sample_block": "LLMLAB_SAMPLE_BLOCK",
    "sample_warps": "LLMLAB_SAMPLE_WARPS", "sample_programs": "LLMLAB_SAMPLE_PROGRAMS",
    "sample_rounds": "LLMLAB_SAMPLE_ROUNDS", "sample_top_k_cap": "LLMLAB_SAMPLE_TOP_K_CAP",
    "prompt_graphs": "LLMLAB_PROMPT_GRAPHS", "prefill_config": "LLMLAB_PREFILL_CONFIG",
}


@dataclass
class Knobs:
    gemv: bool = True
    fold_norms: bool = False
    combine_in_launch: bool = False
    swiglu_gemm: bool = False
    pdl: bool = True
    prefetch_kb: int = 32
    q8_decode: str | None = None
    cpu_one_row: str | None = None
    sample_graphs: bool = True
    sample_block: int = 512
    sample_warps: int = 8
    sample_programs: int = 512
    sample_rounds: int = 3
    sample_top_k_cap: int = 1024
    prompt_graphs: bool = True
    prefill_config: str | None = None

    @classmethod
    def from_environment(cls, environ=os.environ) -> "Knobs":
        """The defaults, with every variable of the table that is set (and not empty) read."""
        values = {}
        for f in dataclasses.fields(cls):
            text = environ.get(ENVIRONMENT[f.name], "")
            if not text:
                continue
            if f.default is True or f.default is False:
                values[f.name] = text != "0" if f.default else text == "1"   # as the variables always read
            elif isinstance(f.default, int):
                try:
                    values[f.name] = int(text)
                except ValueError:
                    raise ValueError(f"{ENVIRONMENT[f.name]} must be an integer, got {text!r}") from None
            else:
                values[f.name] = text
        return cls(**values)


CATALOGUES: dict[str, dict] = {}   # knob -> the variants it may name (registered by check_variant)


def check_variant(field: str, value: str | None, catalogue: dict) -> None:
    """`value` (a knob's, e.g. from the environment) names one of `catalogue`'s variants, or
    is None. The catalogues (q8_configs.py, prefill_configs.py) check their knob so when
    imported, and the contract imports them: a typo in LLMLAB_Q8_DECODE or
    LLMLAB_PREFILL_CONFIG fails when llmlab is imported, on every machine, not at the first
    kernel call on a GPU. The catalogue is remembered, so that `parse_setting` checks its knob too."""
    CATALOGUES[field] = catalogue
    if value is not None and value not in catalogue:
        raise ValueError(f"{ENVIRONMENT[field]}={value!r} names no variant; known: {', '.join(sorted(catalogue))}")


def parse_setting(spec: str) -> dict:
    """A knob setting as a benchmark's command line gives it, `field=value[,field=value...]`
    (each value as its variable spells it: fold_norms=1), as {field: value}."""
    values = {}
    for part in spec.split(","):
        field, sep, text = (piece.strip() for piece in part.partition("="))
        if not sep or field not in ENVIRONMENT or not text:
            raise ValueError(f"knob setting {part!r}: use field=value with a field of {', '.join(ENVIRONMENT)}")
        values[field] = getattr(Knobs.from_environment({ENVIRONMENT[field]: text}), field)
        if field in CATALOGUES:    # a variant's name: checked now, not at the first kernel call
            check_variant(field, values[field], CATALOGUES[field])
    return values


@contextlib.contextmanager
def knobs_set(values: dict):
    """`knobs` with these fields set inside the `with` block, as they were after it."""
    saved = {field: getattr(knobs, field) for field in values}
    for field, value in values.items():
        setattr(knobs, field, value)
    try:
        yield
    finally:
        for field, value in saved.items():
            setattr(knobs, field, value)


knobs = Knobs.from_environment()
