"""Exercise 10 -- the chunked-prefill scheduling policy (SARATHI).
Difficulty: ** (no Triton; Python only)

Read first: notebooks/06_iteration_level_scheduling.ipynb, notebooks/07_chunked_prefill.ipynb
(and llmlab/scheduler.py, which applies this policy together with block allocation and
preemption).

Task
    Every engine step runs one batch of at most token_budget tokens
    (max_num_batched_tokens) from at most max_num_seqs sequences. Write
    `schedule_chunks`, which decides what goes into the batch, as SARATHI (Agrawal et
    al., 2023) and vLLM do:

    1. Decodes first. Every sequence that is generating gets its one token, oldest first,
       while budget and sequence slots last. A decode is never held back for a prompt:
       its user is waiting for the next token (decode-maximal batching).
    2. The rest of the budget goes to prompts, in arrival order (FCFS): each prompt gets
       min(its remaining tokens, budget left) -- a *chunk* of the prompt when the budget
       is short (SARATHI section 4: chunk size = token budget - decodes). A prompt only
       gets tokens when every earlier prompt got all of its remaining tokens, and one
       whose chunk would be empty is not scheduled.
    3. Never more than token_budget tokens, never more than max_num_seqs sequences.

    The grader checks hand-made cases and then drives llmlab's own `Scheduler` step by
    step: your schedule must be the engine's.

Inputs and result
    num_decodes          sequences in the decode phase (one token each), oldest first
    prefill_remaining    prefill_remaining[i] >= 1: prompt tokens request i still has to
                         compute, in arrival order (requests mid-prompt first, then new ones)
    returns (decodes, chunks): how many of the decodes run this step, and
    [(i, num_tokens), ...] for the prompts that get a chunk, in order.

Example
    schedule_chunks(3, [1000, 50], token_budget=512, max_num_seqs=8) == (3, [(0, 509)])

Hints
    - Keep two counters as you go: tokens left in the budget, and sequence slots left.
    - Giving each prompt min(remaining, budget left) makes FCFS automatic: a prompt that
      did not get all it needs has used up the budget.

Grade: `make grade`, or `pytest tests/exercises/test_ex10_chunked_prefill.py --impl=exercises`.
"""
from __future__ import annotations


def schedule_chunks(num_decodes: int, prefill_remaining: list[int], token_budget: int,
                    max_num_seqs: int) -> tuple[int, list[tuple[int, int]]]:
    """One step's batch: (decodes scheduled, [(prefill index, chunk tokens), ...])."""
    raise NotImplementedError("ex10: write schedule_chunks")
