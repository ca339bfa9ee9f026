"""Notebook 12, researching a scheduling policy: a student's policy run on the simulator against
the one asked for, the cache and SARATHI arithmetic, and the notebook's H200-scale experiments
(priorities in a small cache, a sweep of the rate) replayed on the simulator with its cost model."""
from __future__ import annotations

import functools
import warnings

import numpy as np

from llmlab.config import EngineConfig
from llmlab.experiments import CostModel, ExtrapolationWarning, Workload, simulate
from llmlab.hooks import ScheduledRecord
from llmlab.policies import PolicyError
from llmlab.teach.check import AnswerError, choice, integer, number, right, run_student_code, wrong
from llmlab.teach.data import data_file

SHORT = 512    # q1: prompts of at most this many tokens are served first


def short_prompts_first_then_fcfs(request):
    num_tokens = len(request.prompt_token_ids)
    return (0, num_tokens) if num_tokens <= SHORT else (1, request.arrival_time)


def admission_order(policy) -> list[str]:
    """Who is first scheduled when, on a queue that forms: 16 requests arriving in 2 s, one running at a time."""
    workload = Workload.poisson(16, rate=8.0, prompt_len=(32, 2048), output_len=(2, 4), seed=1, vocab_size=1000)
    config = EngineConfig(device="cpu", num_gpu_blocks=1024, max_num_seqs=1, max_num_batched_tokens=4096)
    result = simulate(workload, config, CostModel.constant(1.0), policy=policy)
    return [r.request_id for r in sorted(result.requests, key=lambda r: (r.first_scheduled, r.request_id))]


def q1(answer):
    """Write a policy key function: prompts of at most 512 tokens first, the shortest of them first;
    then the longer prompts, first come first served (a smaller key is served first). Put the function
    itself here."""
    expected = admission_order(short_prompts_first_then_fcfs)
    try:
        got = admission_order(lambda request: run_student_code(answer, request))
    except PolicyError as error:    # the scheduler names the policy; what went wrong is the key's own
        cause = error.__cause__
        if isinstance(cause, AnswerError):     # not a function, ...
            raise cause from None
        if isinstance(cause, TypeError):       # the scheduler sorts by the keys
            raise AnswerError(f"its keys cannot be compared with each other ({cause}); return a number or a "
                              f"tuple") from None
        raise cause from None
    if got == expected:
        return right("on a queue of 16 requests the simulator admitted them in the order asked for. A tuple "
                     "key sorts by its first element, then the second: one key function, two rules.")
    where = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    return wrong(f"on a test queue, admission number {where} went to another request than it should. Short "
                 f"prompts (len(r.prompt_token_ids) <= 512) come first, shortest first; the others after "
                 f"them, the earliest arrival (r.arrival_time) first.")


BYTES_PER_BLOCK = 2 * 32 * 8 * 128 * 16 * 2     # Llama-3-8B, bf16, 16 tokens: the notebook's formula


def q2(answer):
    """How many KV blocks does a 4 GiB cache hold for Llama-3-8B in bfloat16 (the notebook's bytes_per_block)?"""
    n = integer(answer)
    if n == 4 * 2**30 // BYTES_PER_BLOCK:
        return right("2 MiB a block: K and V, 32 layers, 8 kv heads of 128 channels, 16 tokens, 2 bytes each.")
    if n == 4 * 2**30 // (BYTES_PER_BLOCK // 2):
        return wrong("a block holds both K and V.")
    if n == 4 * 10**9 // BYTES_PER_BLOCK:
        return wrong("a GiB is 2**30 bytes.")
    return wrong("4 * 2**30 // bytes_per_block.")


def q3(answer):
    """SARATHI: as the token budget (max_num_batched_tokens) grows, (a) TTFT falls and the inter-token
    latency's tail rises (b) both fall (c) TTFT rises and the tail falls"""
    letter = choice(answer, "abc")
    if letter == "a":
        return right("a big budget finishes a prompt in few steps, but every decode riding in those steps waits "
                     "for the whole chunk.")
    if letter == "b":
        return wrong("a bigger chunk makes the steps it rides in longer: who waits for those steps?")
    return wrong("a bigger budget means fewer steps per prompt: what does that do to the first token?")


