"""Notebook 00, a tour of llmlab: the recorded run of "story" and "robots"."""
from __future__ import annotations

import math

from llmlab.teach import ground_truth
from llmlab.teach.check import choice, integer, right, wrong

STORY, ROBOTS = "Once upon a time", "The three laws of robotics are"   # max_tokens 6 and 4


def q1(answer):
    """In which step of the recorded run (counted from 0) did request robots get its last token?"""
    trace = ground_truth.replay([(ground_truth.encode(STORY), 6, 0), (ground_truth.encode(ROBOTS), 4, 0)],
                                num_gpu_blocks=64)
    last = max(i for i, step in enumerate(trace.steps) if "1" in step.sampled)
    step = integer(answer)
    if step == last:
        return right("robots gets its first token in step 0, with its prompt, then one per step until it has "
                     "all 4 it asked for.")
    if step == last + 1:
        return wrong("that counts steps from 1; the notebook counts from 0 (step 0 is the first step recorded).")
    if step == len(trace.steps) - 1:
        return wrong("that is the run's last step, when story finished; robots asked for fewer tokens.")
    return wrong("read the printout of the stepping cell: a request gets one token per step, its first in the "
                 "step that reads its prompt.")


def q2(answer):
    """With 4-token KV blocks (small_trace, in "Try this"), how many blocks does robots (req 1) hold
    after step 2?"""
    in_cache = len(ground_truth.encode(ROBOTS)) + 2    # its prompt, and the tokens sampled in steps 0 and 1
    blocks = integer(answer)
    if blocks == math.ceil(in_cache / 4):
        return right("the cache holds its prompt and the tokens that steps 1 and 2 fed back in, 4 to a block; "
                     "the token sampled in step 2 is written by the next step.")
    if blocks == math.ceil((in_cache + 1) / 4):
        return wrong("the token sampled in step 2 is not in the cache yet: the step that reads it writes its "
                     "key and value.")
    if blocks == math.ceil(in_cache / 16):
        return wrong("that is with the default 16-token blocks; draw small_trace's block table.")
    if blocks in (in_cache, in_cache + 1):
        return wrong("that counts tokens; a block holds 4 of them.")
    return wrong("draw viz.block_table(small_trace, step=2) and count the cells of the row 'req 1'.")


PHASES = {"a": "schedule", "b": "swap", "c": "prepare", "d": "forward", "e": "sample"}
WHY_NOT = {"schedule": "the scheduler only does bookkeeping on a few requests: a fraction of a millisecond",
           "swap": "it copies blocks to and from host memory, and nothing was swapped here (notebook 08)",
           "prepare": "building the flat batch of a few tokens is a fraction of a millisecond",
           "sample": "picking one token per request is a few milliseconds at most"}


def q3(answer):
    """Which phase takes most of a step's time on a CPU? (a) schedule (b) swap (c) prepare (d) forward (e) sample"""
    named = str(answer).strip().lower()
    phase = named if named in WHY_NOT or named == "forward" else PHASES[choice(answer, "abcde")]
    if phase == "forward":
        return right("the forward pass runs the 135M-parameter model over the batch: hundreds of milliseconds "
                     "on a CPU, next to fractions of a millisecond for the rest.")
    return wrong(f"{phase}: {WHY_NOT[phase]}. Look at the tallest bars of the time-per-phase figure.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3}
