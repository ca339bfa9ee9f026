"""Exercise 10, the chunked-prefill policy: hand-made SARATHI cases, properties on random
inputs, and step by step against llmlab's own Scheduler."""
import random

import pytest

from llmlab.cache.block_manager import BlockManager
from llmlab import LLMEngine, Recorder
from llmlab.config import EngineConfig
from llmlab.request import Request, RequestStatus
from llmlab.sampling import SamplingParams
from llmlab.scheduler import Scheduler

EXERCISE = "ex10_chunked_prefill"


@pytest.mark.parametrize("num_decodes,prefill_remaining,token_budget,max_num_seqs,expected", [
    pytest.param(3, [1000, 50], 512, 8, (3, [(0, 509)]), id="chunk-is-budget-minus-decodes"),   # SARATHI
    pytest.param(2, [100, 300, 50], 256, 8, (2, [(0, 100), (1, 154)]), id="short-prompt-fits-next-chunked"),
    pytest.param(1, [511, 5], 512, 8, (1, [(0, 511)]), id="exactly-full-nothing-for-the-next"),
    pytest.param(0, [7, 7, 7], 10, 8, (0, [(0, 7), (1, 3)]), id="no-decodes-prompts-take-the-budget"),
    pytest.param(10, [5], 8, 64, (8, []), id="more-decodes-than-budget"),
    pytest.param(5, [3], 100, 3, (3, []), id="more-decodes-than-max-num-seqs"),
    pytest.param(3, [10, 10, 10], 1000, 4, (3, [(0, 10)]), id="max-num-seqs-caps-prompts-too"),
    pytest.param(0, [], 512, 8, (0, []), id="nothing-to-do"),
    pytest.param(4, [], 512, 8, (4, []), id="decodes-only"),
])
def test_sarathi_cases(ex, num_decodes, prefill_remaining, token_budget, max_num_seqs, expected):
    decodes, chunks = ex.schedule_chunks(num_decodes, list(prefill_remaining), token_budget, max_num_seqs)
    got = (decodes, [tuple(chunk) for chunk in chunks])
    assert got == expected, (f"schedule_chunks({num_decodes}, {prefill_remaining}, token_budget={token_budget}, "
                             f"max_num_seqs={max_num_seqs}) returned {got}, expected {expected}")


def test_properties_on_random_inputs(ex):
    rng = random.Random(0)
    for _ in range(300):
        num_decodes = rng.randint(0, 20)
        remaining = [rng.randint(1, 300) for _ in range(rng.randint(0, 6))]
        budget, max_num_seqs = rng.randint(1, 512), rng.randint(1, 16)
        decodes, chunks = ex.schedule_chunks(num_decodes, list(remaining), budget, max_num_seqs)
        tokens = decodes + sum(n for _, n in chunks)
        assert tokens <= budget, "never more than the token budget"
        assert decodes + len(chunks) <= max_num_seqs, "never more than max_num_seqs sequences"
        assert decodes == min(num_decodes, budget, max_num_seqs), "decodes first, as many as fit"
        assert [i for i, _ in chunks] == list(range(len(chunks))), "prompts in arrival order, none skipped"
        assert all(0 < n <= remaining[i] for i, n in chunks)
        assert all(n == remaining[i] for i, n in chunks[:-1]), "only the last prompt may be cut short"
        if len(chunks) < len(remaining) and decodes + len(chunks) < max_num_seqs:
            assert tokens == budget, "a prompt waits only when the budget is used up"


def test_long_prompt_never_stalls_decodes(ex):
    """SARATHI's point: a 1000-token prompt goes through in chunks while 4 requests keep
    decoding every step (without chunking they would wait for the whole prompt)."""
    remaining, steps = 1000, 0
    while remaining:
        decodes, chunks = ex.schedule_chunks(4, [remaining], 256, 8)
        assert decodes == 4 and len(chunks) == 1
        remaining -= chunks[0][1]
        steps += 1
    assert steps == 4  # ceil(1000 / (256 - 4))


@pytest.mark.parametrize("token_budget,max_num_seqs", [(64, 4), (256, 8), (40, 64)],
                         ids=["budget-64-seqs-4", "budget-256-seqs-8", "budget-40-seqs-64"])
