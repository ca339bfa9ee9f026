"""Notebook 07, chunked prefill: its workload (three short requests decoding, a long prompt
arriving at step 3) replayed on the simulator, in steps, which no machine changes."""
from __future__ import annotations

from llmlab import viz
from llmlab.teach import ground_truth
from llmlab.teach.check import integer, right, wrong

SHORT_PROMPTS = ("The sky is", "My name is", "Roses are red,")
LONG_ID = "3"


def long_prompt(num_notes: int = 12) -> str:
    return "Summarize these notes. " + " ".join(
        f"Note {i}: the meeting about project {i} moved to room {100 + i}." for i in range(num_notes))


def replay(num_notes: int = 12, **config):
    arrivals = [(ground_truth.encode(p), 14, 0) for p in SHORT_PROMPTS]
    arrivals.append((ground_truth.encode(long_prompt(num_notes)), 4, 3))
    return ground_truth.replay(arrivals, block_size=16, num_gpu_blocks=64, **config)


def ttft_steps(trace) -> int:
    return viz.request_latencies(trace)[LONG_ID]["ttft_steps"]


def q1(answer):
    """A budget of 8 tokens (make_engine(max_num_batched_tokens=8)): after how many steps does the long
    prompt get its first token (ttft_steps, as printed in the notebook)?"""
    steps = integer(answer)
    expected = ttft_steps(replay(max_num_batched_tokens=8))
    num_tokens = len(ground_truth.encode(long_prompt()))
    if steps == expected:
        return right("the three decodes take 3 of the 8 tokens, so each chunk is 5 prompt tokens: twice as "
                     "many steps as with a budget of 16, each half as long.")
    if steps in (-(-num_tokens // 8), -(-num_tokens // 8) + 1):
        return wrong("that fills all 8 tokens with prompt; the decodes ride in every step first "
                     "(SARATHI: chunk = budget - decodes).")
    return wrong("add \"budget 8\": dict(max_num_batched_tokens=8) to the configs and rerun the cells.")


def biggest_decode_step(trace) -> int:
    return max(s.num_prefill_tokens + s.num_decode_tokens for s in trace.steps if s.num_decode_tokens)


def q2(answer):
    """Make the long prompt twice as long (range(24) notes) and turn chunking off: how many tokens are in
    the biggest step a decoding request has to wait for?"""
    tokens = integer(answer)
    expected = biggest_decode_step(replay(24, enable_chunked_prefill=False))
    if tokens == expected:
        return right("the whole prompt plus the three decodes riding along: the longer the prompt, the "
                     "longer every decoder stalls.")
    if tokens == expected - 3:
        return wrong("the three decodes are in that step too.")
    if tokens == biggest_decode_step(replay(12, enable_chunked_prefill=False)):
        return wrong("that is with the original prompt; use range(24).")
    return wrong("rerun the steps cell with the longer prompt and read the 'no chunking' line.")


def q3(answer):
    """Without chunking, which step (from 0) is the stall: the one that reads the long prompt?"""
    step = integer(answer)
    trace = replay(enable_chunked_prefill=False)
    expected = ground_truth.first_scheduled(trace, LONG_ID)
    if step == expected:
        return right("the long request arrives before that step and is prefilled whole in it, and the three "
                     "decoders wait for it: its forward bar is the tall one in viz.phase_timings.")
    if step == expected + 1:
        return wrong("steps count from 0 here.")
    return wrong("viz.phase_timings(traces['no chunking']): the tallest bar (or the batch composition's big "
                 "orange bar).")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3}