# ---- the notebook's H200-scale setup, as its cells build it ------------------------------------
LENGTHS = dict(prompt_len=(32, 2048), output_len=(16, 512), vocab_size=128256)
SLO = {"ttft": 0.5, "tpot": 0.05}          # the bursty comparison's SLO


@functools.cache
def h200() -> CostModel:
    return CostModel.load(data_file("h200_cost_model_llama3_8b.json"))


def h200_config(num_gpu_blocks: int = 60 * 2**30 // BYTES_PER_BLOCK) -> EngineConfig:
    return EngineConfig(max_num_batched_tokens=2048, num_gpu_blocks=num_gpu_blocks, max_num_seqs=256,
                        max_model_len=8192)


def rate() -> float:
    """The notebook's `rate`: half of what 256-token chunks can prefill, in requests/s."""
    chunk_tok_s = 256 / h200().step_time([ScheduledRecord("probe", "prefill", 256, 512)])
    return 0.5 * chunk_tok_s / np.mean(LENGTHS["prompt_len"])


def bursty(multiple: float = 1.0) -> Workload:
    return Workload.gamma(1000, rate=multiple * rate(), cv=5.0, seed=3, **LENGTHS)


def simulated(workload: Workload, config: EngineConfig, policy: str):
    with warnings.catch_warnings():     # the notebook shows the extrapolation warning; the checker need not
        warnings.simplefilter("ignore", ExtrapolationWarning)
        return simulate(workload, config, h200(), policy=policy)


# ---- q4: priorities in a 4 GiB cache ------------------------------------------------------------
@functools.cache
def priority_outcome() -> dict:
    """Preempted requests of each half under policy="priority", and the important half's TTFT p90
    under it and under FCFS, in a 4 GiB cache."""
    work = bursty().with_priorities([i % 2 for i in range(1000)])
    config = h200_config(4 * 2**30 // BYTES_PER_BLOCK)
    out = {}
    for policy in ("fcfs", "priority"):
        requests = simulated(work, config, policy).requests
        out[policy] = {"preempted": [sum(r.num_preemptions > 0 for r in requests if r.priority == p) for p in (0, 1)],
                       "ttft_p90": float(np.percentile([r.ttft for r in requests if r.priority == 0], 90))}
    return out


def priority_letter(outcome: dict) -> str | None:
    """The option the simulation bears out (None: none of them)."""
    zero, one = outcome["priority"]["preempted"]
    who = "1" if one >= 2 * zero else "0" if zero >= 2 * one else "both"
    ratio = outcome["priority"]["ttft_p90"] / outcome["fcfs"]["ttft_p90"]
    ttft = "falls" if ratio < 0.5 else "rises" if ratio > 1.25 else "same"
    return {("1", "falls"): "a", ("both", "same"): "b", ("0", "rises"): "c", ("1", "same"): "d"}.get((who, ttft))


def q4(answer):
    """Give half of `bursty` priority 0 (the important half) and the rest priority 1, and simulate it with
    policy="priority" and with "fcfs" in a 4 GiB KV cache. Who is preempted, and what happens to the
    important half's TTFT p90? (a) mostly the priority-1 half, and the priority-0 half's TTFT p90 falls to a
    fraction of FCFS's (b) both halves about equally, and the priority-0 half's TTFT p90 stays about FCFS's
    (c) mostly the priority-0 half, and its TTFT p90 rises above FCFS's (d) mostly the priority-1 half, but
    the priority-0 half's TTFT p90 stays about FCFS's"""
    letter = choice(answer, "abcd")
    outcome = priority_outcome()
    if letter == priority_letter(outcome):
        return right("when the blocks run out the priority policy preempts the least important running request "
                     "(the largest priority value), a priority-0 newcomer preempts one to start, and the queue is "
                     "admitted most important first: the priority-0 half keeps its blocks and jumps the queue, and "
                     "its TTFT p90 drops from "
                     f"{outcome['fcfs']['ttft_p90']:.2f} s under FCFS to {outcome['priority']['ttft_p90']:.2f} s, "
                     "and the priority-1 half pays for it.")
    if letter == "b":
        return wrong("count each half's preempted requests (r.num_preemptions > 0 and r.priority, in "
                     "result.requests): does the priority policy pick its victims at random?")
    if letter == "c":
        return wrong("the priority policy preempts the least important running request first: which half is "
                     "that, with lower numbers more important (vLLM's convention)?")
    return wrong("the important half is not only spared preemption, it is also admitted first: compare its "
                 "TTFT p90 (np.percentile of r.ttft over its requests, 90) under both policies.")


# ---- q5: goodput from a sweep of the rate ---------------------------------------------------------
MULTIPLES = (0.5, 1, 2, 3)


@functools.cache
def attainment(multiple: float) -> float:
    return simulated(bursty(multiple), h200_config(), "fcfs").summary(slo=SLO)["slo_attainment"]


def q5(answer):
    """Sweep the rate: simulate `bursty` with FCFS under `config` at 0.5, 1, 2 and 3 times `rate` and read
    slo_attainment off each summary (the SLO of the bursty cell: TTFT 0.5 s, TPOT 0.05 s). Which of the four
    multiples is the highest at which at least 90% of requests meet the SLO (FCFS's goodput, as far as this
    sweep can tell)?"""
    multiple = number(answer, "one of the multiples 0.5, 1, 2 or 3")
    if multiple not in MULTIPLES:
        return wrong("answer one of the multiples the sweep ran: 0.5, 1, 2 or 3.")
    higher = [m for m in MULTIPLES if m > multiple]
    if attainment(multiple) >= 0.9 and (not higher or attainment(higher[0]) < 0.9):
        return right(f"{attainment(multiple):.1%} of requests met the SLO there, and fewer than 90% at the next "
                     f"multiple: the goodput lies between the two. max_rate (above, in the notebook) bisects that "
                     f"bracket instead of stepping through a fixed grid.")
    if attainment(multiple) < 0.9:
        return wrong("at that rate fewer than 90% of requests met the SLO: goodput is the highest rate that "
                     "still keeps 90% within it.")
    return wrong("a higher rate of the four still keeps 90% of requests within the SLO: read slo_attainment at "
                 "each.")


# ---- q6: a calibration of this machine ------------------------------------------------------------
def q6(answer):
    """Record your own calibration in a terminal, llmlab bench calibrate --preset cpu --out calib/ (about
    three minutes on a 2-core laptop), load it with CostModel.load("calib/cost_model.json") and put the
    CostModel itself here."""
    if not isinstance(answer, CostModel):
        raise AnswerError(f"expected the CostModel itself (CostModel.load(...)), got {type(answer).__name__}")
    made_with = answer.meta.get("recorded_with", "")
    if "bench calibrate" not in made_with:
        return wrong("this cost model was not made by llmlab bench calibrate (the notebook's own `cost` was "
                     "fitted on two runs of ten requests): run the command, then load the cost_model.json it "
                     "writes.")
    if answer.meta.get("device") != "cpu":
        return wrong("that is a GPU's calibration (notebooks/data holds the H200's): record one on this machine, "
                     "with --preset cpu.")
    if "--preset tiny" in made_with:
        return wrong("--preset tiny times a 2-layer random model, a smoke test of the command; --preset cpu "
                     "times the embedded model this notebook runs.")
    decode = answer.step_time([ScheduledRecord(str(i), "decode", 1, 128) for i in range(8)])
    chunk = answer.step_time([ScheduledRecord("probe", "prefill", 256, 256)])
    return right(f"by its fit, a decode step of 8 sequences takes {decode * 1e3:.0f} ms on this machine and a "
                 f"256-token prompt chunk {chunk * 1e3:.0f} ms. simulate(workload, config, it) now answers what "
                 f"this machine would do with any workload; report.json beside it says how far it predicted a "
                 f"run it was not fitted on (relative_error).")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3, "q4": q4, "q5": q5, "q6": q6}
