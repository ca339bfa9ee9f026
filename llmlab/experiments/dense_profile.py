"""How long a model's matrix products take at each number of rows, measured once: a lookup
table for the cost model (Vidur, MLSys '24, profiles every operator over a grid of shapes
and interpolates; this profiles the one operator whose time is not linear in its shape).

On a CPU a step's dense layers are most of its time, and oneDNN picks its kernels by the
number of rows, so their time jumps around instead of growing steadily. Measured on a
2-vCPU AMD EPYC VM (AVX-512), one thread, SmolLM2-135M in float32 (all 30 layers'
products, ms; BENCHMARKS.md, "Fidelity on the CPU"):

    rows     1    2    3    4    5    6    7    8   16   32   72  256
    layers  37   41   32   30   31   33   39   38   49   85  170  558

Three to six decodes stream the weights faster than one or two; from about 16 rows on the
work is compute-bound and grows with the rows. A model linear in decode tokens, fitted on
steps of 1-16 sequences, was 15-30% off for 3-5 of them. With this table the cost model
gets a `dense` term: the profiled seconds of a step's shape, times a fitted coefficient
(0.6-1.3 across runs: the intercept and per-token terms share the scale with it).

    profile = DenseProfile.measure(engine.model, max_tokens=256, max_sequences=16)
    CostModel.fit(trace, profile=profile)
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import numpy as np

DENSE_ROWS = 16     # every row count up to here is measured (decode batches); coarser above


@dataclass
class DenseProfile:
    rows: list[int]               # token rows through the decoder layers (a step's tokens)
    layer_seconds: list[float]    # qkv, o_proj, gate_up and down of every layer at that many rows
    head_rows: list[int]          # rows through the vocab projection (sequences that sample)
    head_seconds: list[float]
    measured_on: str = ""

    def seconds(self, num_tokens: int, num_sequences: int) -> float:
        """The profiled time of a step's matrix products: its tokens through every layer, the
        last token of each of its sequences through the vocab projection (a prompt chunk
        that does not end its prompt samples nothing; counting it is off by one row)."""
        return (interpolate(self.rows, self.layer_seconds, num_tokens)
                + interpolate(self.head_rows, self.head_seconds, num_sequences))

    @classmethod
    def measure(cls, model, max_tokens: int, max_sequences: int, repeats: int = 5) -> "DenseProfile":
        """Time `model`'s own weights (a LlamaModel) through `kernels.linear`, as its forward
        calls them, at every row count up to DENSE_ROWS and about 1.5x apart above, up to
        `max_tokens` (layers) and `max_sequences` (vocab projection). The median of `repeats`
        passes; a pass reads every layer's weights once, so they stream from memory as in a step
        (the inputs are random: a matrix product's time does not depend on the values)."""
        import torch

        from llmlab.kernels import linear

        c = model.config
        device, dtype = model.layers[0].qkv.device, model.layers[0].qkv.dtype
        rows = profile_rows(max_tokens)
        head_rows = profile_rows(max_sequences)
        generator = torch.Generator(device=device).manual_seed(0)

        def inputs(n, width):
            return torch.randn(n, width, generator=generator, device=device).to(dtype)

        def layers(n):
            x, attn, mlp = (inputs(n, w) for w in (c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size))

            def run():
                for layer in model.layers:    # each output dropped at once, as in the forward
                    linear(x, layer.qkv, layer.qkv_bias)
                    linear(attn, layer.o_proj)
                    linear(x, layer.gate_up)
                    linear(mlp, layer.down)
            return run

        def head(n):
            last = inputs(n, c.hidden_size)
            return lambda: linear(last, model.lm_head)

        passes = [layers(n) for n in rows] + [head(n) for n in head_rows]
        samples = [[] for _ in passes]
        with torch.inference_mode():
            # round by round over every row count, not one row count at a time: a burst of
            # other work on the machine then slows one sample of many rows, which the median
            # drops, instead of every sample of one row count (a bump the fit would believe)
            for _ in range(repeats + 1):
                for fn, times in zip(passes, samples):
                    _sync(device)
                    begin = time.perf_counter()
                    fn()
                    _sync(device)
                    times.append(time.perf_counter() - begin)
        seconds = [float(np.median(times[1:])) for times in samples]   # the first round pays first-call setup
        layer_seconds, head_seconds = seconds[:len(rows)], seconds[len(rows):]
        return cls(rows, layer_seconds, head_rows, head_seconds, measured_on=f"{device.type}, {dtype}".replace("torch.", ""))

    # ---- files (inside a CostModel's JSON) ---------------------------------------------------
    def to_dict(self) -> dict:
        return {"rows": self.rows, "layer_seconds": self.layer_seconds, "head_rows": self.head_rows,
                "head_seconds": self.head_seconds, "measured_on": self.measured_on}

    @classmethod
    def from_dict(cls, data: dict) -> "DenseProfile":
        return cls([int(r) for r in data["rows"]], [float(s) for s in data["layer_seconds"]],
                   [int(r) for r in data["head_rows"]], [float(s) for s in data["head_seconds"]],
                   data.get("measured_on", ""))


def profile_rows(max_rows: int) -> list[int]:
    """1, 2, ..., DENSE_ROWS, then about 1.5x apart (multiples of 8), ending at max_rows."""
    if max_rows < 1:
        raise ValueError(f"a profile needs at least 1 row, got {max_rows}")
    rows = list(range(1, min(DENSE_ROWS, max_rows) + 1))
    while rows[-1] < max_rows:
        rows.append(min(max_rows, max(rows[-1] + 8, int(rows[-1] * 1.5) // 8 * 8)))
    return rows


def interpolate(rows: list[int], seconds: list[float], x: float) -> float:
    """Linear between the measured row counts; 0 for 0 rows; past the last one, the line
    through the last two (a step larger than any profiled: compute-bound, linear in rows)."""
    if x <= 0:
        return 0.0
    if x <= rows[0] or len(rows) == 1:
        return seconds[0]
    # bisect on the plain lists: the simulator calls this every step, np.interp's conversions cost more
    i = min(bisect.bisect_left(rows, x), len(rows) - 1)      # rows[i - 1] < x <= rows[i], or past the end
    slope = (seconds[i] - seconds[i - 1]) / (rows[i] - rows[i - 1])
    return seconds[i] + (x - rows[i]) * slope


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
