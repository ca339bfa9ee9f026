"""One SchedulingPolicy, written outside the package, runs unchanged in each place a policy
runs: `experiments.run()` on the CPU engine (the embedded model), `experiments.simulate()`,
and `llmlab serve --policy path/to/file.py:Name` (through the official openai client); its
decisions show in what each records. And `now` is one clock: what a policy sees in run()
and in simulate() agrees with the workload's arrival times."""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmlab import EngineConfig, LLMEngine
from llmlab.experiments import CostModel, Workload, run, simulate
from llmlab.experiments.workload import WorkloadRequest
from llmlab.policies import SchedulingPolicy

pytestmark = pytest.mark.slow     # real servers or engines under a workload: left out by make test-fast


# ---- the example (ARCHITECTURE.md, "Scheduling"): a per-step prefill budget and deferred admissions ----
class Paced(SchedulingPolicy):
    """At most `chunk` prompt tokens a step beside the decodes (SARATHI-Serve: a smaller chunk
    keeps the time between tokens steady), and a prompt longer than `long` tokens waits up to
    `hold` seconds after its arrival while the short ones go first."""

    def __init__(self, chunk=64, long=256, hold=2.0):
        self.chunk, self.long, self.hold = chunk, long, hold

    def prefill_budget(self, num_decode_tokens, token_budget, now):
        return min(self.chunk, token_budget - num_decode_tokens)

    def admit(self, request, now):
        return len(request.prompt_token_ids) <= self.long or now - request.arrival_time >= self.hold


class EveryHook(Paced):
    """Paced, with every other decision overridden too, and each call written down: in
    `self.log`, and in the JSON-lines file $LLMLAB_POLICY_LOG when it is set (a server runs
    its policy in another process). Newest first; a long prompt (> 16 tokens) waits while
    anything runs; 8 prompt tokens a step; the victim is the request with the least work
    done (the cheapest to recompute); a newcomer preempts whoever it outranks."""

    def __init__(self):
        super().__init__(chunk=8, long=16, hold=60.0)
        self.log, self.path = [], os.environ.get("LLMLAB_POLICY_LOG")

    def note(self, method, now, **detail):
        self.log.append({"method": method, "now": now, **detail})
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(self.log[-1]) + "\n")

    def key(self, request, now):
        self.note("key", now, request=request.request_id)
        return -request.arrival_time

    def admit(self, request, now):
        answer = super().admit(request, now)
        self.note("admit", now, request=request.request_id, answer=answer)
        return answer

    def prefill_budget(self, num_decode_tokens, token_budget, now):
        budget = super().prefill_budget(num_decode_tokens, token_budget, now)
        self.note("prefill_budget", now, budget=budget)
        return budget

    def preempt_victim(self, running, now):
        victim = min(reversed(running), key=lambda r: r.num_computed_tokens)
        self.note("preempt_victim", now, victim=victim.request_id)
        return victim

    def preempts_on_arrival(self, request, now):
        self.note("preempts_on_arrival", now, request=request.request_id)
        return True

    def on_step(self, outcome, now):
        self.note("on_step", now, advanced=[r.request_id for r in outcome.advanced])


EVERY_METHOD = {"key", "admit", "prefill_budget", "preempt_victim", "preempts_on_arrival", "on_step"}


def steps_of(log: list[dict]) -> list[list[dict]]:
    """The log cut into steps: each ends with the on_step call that saw its outcome."""
    steps, current = [], []
    for entry in log:
        current.append(entry)
        if entry["method"] == "on_step":
            steps.append(current)
            current = []
    return steps


def assert_decisions_show(log: list[dict], result) -> None:
    """What the policy answered is what the trace shows, step by step."""
    steps = steps_of(log)
    assert len(steps) == len(result.trace.steps) == len(result.steps)
    for calls, record, stats in zip(steps, result.trace.steps, result.steps):
        scheduled = {item.request_id for item in record.scheduled}
        for call in calls:     # a deferred request is not scheduled in that step: it still waits
            if call["method"] == "admit" and not call["answer"]:
                assert call["request"] not in scheduled and call["request"] in record.waiting
        budgets = [call["budget"] for call in calls if call["method"] == "prefill_budget"]
        assert len(budgets) == 1 and stats.num_prefill_tokens <= budgets[0]
        victims = {call["victim"] for call in calls if call["method"] == "preempt_victim"}
        assert set(record.preempted + record.swapped_out) <= victims
    assert {entry["method"] for entry in log} == EVERY_METHOD


def every_hook_workload(vocab_size: int) -> Workload:
    """Three short requests for two slots (one waits: may it preempt?), two of which cannot
    both finish in 10 blocks of 4 tokens (preemption), and a long prompt that arrives while
    they run (deferred). Few tokens: a CPU shared with other jobs can take a second a step."""
    def prompt(n, offset):
        return [(offset + 7 * i) % vocab_size for i in range(n)]
    return Workload([WorkloadRequest("0", 0.0, prompt(8, 11), 14), WorkloadRequest("1", 0.0, prompt(8, 13), 14),
                     WorkloadRequest("2", 0.0, prompt(6, 19), 4), WorkloadRequest("3", 0.05, prompt(24, 17), 2)])


