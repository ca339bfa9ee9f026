"""From a scheduler Plan to model inputs: the flat batch, and throwaway plans for start-up.

The flat batch is every prefill chunk's tokens, then one token per decode. For each token
`prepare` computes its position and the cache slot its K/V goes to
(slot = block_table[position // block_size] * block_size + position % block_size).
The ModelRunner (model_runner.py) calls it every step; it is a plain function, so a
notebook or a benchmark can build the inputs of any plan by hand.
"""
from __future__ import annotations

import torch

from llmlab.model.llama import ForwardBatch
from llmlab.request import Request
from llmlab.sampling import SamplingParams, prompt_logprob_positions
from llmlab.plan import Plan, ScheduledItem

def prepare(plan: Plan, block_size: int, device: torch.device, num_splits: int = 1,
            backend: str | None = None, buffers=None, previous=None):
    """Returns input_ids [T], positions [T] and the ForwardBatch for the plan. Logits are
    asked for the last token of each item that samples (plan.sampling_items), in order, then
    for the prompt positions `prompt_logprob_positions` lists.
    `buffers`: an InputBuffers (input_buffers.py) to stage the inputs in (the engine's
    steps), else fresh tensors. `previous`: (rows, tokens) of the step still in flight
    (async scheduling): a request whose newest token is pending takes it as its input from
    tokens[rows[request]], on the device."""
    bs = block_size
    input_ids, positions, slots = [], [], []
    cu_seqlens_q, prefill_lens = [0], []
    for item in plan.prefills:
        request, start, end = item.request, item.start_position, item.start_position + item.num_tokens
        input_ids += request.token_ids_between(start, end)
        positions += range(start, end)
        table = request.block_table
        slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        cu_seqlens_q.append(cu_seqlens_q[-1] + item.num_tokens)
        prefill_lens.append(end)
    decode_lens = []
    for item in plan.decodes:
        request, p = item.request, item.start_position
        input_ids += request.token_ids_between(p, p + 1)
        positions.append(p)
        slots.append(request.block_table[p // bs] * bs + p % bs)
        decode_lens.append(p + 1)
    num_prefill_tokens = cu_seqlens_q[-1]
    last_rows = [end - 1 for end in cu_seqlens_q[1:]] + list(range(num_prefill_tokens, len(input_ids)))
    logits_indices = [row for row, item in zip(last_rows, plan.items) if item.completes_prompt]
    # then the rows that score prompt tokens, for requests that asked for prompt logprobs
    for j, request, first, end in prompt_logprob_positions(plan):
        logits_indices += range(cu_seqlens_q[j] + first - plan.prefills[j].start_position,
                                cu_seqlens_q[j] + end - plan.prefills[j].start_position)
    # a pending token is always its request's last, so only an item that completes a prompt holds one
    pending = [(row, item.request) for row, item in zip(last_rows, plan.items)
               if item.completes_prompt and item.request.token_pending]
    if pending and previous is None:
        raise RuntimeError("a request's newest token is still on the device: pass the step in flight as `previous`")
    pending_rows = [row for row, _ in pending]
    previous_rows = [previous[0][request] for _, request in pending]
    prefill_requests = [item.request for item in plan.prefills]
    decode_requests = [item.request for item in plan.decodes]

    if buffers is not None:
        (input_ids, positions, slot_mapping, logits_rows, pending_rows, previous_rows, cu_seqlens_q, prefill_lens,
         decode_lens, prefill_tables, decode_tables) = buffers.stage(
            [input_ids, positions, slots, logits_indices, pending_rows, previous_rows],
            [cu_seqlens_q, prefill_lens, decode_lens], [prefill_requests, decode_requests])
    else:
        def ints(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=device)

        input_ids, positions, slot_mapping, logits_rows, pending_rows, previous_rows = (
            ints(v, torch.int64) for v in (input_ids, positions, slots, logits_indices, pending_rows, previous_rows))
        cu_seqlens_q, prefill_lens, decode_lens = ints(cu_seqlens_q), ints(prefill_lens), ints(decode_lens)
        prefill_tables = pad_tables([r.block_table for r in prefill_requests], device)
        decode_tables = pad_tables([r.block_table for r in decode_requests], device)
    if pending:   # the sampler's output of the step in flight, never seen by the host
        input_ids[pending_rows] = previous[1][previous_rows]
    batch = ForwardBatch(
        num_prefill_tokens=num_prefill_tokens,
        slot_mapping=slot_mapping,
        prefill_cu_seqlens_q=cu_seqlens_q,
        prefill_seq_lens=prefill_lens,
        prefill_block_tables=prefill_tables,
        decode_seq_lens=decode_lens,
        decode_block_tables=decode_tables,
        logits_indices=logits_rows,
        num_splits=num_splits,
        backend=backend,
    )
    return input_ids, positions, batch


def pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one int32 [num_seqs, max_blocks] tensor, padded with 0 (kernels
    never read past a sequence's length, so the padding value is never used)."""
    width = max((len(t) for t in tables), default=0)
    rows = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(tables), width)


def dummy_plan(block_size: int, prefills=(), decodes=()) -> Plan:
    """A Plan of throwaway requests, for forwards that only need a batch of some shape (the
    memory profile, the warm-up, `llmlab bench single-forward`). `prefills`: (chunk, context)
    pairs, a prompt chunk of `chunk` tokens ending at position context - 1; `decodes`: the
    context length of each decode (its one new token included). Every item samples. The
    requests' blocks are numbered from 0, one after another, and no BlockManager owns them:
    run such a plan only on a cache that no live request is using."""
    plan, next_block = Plan(), 0

    def request(context: int) -> Request:
        nonlocal next_block
        r = Request("dummy", None, [0] * context, SamplingParams())
        r.block_table = list(range(next_block, next_block + -(-context // block_size)))
        next_block += len(r.block_table)
        return r

    for chunk, context in prefills:
        plan.prefills.append(ScheduledItem(request(context), "prefill", chunk, context - chunk))
    for context in decodes:
        plan.decodes.append(ScheduledItem(request(context), "decode", 1, context - 1))
    return plan


def num_blocks_of(plan: Plan, block_size: int) -> int:
    """Blocks a dummy plan's requests use (they are numbered 0 .. this - 1)."""
    return sum(-(-(item.start_position + item.num_tokens) // block_size) for item in plan.items)