def test_same_schedule_as_llmlab(ex, token_budget, max_num_seqs):
    """Drive llmlab's Scheduler (with blocks to spare, so that only the policy decides) and
    ask your function the same question before every step."""
    # no prefix caching (on by default): these prompts of 1s all start alike, and a cache hit
    # or a request held back for one is a question for notebook 09, not for the chunking policy
    config = EngineConfig(max_num_batched_tokens=token_budget, max_num_seqs=max_num_seqs,
                          enable_chunked_prefill=True, enable_prefix_caching=False)
    scheduler = Scheduler(config, BlockManager(10_000, 0, 16, config.enable_prefix_caching), max_model_len=100_000)
    rng = random.Random(token_budget)
    arrivals = sorted(rng.randint(0, 30) for _ in range(12))
    for step in range(200):
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            params = SamplingParams(max_tokens=rng.randint(1, 8))
            request = Request(f"r{step}-{len(scheduler.waiting)}", None, [1] * rng.randint(1, 150), params,
                              arrival_time=step + len(scheduler.waiting) / 100)
            scheduler.add(request)
        if not scheduler.has_unfinished() and not arrivals:
            return
        by_arrival = sorted(scheduler.running, key=lambda r: r.arrival_time)
        decoding = [r for r in by_arrival if not r.is_prefilling]
        prefilling = [r for r in by_arrival if r.is_prefilling] + sorted(scheduler.waiting, key=lambda r: r.arrival_time)
        decodes, chunks = ex.schedule_chunks(len(decoding), [r.num_uncomputed_tokens for r in prefilling],
                                             token_budget, max_num_seqs)

        plan = scheduler.schedule()
        assert [item.request for item in plan.decodes] == decoding[:decodes], f"step {step}: decodes"
        assert [(item.request, item.num_tokens) for item in plan.prefills] == \
            [(prefilling[i], n) for i, n in chunks], f"step {step}: prompt chunks"

        for item in plan.items:  # what the engine does after the forward pass
            completes = item.completes_prompt
            item.request.num_computed_tokens += item.num_tokens
            if completes:
                item.request.output_token_ids.append(1)
                if len(item.request.output_token_ids) == item.request.params.max_tokens:
                    scheduler.remove(item.request)
                    item.request.status = RequestStatus.FINISHED
    pytest.fail("the workload did not finish in 200 steps")


# Six short prompts at once and few sequence slots: the prompts compete for slots, not for
# tokens, so a policy that forgets max_num_seqs for prompts schedules too many. The second
# case also cuts prompts into chunks.
@pytest.mark.parametrize("token_budget,max_num_seqs", [(512, 2), (12, 3)],
                         ids=["max-num-seqs-binds", "both-bind"])
@pytest.mark.slow
def test_same_schedule_as_the_engine(ex, engine_llm, token_budget, max_num_seqs):
    """The real engine with the embedded model: before every step, your function gets the
    state the trace shows, and must choose what the engine ran."""
    config = EngineConfig(device=str(engine_llm.engine.device), dtype="float32", backend="torch",
                          num_gpu_blocks=64, max_num_seqs=max_num_seqs, max_num_batched_tokens=token_budget,
                          enable_chunked_prefill=True)
    engine = LLMEngine(config, model=engine_llm.engine.model, tokenizer=engine_llm.tokenizer)
    prompts = ["Hi", "The capital of France is", "One, two, three,", "Red, green and",
               "Once upon a time there was", "Water boils at"]
    recorder = Recorder()
    engine.hooks.attach(recorder)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=2 + i % 3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    trace = recorder.trace
    order = [a.request_id for a in trace.added]                      # arrival order
    prompt_len = {a.request_id: a.num_prompt_tokens for a in trace.added}
    computed = dict.fromkeys(order, 0)
    running, finished = [], set()
    assert any(len(s.scheduled) == max_num_seqs and s.waiting for s in trace.steps), \
        "this workload should fill every sequence slot while prompts wait"
    for record in trace.steps:
        active = [r for r in order if r not in finished]
        decoding = [r for r in active if r in running and computed[r] >= prompt_len[r]]
        prefilling = [r for r in active if r in running and computed[r] < prompt_len[r]] + \
                     [r for r in active if r not in running]
        remaining = [prompt_len[r] - computed[r] for r in prefilling]
        decodes, chunks = ex.schedule_chunks(len(decoding), list(remaining), token_budget, max_num_seqs)
        engine_decodes = [i.request_id for i in record.scheduled if i.kind == "decode"]
        engine_chunks = [(prefilling.index(i.request_id), i.num_tokens) for i in record.scheduled
                         if i.kind == "prefill"]
        question = (f"step {record.step}: schedule_chunks({len(decoding)}, {remaining}, token_budget={token_budget}, "
                    f"max_num_seqs={max_num_seqs})")
        hint = ""
        if decodes + len(chunks) > max_num_seqs:
            hint = " -- that is more sequences than max_num_seqs: every prompt chunk takes a sequence slot too"
        assert (decodes, [tuple(c) for c in chunks]) == (len(engine_decodes), engine_chunks), \
            f"{question} returned {(decodes, chunks)}; the engine ran {(len(engine_decodes), engine_chunks)}{hint}"
        for item in record.scheduled:
            computed[item.request_id] = item.start_position + item.num_tokens
            if item.request_id not in running:
                running.append(item.request_id)
        finished |= set(record.finished)
        running = [r for r in running if r not in finished]
