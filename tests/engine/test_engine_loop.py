"""The engine loop's rooms: the ModelRunner runs plans (dummy ones too) and returns one
logits row per sampling item; an engine whose scheduler plans nothing says so. (Scheduler.update,
the post-step bookkeeping, is tested without a model in tests/scheduler/test_scheduler.py.)"""
import pytest
import torch

from llmlab import EngineConfig, LLMEngine, SamplingParams
from llmlab.engine import ModelRunner
from llmlab.engine.batch import dummy_plan, num_blocks_of
from llmlab.engine.warm_up import compile_kernels
from llmlab.model.llama import LlamaModel
from llmlab.plan import Plan, ScheduledItem
from llmlab.request import Request

from helpers.engine import TINY, cpu_engine_config, tiny_model, tiny_prompt as prompt

MODEL = tiny_model(seed=5)


def cpu_config(**overrides) -> EngineConfig:
    return cpu_engine_config(**{**dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32), **overrides})


# ---- ModelRunner ---------------------------------------------------------------------------

def test_dummy_plan_lays_out_blocks_one_after_another():
    plan = dummy_plan(4, prefills=[(5, 5), (3, 9)], decodes=[2, 8])
    assert [(i.kind, i.num_tokens, i.start_position) for i in plan.items] == \
        [("prefill", 5, 0), ("prefill", 3, 6), ("decode", 1, 1), ("decode", 1, 7)]
    tables = [i.request.block_table for i in plan.items]
    assert tables == [[0, 1], [2, 3, 4], [5], [6, 7]]
    assert num_blocks_of(plan, 4) == 8
    assert plan.sampling_items == plan.items     # every dummy item samples


def test_runner_returns_one_logits_row_per_sampling_item():
    """A mid-prompt chunk samples nothing; the rows that do sample are the ones a request
    run alone gets."""
    runner = ModelRunner(cpu_config(), model=MODEL)
    assert runner.num_device_blocks == 64 and runner.max_model_len == 256
    long, short = prompt(10, 1), prompt(6, 2)
    alone = {}
    for name, ids in (("long", long), ("short", short)):
        r = Request(name, None, ids, SamplingParams())
        r.block_table = list(range(3))
        alone[name] = runner.execute(Plan(prefills=[ScheduledItem(r, "prefill", len(ids), 0)]))[0]
    # both again, in one batch: the long prompt's first 7 tokens (no sample), the short one whole
    a, b = Request("long", None, long, SamplingParams()), Request("short", None, short, SamplingParams())
    a.block_table, b.block_table = [10, 11, 12], [20, 21]
    plan = Plan(prefills=[ScheduledItem(a, "prefill", 7, 0), ScheduledItem(b, "prefill", 6, 0)])
    assert [i.request for i in plan.sampling_items] == [b]
    logits = runner.execute(plan)
    assert logits.shape == (1, TINY.vocab_size)
    # another batch, another blocking of the matrix products: fp32 rounding only
    torch.testing.assert_close(logits[0], alone["short"], atol=1e-4, rtol=1e-4)
    # the rest of the long prompt beside a decode of the short one: two rows, in batch order
    b.output_token_ids.append(int(logits[0].argmax()))
    plan = Plan(prefills=[ScheduledItem(a, "prefill", 3, 7)], decodes=[ScheduledItem(b, "decode", 1, 6)])
    logits = runner.execute(plan)
    assert logits.shape == (2, TINY.vocab_size)
    torch.testing.assert_close(logits[0], alone["long"], atol=1e-4, rtol=1e-4)


def test_the_runner_leaves_the_given_model_as_it_was():
    """Backend, weights and hook state belong to the caller; the runner only reads them."""
    model = LlamaModel.random(TINY, torch.float32, "cpu", seed=5)
    before = dict(vars(model))
    ModelRunner(cpu_config(backend="reference"), model=model).execute(dummy_plan(4, prefills=[(5, 5)]))
    assert dict(vars(model)) == before


def test_the_decode_graphs_are_built_from_the_class_plugged_in():
    """LLMEngine(config, cuda_graphs=cls), exercise 20's plug-in point: the runner builds its
    decode graphs from that class, with CudaGraphDecoder's constructor arguments (on a CPU the
    warm-up captures nothing, so the test asks for them itself)."""
    built = []

    class Recorded:
        def __init__(self, model, kv_cache, max_num_seqs, max_blocks_per_seq, backend=None):
            built.append((model, kv_cache, max_num_seqs, max_blocks_per_seq, backend))

    runner = LLMEngine(cpu_config(), model=MODEL, cuda_graphs=Recorded).runner
    assert runner.graphs is None
    graphs = runner.make_decode_graphs()
    assert isinstance(graphs, Recorded) and runner.graphs is graphs
    assert built == [(runner.model, runner.kv_cache, runner.config.max_num_seqs, runner.max_blocks_per_seq,
                      runner.backend)]


