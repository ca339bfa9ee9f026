"""Who is who among the ranks, and which weights each one holds.

With tensor_parallel_size = tp and pipeline_parallel_size = pp there are tp x pp ranks.
Rank r is tensor-parallel rank r % tp of pipeline stage r // tp: the tp ranks of a stage
share its layers Megatron-style (model/tensor_parallel.py), and stage s holds a contiguous
range of layers (engine/parallel/pipeline.py passes the activations from stage to stage):

    pp=2, tp=2, 30 layers     rank 0   rank 1   |  rank 2   rank 3
                              stage 0: embedding,  |  stage 1: layers 15-29,
                              layers 0-14          |  final norm, lm_head
                              (heads 0..H/2, H/2..H on each pair of ranks)

Rank 0 runs the engine and is always stage 0. A stage gets ceil(L / pp) or floor(L / pp)
layers, the first stages the extra ones: rank 0 sizes the one KV cache every stage mirrors
from its own memory, so no stage holds more layers than it does.

Process groups: the world (NCCL on GPUs, gloo on CPUs) carries the step's tensors, the
pipeline's send/recv and the weights; each stage's tp ranks all-reduce in a group of their
own; and a gloo group with no practical timeout carries the small per-step header (wire.py),
so that workers idle in it on the CPU for as long as rank 0 has nothing to run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from llmlab.config import ModelConfig
from llmlab.model.llama import LlamaModel
from llmlab.model.tensor_parallel import named_weights, shard_config, shard_weight

# workers wait for rank 0's next step in the control group: an idle server must not time
# them out (a wait there costs nothing: a blocked socket read)
IDLE_TIMEOUT = timedelta(days=3650)


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges, one per stage; the first stages get the extra layers."""
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} is more than the model's {num_layers} layers "
                         "(every stage needs at least one)")
    sizes = [num_layers // pp + (s < num_layers % pp) for s in range(pp)]
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


@dataclass(frozen=True)
class RankLayout:
    """One rank's place: its stage, its tensor-parallel rank, its layers, its neighbours."""
    rank: int
    tp: int
    pp: int
    num_layers: int          # of the whole model

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def layers(self) -> range:
        return stage_layers(self.num_layers, self.pp)[self.stage]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    # activations go from a stage's tp rank t to the next stage's tp rank t
    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp

    @property
    def logits_rank(self) -> int:
        """The rank that sends rank 0 the logits: the last stage's tp rank 0."""
        return (self.pp - 1) * self.tp

    def stage_ranks(self, stage: int) -> list[int]:
        return [stage * self.tp + t for t in range(self.tp)]


def local_config(config: ModelConfig, layout: RankLayout) -> ModelConfig:
    """The architecture one rank runs: its share of the heads and MLP, its layers."""
    return dataclasses.replace(shard_config(config, layout.tp), num_layers=len(layout.layers))


def weights_of_stage(model: LlamaModel, layout: RankLayout, stage: int) -> dict[str, torch.Tensor]:
    """The full-model weights stage `stage` holds, under the names its own (smaller) model
    gives them: its layers renumbered from 0, the embedding on the first stage, the final
    norm and lm_head on the last (a tied lm_head is the embedding, sent there too)."""
    layers = stage_layers(model.config.num_layers, layout.pp)[stage]
    weights = {}
    for name, tensor in named_weights(model).items():
        if name.startswith("layers."):
            _, index, field = name.split(".")
            if int(index) in layers:
                weights[f"layers.{int(index) - layers.start}.{field}"] = tensor
        elif name == "embed" and stage == 0:
            weights[name] = tensor
        elif name in ("norm", "lm_head") and stage == layout.pp - 1:
            weights[name] = tensor
    if stage == layout.pp - 1 and stage > 0 and "lm_head" not in weights:
        weights["lm_head"] = model.lm_head       # tied: the embedding table, on the other end
    return weights


def distribute_weights(model: LlamaModel | None, layout: RankLayout, device) -> dict[str, torch.Tensor]:
    """Collective: rank 0, the only rank holding the full `model`, sends every rank its
    weights, its stage's and its tensor-parallel shard of each, one weight at a time (so
    rank 0's device never holds more than one full weight beyond its own). Returns this
    rank's weights by their local names, on `device`."""
    items = iter([(stage, name, tensor) for stage in range(layout.pp)
                  for name, tensor in weights_of_stage(model, layout, stage).items()]) if layout.rank == 0 else None
    mine = {}
    while True:
        header, parts = [None, None, None, None], None
        if layout.rank == 0:
            stage, name, full = next(items, (None, None, None))
            if name is not None:
                parts = [shard_weight(name, full, model.config, t, layout.tp).to(device) for t in range(layout.tp)]
                header = [stage, name, tuple(parts[0].shape), str(parts[0].dtype).removeprefix("torch.")]
        dist.broadcast_object_list(header, src=0, device=device)   # every shard has one shape
        stage, name, shape, dtype = header
        if name is None:
            return mine
        if layout.rank == 0:
            for t, part in enumerate(parts):
                if stage * layout.tp + t == 0:
                    mine[name] = part
                else:
                    dist.send(part, dst=stage * layout.tp + t)
        elif stage == layout.stage:
            mine[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.recv(mine[name], src=0)


@dataclass
class Groups:
    control: dist.ProcessGroup                  # gloo, no timeout: the per-step header
    tensor_parallel: dist.ProcessGroup | None   # this stage's tp ranks; None = the world (pp = 1)


def join_groups(layout: RankLayout) -> Groups:
    """Collective, after init_process_group: every rank creates every group, in one order
    (torch.distributed's rule), and keeps those it is in."""
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    tensor_parallel = None
    if layout.pp > 1 and layout.tp > 1:
        for stage in range(layout.pp):
            group = dist.new_group(layout.stage_ranks(stage))
            if stage == layout.stage:
                tensor_parallel = group
    return Groups(control, tensor_parallel)
