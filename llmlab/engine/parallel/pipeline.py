"""Pipeline parallelism: the layers cut into stages, one step's batch cut into micro-batches.

Stage s (its ranks: engine/parallel/placement.py) holds a contiguous range of layers and only their
KV cache. A step's flat batch is cut, at sequence boundaries, into micro-batches of about
equal token counts, as GPipe does for training (Huang et al. 2019). Each stage runs them
in order: receive a micro-batch's activations (hidden states and the residual stream)
from the stage before, run its layers, send them on, and take the next. So while stage 1
runs micro-batch 0, stage 0 already runs micro-batch 1: with M micro-batches and P
stages, a step takes M + P - 1 stage-times instead of M x P, and the stages idle for the
P - 1 others (the "bubble", which notebook 14 draws). The first stage embeds the tokens;
the last one applies the final norm and the lm_head.

Sampling stays on rank 0, and the last stage sends it the logits of each micro-batch.
Rank 0 runs the engine: the requests, their sampling parameters, seeds and output
positions live there, and the scheduler needs the tokens there; sending back [S, vocab]
logits (a few MB for a big vocabulary, once per micro-batch) is cheaper than shipping
every request's sampling state to the last stage each step, and keeps one sampler.

The micro-batches of one step still wait for each other: the engine samples a step's
tokens before it schedules the next. Hiding the bubble entirely needs several steps in
flight, each on its own requests (vLLM's virtual engines), so that stage 0 starts the
next step while the last stage finishes this one.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmlab.engine.parallel.placement import RankLayout
from llmlab.model.llama import ForwardBatch, LlamaModel

# micro-batches per step: as many as stages fills the pipeline (every stage busy at once
# in the middle of the step); more would shrink the bubble but run each stage's weights
# over fewer rows at a time
MICRO_BATCHES_PER_STAGE = 1


@dataclass
class MicroBatch:
    input_ids: torch.Tensor      # [T_m]
    positions: torch.Tensor      # [T_m]
    batch: ForwardBatch          # its sequences only; rows re-based to 0
    num_logits: int              # rows of logits it produces


@dataclass
class StageSpan:
    """One micro-batch's time on one rank (perf_counter seconds, comparable across the
    ranks of one machine): from its activations in hand to its output sent on."""
    step: int
    rank: int
    stage: int
    micro_batch: int
    num_tokens: int
    start: float
    end: float


def micro_batch_cuts(cu_seqlens_q: list[int], num_decodes: int, logits_indices: list[int],
                     num_micro_batches: int) -> list[tuple[int, int, int, int]]:
    """Where to cut a flat batch: M + 1 cuts (token row, prefill chunks, decodes, logits rows
    before it), the first (0, 0, 0, 0), the last the whole batch. Cuts fall between
    sequences: each where the tokens left would be shared equally among the micro-batches
    left, as near as the sequences allow; every micro-batch gets at least one sequence (so
    M is at most the number of sequences)."""
    num_prefills, num_prefill_tokens = len(cu_seqlens_q) - 1, cu_seqlens_q[-1]
    seq_ends = cu_seqlens_q[1:] + [num_prefill_tokens + j + 1 for j in range(num_decodes)]
    total, num_seqs = num_prefill_tokens + num_decodes, num_prefills + num_decodes
    m = max(1, min(num_micro_batches, num_seqs))
    cuts, seqs, row = [(0, 0, 0, 0)], 0, 0
    for k in range(1, m):
        target = row + (total - row) / (m - k + 1)
        seqs += 1    # at least one more sequence in micro-batch k - 1 ...
        while seqs < num_seqs - (m - k) and seq_ends[seqs - 1] < target:
            seqs += 1   # ... and leave one for each micro-batch after it
        row = seq_ends[seqs - 1]
        cuts.append((row, min(seqs, num_prefills), max(seqs - num_prefills, 0),
                     bisect.bisect_left(logits_indices, row)))
    cuts.append((total, num_prefills, num_decodes, len(logits_indices)))
    return cuts


def whole_batch_cuts(input_ids, batch: ForwardBatch) -> list[tuple[int, int, int, int]]:
    """One micro-batch, the whole batch (from shapes only: no host sync)."""
    return [(0, 0, 0, 0), (input_ids.shape[0], batch.prefill_seq_lens.shape[0], batch.decode_seq_lens.shape[0],
                           batch.logits_indices.shape[0])]


def cuts_for(input_ids, batch: ForwardBatch, pp: int) -> list[tuple[int, int, int, int]]:
    """Rank 0's cuts of a step: one micro-batch without a pipeline, else micro_batch_cuts
    (which reads cu_seqlens_q and logits_indices on the host: on a GPU a small sync)."""
    if pp == 1:
        return whole_batch_cuts(input_ids, batch)
    return micro_batch_cuts(batch.prefill_cu_seqlens_q.tolist(), batch.decode_seq_lens.shape[0],
                            batch.logits_indices.tolist(), pp * MICRO_BATCHES_PER_STAGE)


def micro_batches(input_ids, positions, batch: ForwardBatch, cuts) -> list[MicroBatch]:
    """The micro-batches between consecutive cuts: views of the batch's tensors."""
    if len(cuts) == 2:
        return [MicroBatch(input_ids, positions, batch, cuts[1][3])]
    out = []
    for (t0, p0, d0, l0), (t1, p1, d1, l1) in zip(cuts, cuts[1:]):
        cu = batch.prefill_cu_seqlens_q
        out.append(MicroBatch(input_ids[t0:t1], positions[t0:t1], ForwardBatch(
            num_prefill_tokens=max(0, min(t1, batch.num_prefill_tokens) - t0),
            slot_mapping=batch.slot_mapping[t0:t1],
            prefill_cu_seqlens_q=cu[p0:p1 + 1] - cu[p0],
            prefill_seq_lens=batch.prefill_seq_lens[p0:p1], prefill_block_tables=batch.prefill_block_tables[p0:p1],
            decode_seq_lens=batch.decode_seq_lens[d0:d1], decode_block_tables=batch.decode_block_tables[d0:d1],
            logits_indices=batch.logits_indices[l0:l1] - t0, num_splits=batch.num_splits, backend=batch.backend),
            l1 - l0))
    return out