EVERY_HOOK_CONFIG = dict(block_size=4, num_gpu_blocks=10, max_num_seqs=2, preemption_mode="recompute",
                         enable_prefix_caching=False)


def first_scheduled(result) -> dict[str, float]:
    return {r.request_id: r.first_scheduled for r in result.requests}


def test_a_policy_with_every_hook_runs_in_run_on_the_cpu_engine(llm):
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", backend="torch", **EVERY_HOOK_CONFIG),
                       model=llm.engine.model, tokenizer=llm.tokenizer)
    workload = every_hook_workload(engine.model_config.vocab_size)
    policy = EveryHook()
    result = run(workload, engine, policy=policy)
    assert [r.num_output_tokens for r in result.requests] == [r.output_len for r in workload]
    assert_decisions_show(policy.log, result)
    # the long prompt waited for everything else: deferred admission, later first scheduling
    first = first_scheduled(result)
    assert first["3"] > max(first["0"], first["1"], first["2"])
    # on_step's now is the engine's clock: after the step before was recorded, before its own record
    nows = [entry["now"] for entry in policy.log if entry["method"] == "on_step"]
    ends = [0.0] + [s.time for s in result.steps]
    assert all(before <= now <= end for before, now, end in zip(ends, nows, ends[1:]))
    assert result.meta["policy"] == "EveryHook" and engine.scheduler.policy.name == "fcfs"   # put back


def test_a_policy_with_every_hook_runs_in_simulate():
    config = EngineConfig(device="cpu", **EVERY_HOOK_CONFIG)
    cost = CostModel.constant(0.01, {"max_model_len": 2048})
    policy = EveryHook()
    result = simulate(every_hook_workload(49152), config, cost, policy=policy, record_trace=True)
    assert [r.num_output_tokens for r in result.requests] == [14, 14, 4, 2]
    assert_decisions_show(policy.log, result)
    first = first_scheduled(result)
    assert first["3"] > max(first["0"], first["1"], first["2"])
    assert sum(r.num_preemptions for r in result.requests) > 0
    # on_step's now is the simulated clock: the end of each step
    assert [e["now"] for e in policy.log if e["method"] == "on_step"] == [s.time for s in result.steps]


# ---- the example on its own: its budget and its deferral, against FCFS -------------------------------------
def paced_workload(vocab_size: int) -> Workload:
    def prompt(n, offset):
        return [(offset + 5 * i) % vocab_size for i in range(n)]
    return Workload([WorkloadRequest("0", 0.0, prompt(16, 3), 8), WorkloadRequest("1", 0.01, prompt(100, 5), 2),
                     WorkloadRequest("2", 0.02, prompt(16, 7), 4), WorkloadRequest("3", 0.03, prompt(16, 9), 4)])


def assert_paced(result, chunk: int) -> None:
    assert max(s.num_prefill_tokens for s in result.steps) <= chunk     # the engine's budget is 512
    first = first_scheduled(result)
    assert first["1"] > max(first["2"], first["3"])                       # the long prompt let them go first
    assert sum(1 for s in result.trace.steps for item in s.scheduled if item.request_id == "1"
               and item.kind == "prefill") >= 100 // chunk


def test_the_example_policy_runs_in_run_and_simulate(llm):
    workload = paced_workload(llm.engine.model_config.vocab_size)
    policy = Paced(chunk=32, long=64, hold=60.0)
    assert_paced(run(workload, llm.engine, policy=policy), chunk=32)
    cost = CostModel.constant(0.01, {"num_gpu_blocks": 512, "max_model_len": 2048})
    config = llm.engine.config
    assert_paced(simulate(workload, config, cost, policy=policy, record_trace=True), chunk=32)
    fcfs = first_scheduled(simulate(workload, config, cost, policy="fcfs"))
    assert fcfs["1"] < fcfs["2"]                 # FCFS: the long prompt goes as soon as it arrives
    # with a short hold the long prompt goes once it is `hold` old on the simulated clock, others still running
    held = simulate(workload, config, cost, policy=Paced(chunk=32, long=64, hold=0.05))
    first = first_scheduled(held)
    assert 0.01 + 0.05 <= first["1"] < 0.01 + 0.05 + 0.01 and first["1"] < held.requests[0].finish


