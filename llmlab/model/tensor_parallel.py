"""Tensor parallelism the Megatron-LM way (Shoeybi et al. 2019, §3): how a LlamaModel is
cut into `tp` shards, one per rank (GPU), and the collectives that stitch them together.

Each rank keeps
- attention: H / tp query heads and the kv heads they read. q/k/v are column-parallel
  (rows of the fused qkv weight), o_proj is row-parallel (its columns), so each rank's
  o_proj output is a partial sum over its heads: one all-reduce per layer. With fewer kv
  heads than ranks (Hkv < tp) each kv head is replicated on the tp / Hkv ranks that hold
  the query heads of its group. The KV cache follows: a rank caches only its kv heads.
- MLP: gate and up column-parallel (I / tp rows of each), down row-parallel: one
  all-reduce per layer.
- embedding, vocab-parallel: rows [rank V', (rank + 1) V') of the table padded to
  V = tp V'; a rank outputs zeros for ids outside its rows, an all-reduce sums.
- lm_head, vocab-parallel too: each rank computes the logits of its vocab slice, an
  all-gather concatenates them and the padding is cut off.
- norms: replicated (they are tiny).

A shard is a TensorParallelShard: a LlamaModel of a smaller config (`shard_config`) whose
embedding, attention, MLP and logits are the model's own followed by a collective of its
TensorParallelGroup. Parallelism wraps the forward's parts from outside (as gpt-fast's
tp.py hooks its modules); LlamaModel.forward itself has none. The communication goes
through torch.distributed (NCCL on GPUs, gloo on CPU); the process groups are set up by
llmlab.engine.parallel.executor, and the weights handed out by llmlab.engine.parallel.placement (which
also cuts the layers into pipeline stages).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmlab.config import ModelConfig
from llmlab.model.llama import LayerWeights, LlamaModel


# ---- which sizes work ---------------------------------------------------------------------

def check_tensor_parallel_size(config: ModelConfig, tp: int) -> None:
    """ValueError unless `tp` ranks can share the model's heads and MLP evenly."""
    heads, kv_heads, intermediate = config.num_heads, config.num_kv_heads, config.intermediate_size

    def fits(n):
        return heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0) and intermediate % n == 0

    if fits(tp):
        return
    valid = [n for n in range(1, heads + 1) if fits(n)]
    if heads % tp:
        why = f"it does not divide the model's {heads} attention heads"
    elif kv_heads % tp and tp % kv_heads:
        why = (f"the model's {kv_heads} kv heads can neither be split over {tp} ranks nor "
               f"replicated evenly ({tp} is not a multiple of {kv_heads})")
    else:
        why = f"it does not divide the model's MLP width (intermediate_size {intermediate})"
    raise ValueError(f"tensor_parallel_size={tp} does not fit this model: {why}; "
                     f"sizes that fit: {valid}")


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The architecture one rank runs: its share of the heads and of the MLP width.
    vocab_size stays the whole vocabulary: logits come back whole after the all-gather."""
    check_tensor_parallel_size(config, tp)
    return dataclasses.replace(config, num_heads=config.num_heads // tp,
                               num_kv_heads=max(config.num_kv_heads // tp, 1),
                               intermediate_size=config.intermediate_size // tp)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def kv_heads_of_rank(config: ModelConfig, rank: int, tp: int) -> range:
    """The kv heads rank `rank` keeps. Query head j reads kv head j // (H / Hkv); a rank
    holds query heads [rank H/tp, (rank + 1) H/tp), so it needs exactly these."""
    kv_heads = config.num_kv_heads
    if kv_heads >= tp:
        per_rank = kv_heads // tp
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp // kv_heads)          # replicated on tp / Hkv consecutive ranks
    return range(head, head + 1)


# ---- cutting the weights --------------------------------------------------------------------

def named_weights(model: LlamaModel) -> dict[str, torch.Tensor]:
    """Every weight of the model by name ("embed", "layers.3.qkv", ...); a tied lm_head
    is the embedding and is not listed twice."""
    weights = {"embed": model.embed, "norm": model.norm}
    if model.lm_head is not model.embed:
        weights["lm_head"] = model.lm_head
    for i, layer in enumerate(model.layers):
        for field, tensor in vars(layer).items():
            if tensor is not None:
                weights[f"layers.{i}.{field}"] = tensor
    return weights


def shard_weight(name: str, tensor: torch.Tensor, config: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s part of the full-model weight `name` (a key of `named_weights`)."""
    kind = name.rsplit(".", 1)[-1]
    d = config.head_dim
    if kind in ("embed", "lm_head"):                       # vocab-parallel rows
        rows = padded_vocab_size(config.vocab_size, tp) // tp
        padded = F.pad(tensor, (0, 0, 0, rows * tp - tensor.shape[0]))
        return padded[rank * rows:(rank + 1) * rows].contiguous()
    if kind in ("qkv", "qkv_bias"):                         # column-parallel, by heads
        heads = config.num_heads // tp
        kv = kv_heads_of_rank(config, rank, tp)
        q, k, v = tensor.split([config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d])
        return torch.cat([q[rank * heads * d:(rank + 1) * heads * d],
                          k[kv.start * d:kv.stop * d], v[kv.start * d:kv.stop * d]]).contiguous()
    if kind == "gate_up":                                   # column-parallel, both halves
        width = config.intermediate_size // tp
        gate, up = tensor.chunk(2)
        return torch.cat([gate[rank * width:(rank + 1) * width], up[rank * width:(rank + 1) * width]])
    if kind == "o_proj":                                    # row-parallel: input columns
        width = config.num_heads // tp * d
        return tensor[:, rank * width:(rank + 1) * width].contiguous()
    if kind == "down":
        width = config.intermediate_size // tp
        return tensor[:, rank * width:(rank + 1) * width].contiguous()
    return tensor                                           # norms: replicated