def test_a_plugged_in_cuda_graphs_is_refused_with_tensor_parallelism():
    """Every tensor-parallel rank captures llmlab's own graphs: refused before any worker starts."""
    with pytest.raises(ValueError, match="a plugged-in cuda_graphs runs on one device"):
        ModelRunner(cpu_config(tensor_parallel_size=2), model=MODEL, cuda_graphs=object)


def test_warm_up_runs_mixed_prefill_and_decode_steps(monkeypatch):
    """A first mixed step once stalled 2 s on Triton compiles: the warm-up must run some,
    on blocks no request owns, and skip shapes the engine cannot hold."""
    runner = ModelRunner(cpu_config(num_gpu_blocks=64, max_model_len=48), model=MODEL)
    shapes = []
    monkeypatch.setattr(runner, "execute", lambda plan: shapes.append(
        (len(plan.prefills), len(plan.decodes), max(i.start_position + i.num_tokens for i in plan.items))))
    compile_kernels(runner)
    assert any(prefills and decodes for prefills, decodes, _ in shapes)
    assert shapes and all(longest <= 48 for *_, longest in shapes)


def test_two_engines_on_one_model_each_run_their_own_backend(monkeypatch):
    from llmlab import LLMEngine, kernels

    model = LlamaModel.random(TINY, torch.float32, "cpu", seed=5)
    engines = {name: LLMEngine(cpu_config(backend=name), model=model) for name in ("torch", "reference")}
    seen = []
    get_kernel = kernels.get_kernel
    monkeypatch.setattr(kernels, "get_kernel", lambda name, backend=None: seen.append(backend) or get_kernel(name, backend))
    for name in ("torch", "reference", "torch"):
        seen.clear()
        engines[name].add_request(prompt(5, 0), SamplingParams(max_tokens=2, temperature=0.5))
        while engines[name].has_unfinished_requests():
            engines[name].step()
        assert seen and set(seen) == {name}


def test_a_chat_template_error_is_a_value_error():
    from jinja2 import TemplateError

    from llmlab import LLMEngine

    class StrictTemplate:   # stands in for a tokenizer whose template only allows some roles
        eos_token_id = None

        def apply_chat_template(self, messages):
            raise TemplateError("roles must alternate")

    engine = LLMEngine(cpu_config(), model=MODEL, tokenizer=StrictTemplate())
    with pytest.raises(ValueError, match="chat template: roles must alternate"):
        engine.add_request([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# ---- a scheduler that plans nothing -----------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_scheduler_that_plans_nothing_is_an_error_not_a_hang(async_scheduling):
    """Requests are waiting, nothing is in flight and the plan is empty: no later step can do
    anything else, so instead of spinning the engine says so (the server fails those requests
    and keeps serving; LLM.generate raises). Once the scheduler plans again, the engine runs."""
    from llmlab import LLMEngine

    engine = LLMEngine(cpu_config(async_scheduling=async_scheduling), model=MODEL)
    engine.add_request(prompt(6, 1), SamplingParams(max_tokens=3, ignore_eos=True))
    real = engine.scheduler.schedule
    engine.scheduler.schedule = Plan
    assert engine.step() == []                       # one empty step may be a pause
    with pytest.raises(RuntimeError, match="1 waiting, 0 running, 0 swapped"):
        engine.step()
    engine.scheduler.schedule = real
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 3
    assert engine.kv_stats()["free_device_blocks"] == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_a_cuda_device_on_a_machine_without_one_is_a_clear_error(device):
    """An EngineConfig only describes an engine (the simulator describes GPUs on a laptop), so
    it takes device="cuda" anywhere; building the engine is what needs the device."""
    from llmlab import LLMEngine

    assert EngineConfig(device=device).resolved_async_scheduling() is True
    with pytest.raises(ValueError, match=f"device={device!r}.*no CUDA"):
        LLMEngine(EngineConfig(device=device, dtype="float32", num_gpu_blocks=8), model=MODEL)