@torch.inference_mode()
def run_stage(model: LlamaModel, layout: RankLayout, batches: list[MicroBatch], kv_cache, kv_scales=None,
              spans: list | None = None, step: int = 0) -> torch.Tensor | None:
    """This rank's part of one step: its layers over every micro-batch, in order. Returns
    the logits [S, vocab] on rank 0 (computed here, or received from the last stage), None
    on the other ranks. With `spans`, appends a StageSpan per micro-batch (on a GPU each
    waits for the device: recording a timeline slows the pipeline a little)."""
    config, device = model.config, kv_cache.device
    dtype = model.layers[0].qkv.dtype
    pending, logits = [], []       # pending: (work, tensor), the tensor kept alive until sent
    for m, micro in enumerate(batches):
        num_tokens = micro.input_ids.shape[0]
        if layout.is_first_stage:
            start = _clock(device, spans)
            hidden, residual = model.embedding(micro.input_ids), None
            model._tap("embed", hidden)
        else:
            activations = torch.empty(2, num_tokens, config.hidden_size, dtype=dtype, device=device)
            dist.recv(activations, src=layout.prev_rank)
            start = _clock(device, spans)
            hidden, residual = activations.unbind(0)
        hidden, residual = model.decoder_layers(hidden, residual, micro.positions, micro.batch, kv_cache, kv_scales)
        out = model.final_logits(hidden, residual, micro.batch) if layout.is_last_stage else None
        if spans is not None:      # before the send: the next stage cannot start before this end
            spans.append(StageSpan(step, layout.rank, layout.stage, m, num_tokens, start, _clock(device, spans)))
        if not layout.is_last_stage:
            # a folded step (model.folded_decoder_layers) hands on its residual stream alone
            activations = torch.stack((hidden, torch.zeros_like(hidden) if residual is None else residual))
            pending.append((dist.isend(activations, dst=layout.next_rank), activations))
        elif layout.rank == 0:
            logits.append(out)
        elif layout.tp_rank == 0 and micro.num_logits:   # every tp rank of the stage gathered them
            pending.append((dist.isend(out, dst=0), out))
        if layout.rank == 0 and not layout.is_last_stage:
            # posted now, after this micro-batch's send: on NCCL, rank 0's sends and receives
            # with one peer queue on one stream, in the order the peer serves them
            out = torch.empty(micro.num_logits, config.vocab_size, dtype=torch.float32, device=device)
            if micro.num_logits:   # a micro-batch of mid-prompt chunks samples nothing
                pending.append((dist.irecv(out, src=layout.logits_rank), out))
            logits.append(out)
    for work, _ in pending:
        work.wait()
    if layout.rank != 0:
        return None
    out = logits[0] if len(logits) == 1 else torch.cat(logits)
    if not layout.is_last_stage:
        model._tap("logits", out)
    return out


def _clock(device, spans) -> float:
    if spans is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
