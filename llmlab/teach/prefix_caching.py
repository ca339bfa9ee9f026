"""Notebook 09, prefix caching: the bakery prompts replayed on the simulator, which hashes and
finds blocks exactly as the engine does (the prompts' real token ids)."""
from __future__ import annotations

from llmlab.teach import ground_truth
from llmlab.teach.check import integer, right, wrong

SYSTEM = ("You are a concise assistant for a bakery. We open at 7am and close at 6pm, every day "
          "except Monday. We sell bread, croissants and cakes. Answer in one short sentence.")
QUESTIONS_ASKED = ["When do you open?", "Do you sell cakes?", "Are you open on Monday?", "What bread do you have?"]


def prompt_ids() -> list[list[int]]:
    return [ground_truth.encode(f"{SYSTEM} Question: {q}") for q in QUESTIONS_ASKED]


def replay(arrival_steps=(0, 2, 2, 2, 30), **overrides):
    ids = prompt_ids()
    prompts = ids + [ids[1]]         # the fifth request asks the second question again
    arrivals = [(p, 8, step) for p, step in zip(prompts, arrival_steps)]
    return ground_truth.replay(arrivals, **{"block_size": 8, "num_gpu_blocks": 64, **overrides})


def hit_tokens(trace, request_id: str, prompt_len: int) -> int:
    """Prompt tokens the request found in the cache: those its prefill did not compute."""
    return prompt_len - ground_truth.prefill_tokens(trace, request_id)


def q1(answer):
    """make_engine(block_size=16): how many prompt tokens does request 1 find in the prefix cache?"""
    n = integer(answer)
    ids = prompt_ids()
    common = next(i for i, (x, y) in enumerate(zip(ids[0], ids[1])) if x != y)
    expected = hit_tokens(replay(block_size=16), "1", len(ids[1]))
    if n == expected:
        return right("only full blocks are hashed and shared: with 16-token blocks the last partial block of "
                     "the common prefix is recomputed, and it is a bigger part of the prefix.")
    if n == hit_tokens(replay(), "1", len(ids[1])):
        return wrong("that is with 8-token blocks; rerun with block_size=16.")
    if n == common:
        return wrong("that is every shared token; the cache holds whole blocks only.")
    return wrong("the shared prefix, cut down to whole 16-token blocks; or read prefix_hits with the new engine.")


def q2(answer):
    """All five requests arrive at step 0: in which step (from 0) is request 1 first scheduled?"""
    step = integer(answer)
    expected = ground_truth.first_scheduled(replay(arrival_steps=(0, 0, 0, 0, 0)), "1")
    if step == expected:
        return right("the scheduler admits request 0 and holds back the others, whose first block it is "
                     "computing, for one step; then they find the system prompt in the cache.")
    if step == 0:
        return wrong("admitted at once, all five would compute the system prompt; does the scheduler let them?")
    return wrong("record the workload with every Arrival at step 0 and find request 1's first step.")


def changed_at(position: int) -> int:
    """Tokens a request finds when its prompt is request 0's with one token changed at `position`."""
    ids = prompt_ids()[0]
    changed = ids[:position] + [ids[position] + 1] + ids[position + 1:]
    trace = ground_truth.replay([(ids, 8, 0), (changed, 8, 20)], block_size=8, num_gpu_blocks=64)
    return hit_tokens(trace, "1", len(changed))


def q3(answer):
    """A request's prompt equals request 0's except for its 20th token (position 19). With 8-token blocks,
    how many of its tokens does it find in the cache?"""
    n = integer(answer)
    if n == changed_at(19):
        return right("blocks 0 and 1 (positions 0-15) hash the same tokens; block 2 holds the changed token, "
                     "and every later block's hash chains through it.")
    if n == 19:
        return wrong("the cache shares whole blocks only.")
    if n > changed_at(19):
        return wrong("a block's hash covers every token up to its end, so the chain breaks at the block that "
                     "holds the changed token, and every block after it differs too.")
    return wrong("which 8-token block holds position 19? The blocks before it are found.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3}