def test_bench_simulate_takes_a_policy_by_module_colon_name(tmp_path):
    from llmlab import cli

    CostModel.constant(0.01, {"num_gpu_blocks": 256, "max_model_len": 1024}).save(tmp_path / "cost.json")
    out = tmp_path / "report.json"
    cli.main(["bench", "simulate", "--cost-model", str(tmp_path / "cost.json"), "--num-requests", "20",
              "--prompt-len", "8,300", "--output-len", "2,8", "--policy", f"{__file__}:Paced", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["summary"]["num_finished"] == 20 and report["policy"] == "Paced"


# ---- one clock ---------------------------------------------------------------------------------------------
class ClockWatch(SchedulingPolicy):
    """FCFS, noting for each request its arrival_time and the first `now` it was seen at."""

    def __init__(self):
        self.arrival, self.first_seen = {}, {}

    def key(self, request, now):
        self.arrival[request.request_id] = request.arrival_time
        self.first_seen.setdefault(request.request_id, now)
        return request.arrival_time


def test_now_is_one_clock_in_run_and_simulate(llm):
    workload = Workload.poisson(6, rate=5.0, prompt_len=(4, 16), output_len=(2, 4), seed=1,
                                vocab_size=llm.engine.model_config.vocab_size)
    in_run, in_simulate = ClockWatch(), ClockWatch()
    measured = run(workload, llm.engine, policy=in_run)
    step = 0.02
    simulate(workload, llm.engine.config, CostModel.constant(step, {"num_gpu_blocks": 512}), policy=in_simulate)
    # run() adds a request at its loop's first turn after the arrival: after the step in progress, so
    # its own timing error is a step, plus the loop's overhead (a sleep's overshoot on a busy machine)
    error = max(s.duration for s in measured.steps) + 0.1
    for r in workload:
        rid = r.request_id
        assert r.arrival_time <= in_run.arrival[rid] <= r.arrival_time + error
        assert in_run.arrival[rid] <= in_run.first_seen[rid] <= in_run.arrival[rid] + error
        assert in_simulate.arrival[rid] == pytest.approx(r.arrival_time, abs=1e-9)
        assert r.arrival_time <= in_simulate.first_seen[rid] <= r.arrival_time + step
        assert abs(in_run.first_seen[rid] - in_simulate.first_seen[rid]) <= error + step


# ---- the server ---------------------------------------------------------------------------------------------
@pytest.fixture
def policy_server(tmp_path):
    """`llmlab serve --policy <this file>:EveryHook` in its own process, with the cache and
    slots of the run() test; yields its URL and the policy's log file."""
    from helpers.server import serve_process   # here: the server process loads this file for its policy

    log_path = tmp_path / "policy.jsonl"
    env = {**os.environ, "LLMLAB_API_KEY": "k", "LLMLAB_POLICY_LOG": str(log_path)}
    flags = ["--policy", f"{__file__}:EveryHook", "--device", "cpu", "--dtype", "float32", "--block-size", "4",
             "--num-gpu-blocks", "10", "--max-num-seqs", "2", "--preemption-mode", "recompute",
             "--no-enable-prefix-caching", "--log-level", "warning"]
    with open(tmp_path / "server.log", "w+") as output:
        try:
            with serve_process(flags, output, env) as url:
                yield url, log_path
        finally:
            output.seek(0)
            print(output.read())    # shown when the test fails


def test_a_policy_with_every_hook_is_served_by_module_colon_name(policy_server, tmp_path):
    from openai import OpenAI

    url, log_path = policy_server
    assert f"scheduling policy: EveryHook ({__file__}:EveryHook)" in (tmp_path / "server.log").read_text()
    client = OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    workload = every_hook_workload(49152)    # SmolLM2's vocabulary: token ids go as they are

    def complete(request):
        time.sleep(request.arrival_time)
        return client.completions.create(model=model, prompt=request.prompt_token_ids, max_tokens=request.output_len,
                                         temperature=0.0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(len(workload)) as pool:
        completions = list(pool.map(complete, workload.requests))
    assert [c.usage.completion_tokens for c in completions] == [r.output_len for r in workload]
    log = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert {entry["method"] for entry in log} == EVERY_METHOD      # every decision was the policy's
    deferred = {e["request"] for e in log if e["method"] == "admit" and not e["answer"]}
    assert len(deferred) == 1                                      # the long prompt, while others ran
    budgets = [e["budget"] for e in log if e["method"] == "prefill_budget"]
    assert budgets and max(budgets) <= 8
    nows = [e["now"] for e in log if e["method"] == "on_step"]
    assert nows == sorted(nows) and nows[0] >= 0      # the engine's clock, from when it was built


def test_llm_takes_a_policy(llm):
    """LLM(policy=...): the same policy object the engine plans with (no detour through
    LLM.from_engine(LLMEngine(config, policy=...)))."""
    import llmlab

    class LongestPromptFirst(SchedulingPolicy):
        def key(self, request, now):
            return -len(request.prompt_token_ids)

    policy = LongestPromptFirst()
    mine = llmlab.LLM(policy=policy, device="cpu", dtype="float32", backend="torch")
    assert mine.engine.scheduler.policy is policy
    params = llmlab.SamplingParams(max_tokens=4, temperature=0)
    assert [o.text for o in mine.generate(["Hi", "Tell me a story"], params)] == \
        [o.text for o in llm.generate(["Hi", "Tell me a story"], params)]
    with pytest.raises(ValueError, match="LLM takes policy="):
        llmlab.LLM(device="cpu", polcy=policy)