def model_from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor]):
    """Inverse of `named_weights`: a `cls` (LlamaModel or a subclass) holding `weights`."""
    layers = [LayerWeights(**{f.name: weights.get(f"layers.{i}.{f.name}")
                              for f in dataclasses.fields(LayerWeights)})
              for i in range(config.num_layers)]
    # a pipeline stage lacks the embedding, the final norm or the lm_head (None)
    embed = weights.get("embed")
    return cls(config, embed, layers, weights.get("norm"), weights.get("lm_head", embed))


# ---- the communication around the forward's parts -------------------------------------------

class TensorParallelGroup:
    """What a shard calls to talk to the other ranks (`TensorParallelShard.tp_group`)."""

    def __init__(self, rank: int, size: int, vocab_size: int, group=None):
        # group: the process group of this stage's tp ranks (None = the whole world). A
        # group of one (pipeline parallelism alone) needs no collective at all.
        self.rank, self.size, self.vocab_size, self.group = rank, size, vocab_size, group
        self.vocab_rows = padded_vocab_size(vocab_size, size) // size   # embedding rows per rank
        self.vocab_start = rank * self.vocab_rows

    def embedding(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank fills the rows of ids in its slice, zeros
        elsewhere; the all-reduce leaves every rank with every row."""
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), weight)
        hidden.masked_fill_(outside[:, None], 0)
        return self.all_reduce(hidden)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial outputs of a row-parallel projection (in place)."""
        if self.size > 1:
            dist.all_reduce(partial, group=self.group)
        return partial

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[S, V / tp] vocab slices of every rank -> [S, vocab] (padding cut off)."""
        if self.size == 1:
            return logits[:, :self.vocab_size]
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]


class TensorParallelShard(LlamaModel):
    """One rank's shard: the whole model's forward, with a collective where this rank's
    part of a result meets the other ranks' parts. Set `tp_group` before the first forward."""

    tp_group: TensorParallelGroup
    fold_add_norm = False   # the residual add waits for the all-reduce after o_proj and down

    def embedding(self, input_ids):
        return self.tp_group.embedding(input_ids, self.embed)        # vocab-parallel table

    def attention(self, *args, **kwargs):
        return self.tp_group.all_reduce(super().attention(*args, **kwargs))   # row-parallel o_proj

    def mlp(self, layer, x, backend=None):
        return self.tp_group.all_reduce(super().mlp(layer, x, backend))       # row-parallel down

    def logits(self, last, backend=None):
        return self.tp_group.gather_logits(super().logits(last, backend))     # vocab-parallel lm_head
