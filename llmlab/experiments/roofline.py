"""The per-step bound: a clock for the simulator that runs every step at the machine's ceilings.

A step cannot take less than the time to move its bytes at the copy bandwidth, nor less than
the time to do its FLOPs at the matrix-multiply peak, so each step is given

    max(bytes / bandwidth, FLOPs / peak)

    bytes   every layer's weights and the logits' matrix, read once a step; the K/V of every
            decoding sequence's context, read; the K/V of the step's new tokens, written (a
            prompt chunk's reads of its cached context are left out: a lower bound)
    FLOPs   2 x the layers' weights per token, 2 x the logits' matrix per sampling row (every
            decode and prompt chunk), and attention's 4 x heads x head_dim per query-key pair
            in every layer (the decodes' contexts; each chunk attends causally)

from the same step features the fitted CostModel reads (cost_model.step_features). Simulating
a workload with it (`simulate(workload, config, Roofline(...))`) runs the engine's own
scheduler, so its duration is the bound for that schedule: `llmlab bench offline` prints its
run's throughput as a share of it, the "limit" column of BENCHMARKS.md for offline runs.

That bound lets a step's memory-bound work (reading K/V for attention) hide under its
compute-bound work (the products over a prompt chunk's rows), as if they ran at once.
llmlab's forward runs them one after another, layer by layer. `overlapped=False` is the
bound of that order: the matrix products (weights read once, 2 x parameters FLOPs a row),
decode attention (the K/V read, its FLOPs), prefill attention (its FLOPs) and the new
tokens' K/V written, each at its own max(bytes / bandwidth, FLOPs / peak), summed. It is the
lower bound of every forward whose kernels do not overlap; between it and the overlapped
bound lies what only overlapping kernels (attention beside the products: streams,
nano-batches) can win.
"""
from __future__ import annotations

from llmlab.config import ModelConfig
from llmlab.experiments.cost_model import FEATURES, CostModel

# the lent H200's measured ceilings (BENCHMARKS.md; `llmlab bench kernels` rates its kernels
# against them): device-to-device copy, bytes read + written; bf16 8192^3 torch.matmul on
# random data
H200_TB_S, H200_TFLOP_S = 4.27, 790.0


class Roofline(CostModel):
    def __init__(self, model: ModelConfig, weight_bytes: int, kv_bytes_per_token: float, tb_s: float,
                 tflop_s: float, meta: dict | None = None, overlapped: bool = True):
        """`weight_bytes`: bytes of one element of the weights (2 for bf16); `kv_bytes_per_token`:
        the K/V cache's bytes per token over all layers (scales of an 8-bit cache included);
        `tb_s`, `tflop_s`: the ceilings, in TB/s and TFLOP/s; `meta` as a CostModel's (the
        simulator reads num_gpu_blocks and max_model_len from it); `overlapped=False`: the
        products, attention and the K/V writes one after another (the module's docstring)."""
        if not (tb_s > 0 and tflop_s > 0):
            raise ValueError(f"the ceilings must be positive, got {tb_s} TB/s and {tflop_s} TFLOP/s")
        m = model
        self.layer_params = m.num_layers * m.hidden_size * (
            (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + m.num_heads * m.head_dim + 3 * m.intermediate_size)
        self.logits_params = m.vocab_size * m.hidden_size
        self.attention_flops_per_pair = 4 * m.num_layers * m.num_heads * m.head_dim
        self.weight_bytes, self.kv_bytes_per_token = weight_bytes, kv_bytes_per_token
        self.bandwidth, self.peak = tb_s * 1e12, tflop_s * 1e12
        self.overlapped = overlapped
        meta = dict(meta or {}, roofline={"tb_s": tb_s, "tflop_s": tflop_s, "overlapped": overlapped})
        super().__init__({}, meta)

    @classmethod
    def of_engine(cls, engine, tb_s: float = H200_TB_S, tflop_s: float = H200_TFLOP_S,
                  overlapped: bool = True) -> "Roofline":
        """The bound of an LLMEngine's model, weights' dtype and KV cache."""
        cache = engine.runner.kv_cache
        # [layers, K and V, blocks, block_size, ...]: one token's K and V in every layer
        per_token = sum(t.shape[0] * t.shape[1] * t[0, 0, 0, 0].numel() * t.element_size()
                        for t in (cache.device, cache.device_scales) if t is not None)
        meta = {"num_gpu_blocks": engine.runner.num_device_blocks, "max_model_len": engine.max_model_len}
        return cls(engine.model_config, engine.dtype.itemsize, per_token, tb_s, tflop_s, meta, overlapped)

    def predict(self, features) -> float:
        f = dict(zip(FEATURES, features))
        tokens = f["prefill_tokens"] + f["decode_tokens"]
        sampling_rows = f["decode_tokens"] + f["num_prefills"]
        pairs = f["decode_context"] + 1000 * f["prefill_attention"]
        weights = self.weight_bytes * (self.layer_params + self.logits_params)
        products = 2 * self.layer_params * tokens + 2 * self.logits_params * sampling_rows
        read, written = self.kv_bytes_per_token * f["decode_context"], self.kv_bytes_per_token * tokens
        attention = self.attention_flops_per_pair * pairs
        if self.overlapped:
            return max((weights + read + written) / self.bandwidth, (products + attention) / self.peak)
        decode_attention = self.attention_flops_per_pair * f["decode_context"]   # the decode kernel's
        return (max(weights / self.bandwidth, products / self.peak)
                + max(read / self.bandwidth, decode_attention / self.peak)
                + (attention - decode_attention) / self.peak + written / self.bandwidth)

    @property
    def fitted_range(self):
        return None   # no fit: nothing it predicts is an extrapolation of measured steps

    def to_dict(self) -> dict:
        return {"roofline": self.meta["roofline"], "meta": self.meta}
