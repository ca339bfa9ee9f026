"""Notebook 12, researching a scheduling policy: a student's policy run on the simulator against
the one asked for, and the cache and SARATHI arithmetic."""
from __future__ import annotations

from llmlab.config import EngineConfig
from llmlab.experiments import CostModel, Workload, simulate
from llmlab.teach.check import AnswerError, choice, integer, right, run_student_code, wrong

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
    except TypeError as error:      # the scheduler sorts by the keys
        raise AnswerError(f"its keys cannot be compared with each other ({error}); return a number or a "
                          f"tuple") from None
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


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3}
