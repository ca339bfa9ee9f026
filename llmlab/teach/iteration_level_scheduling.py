"""Notebook 06, iteration-level scheduling: its five-request workload replayed on the simulator
(the engine's Scheduler and BlockManager, no model)."""
from __future__ import annotations

from llmlab.teach import ground_truth
from llmlab.teach.check import choice, integer, integers, right, wrong

# the notebook's workload: (question, max_tokens, arrival step), each a chat turn
WORKLOAD = [("Tell me a joke about cats.", 10, 0), ("What is 7 times 8?", 4, 0),
            ("Write a haiku about the sea.", 8, 2), ("Name a planet.", 3, 5), ("Why is the sky blue?", 6, 6)]
ENGINE = dict(block_size=8, num_gpu_blocks=48, enable_chunked_prefill=False, enable_prefix_caching=False)


def replay(**overrides):
    arrivals = [(ground_truth.chat(text), max_tokens, step) for text, max_tokens, step in WORKLOAD]
    return ground_truth.replay(arrivals, **{**ENGINE, **overrides})


def q1(answer):
    """make_engine(max_num_seqs=2): in which step (from 0) is request 2, the haiku that arrives at step 2,
    first scheduled?"""
    step = integer(answer)
    expected = ground_truth.first_scheduled(replay(max_num_seqs=2), "2")
    if step == expected:
        return right("with two requests running it waits until one of them finishes and frees its place.")
    if step == 2:
        return wrong("that is when it arrives; with max_num_seqs=2, are there two requests running then?")
    return wrong("record the run with make_engine(max_num_seqs=2) and find request 2's first orange bar in "
                 "the timeline.")


def q2(answer):
    """make_engine(enable_chunked_prefill=True, max_num_batched_tokens=8): how many steps does the whole
    workload take?"""
    steps = integer(answer)
    expected = len(replay(enable_chunked_prefill=True, max_num_batched_tokens=8).steps)
    if steps == expected:
        return right("each prompt (over 30 tokens with its chat template) now takes several steps of at "
                     "most 8 tokens, decodes included.")
    if steps == len(replay().steps):
        return wrong("that is without chunking; record the run with the new engine.")
    return wrong("record it: len(viz.record(make_engine(enable_chunked_prefill=True, max_num_batched_tokens=8), "
                 "workload).steps).")


PARTS = {"a": "the matrix multiplications", "b": "attention", "c": "the norms", "d": "sampling"}


def q3(answer):
    """Selective batching: which part of a step runs per sequence rather than on the one flat batch?
    (a) the matrix multiplications (b) attention (c) the norms (d) sampling"""
    part = choice(answer, "abcd")
    if part == "b":
        return right("each token attends to its own sequence's keys and values, so attention needs the "
                     "sequence boundaries (prefill_attention for prompts, decode_attention for the rest); "
                     "everything else treats the step as one [tokens, hidden] matrix.")
    if part == "d":
        return wrong("the sampler takes one logits row per request, but all rows in one call on one batch.")
    return wrong(f"{PARTS[part]} treat every token alike, whatever sequence it belongs to: one matrix for the "
                 f"whole step.")


def q4(answer):
    """make_engine(enable_prefix_caching=True), the engine's default: request 1 arrives at step 0 with
    request 0, and both prompts begin with the chat template's system prompt. In which step (from 0) is
    request 1 first scheduled, and how many prompt tokens does it compute itself? Answer (step, tokens)."""
    step_tokens = integers(answer, "a tuple (step, tokens), e.g. (3, 20)")
    if len(step_tokens) != 2:
        return wrong("answer two numbers: the step request 1 is first scheduled in, and the prompt tokens it "
                     "computes.")
    trace = replay(enable_prefix_caching=True)
    expected = (ground_truth.first_scheduled(trace, "1"), ground_truth.prefill_tokens(trace, "1"))
    prompt_tokens = len(ground_truth.chat(WORKLOAD[1][0]))
    step, tokens = step_tokens
    if step_tokens == expected:
        return right("request 0 computes the system prompt's blocks in step 0, so the scheduler holds request 1 "
                     "back (admitted then, it would compute the same blocks a second time); a step later it "
                     "finds those full blocks in the cache and computes only the rest of its prompt.")
    if step == 0:
        return wrong("it arrives in step 0, but in that very step request 0 is computing the blocks both prompts "
                     "begin with: does the scheduler admit a request whose prefix is being computed?")
    if step != expected[0]:
        return wrong("record the run with make_engine(enable_prefix_caching=True) and find request 1's first "
                     "prefill item in trace.steps.")
    if tokens == prompt_tokens:
        return wrong("its first blocks hold the same tokens as request 0's, and request 0 has computed them by "
                     "then: prefix caching shares them; how many tokens are left to compute?")
    if tokens == prompt_tokens - expected[1]:
        return wrong("that is what it found in the cache (its prefill starts at that position); how many did it "
                     "compute?")
    return wrong("request 1's prefill item in the recorded trace says it: its num_tokens.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3, "q4": q4}
