"""Engine invariants on the embedded model: batching does not change outputs, every block
comes back, chunked prefill / preemption / prefix caching leave greedy output unchanged,
and bad input is refused with a clear ValueError."""
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import llmlab

import helpers.engine
from helpers.engine import assert_all_blocks_free, embedded_engine
from llmlab import EngineConfig, LLMEngine, SamplingParams
from llmlab.engine.warm_up import compile_kernels

PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves falling.",
           "1, 2, 3, 4,", "Explain what a hash table is to a ten year old child, step by step."]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_engine(llm, **overrides) -> LLMEngine:
    """A fresh engine sharing the loaded embedded model (loading it again is slow)."""
    return embedded_engine(llm, **overrides)


def run_all(engine, prompts, params=GREEDY, recorder=None):
    return helpers.engine.run_all(engine, prompts, params, recorder)


@pytest.fixture(scope="module")
def reference_tokens(llm):
    """Greedy tokens of each prompt run alone, with generous memory and no chunking."""
    engine = make_engine(llm, num_gpu_blocks=256, enable_chunked_prefill=False)
    return [run_all(engine, [p])[0].token_ids for p in PROMPTS]


def test_batch_equals_each_alone(llm, reference_tokens):
    engine = make_engine(llm, num_gpu_blocks=256)
    outputs = run_all(engine, PROMPTS)
    assert [o.token_ids for o in outputs] == reference_tokens
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in outputs)
    assert_all_blocks_free(engine)


def test_chunked_prefill_mixes_prefill_and_decode(llm, reference_tokens):
    engine = make_engine(llm, num_gpu_blocks=256, max_num_batched_tokens=8)
    recorder = llmlab.Recorder()
    outputs = run_all(engine, PROMPTS, recorder=recorder)
    assert [o.token_ids for o in outputs] == reference_tokens
    steps = recorder.trace.steps
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 8 for s in steps)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), "no mixed step"
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_output(llm, reference_tokens, mode):
    # 6 blocks of 4 tokens hold ~24 tokens: four requests of 20+ tokens must take turns
    engine = make_engine(llm, num_gpu_blocks=12, block_size=4, preemption_mode=mode,
                         swap_space=0.01, max_num_batched_tokens=64)
    recorder = llmlab.Recorder()
    outputs = run_all(engine, PROMPTS, recorder=recorder)
    assert [o.token_ids for o in outputs] == reference_tokens
    kind = "preempted" if mode == "recompute" else "swapped_out"
    assert any(getattr(s, kind) for s in recorder.trace.steps), f"no {mode} preemption happened"
    assert_all_blocks_free(engine)


def test_a_recorder_without_blocks_keeps_what_swaps_copied(llm):
    """Recorder(blocks=False) (bench offline --profile-steps: building block tables costs a
    step milliseconds) records the same schedule with no blocks but the tables of requests
    swapped in or out, as Trace.without_blocks keeps them: cost models count the same swaps."""
    from llmlab.experiments.cost_model import swapped_blocks

    traces = []
    for blocks in (True, False):
        engine = make_engine(llm, num_gpu_blocks=12, block_size=4, preemption_mode="swap", swap_space=0.01,
                             max_num_batched_tokens=64)
        recorder = llmlab.Recorder(blocks=blocks)
        engine.hooks.attach(recorder)
        assert engine.hooks.blocks == blocks
        helpers.engine.run_all(engine, PROMPTS, GREEDY)
        engine.hooks.detach(recorder)
        traces.append(recorder.trace)
    full, light = traces[0].without_blocks(), traces[1]
    assert any(s.swapped_out for s in light.steps) and any(s.swapped_in for s in light.steps)
    assert [s.scheduled for s in light.steps] == [s.scheduled for s in full.steps]
    assert [swapped_blocks(s) for s in light.steps] == [swapped_blocks(s) for s in full.steps]
    assert [(s.block_tables, s.host_block_tables) for s in light.steps] == [
        (s.block_tables, s.host_block_tables) for s in full.steps]
    assert not any(s.allocated_blocks or s.cached_blocks for s in light.steps)
    assert any(s.allocated_blocks for s in traces[0].steps)


def test_prefix_caching_reuses_blocks(llm, reference_tokens):
    engine = make_engine(llm, num_gpu_blocks=256, enable_prefix_caching=True, block_size=4)
    first = run_all(engine, PROMPTS[3:])
    recorder = llmlab.Recorder()
    again = run_all(engine, PROMPTS[3:] + PROMPTS[:1], recorder=recorder)
    assert first[0].token_ids == again[0].token_ids == reference_tokens[3]
    assert again[1].token_ids == reference_tokens[0]
    hits = sum(sum(s.prefix_hit_tokens.values()) for s in recorder.trace.steps)
    assert hits >= 8
    assert_all_blocks_free(engine)   # cached blocks are evictable, so they count as free


def test_abort_frees_everything(llm):
    engine = make_engine(llm, num_gpu_blocks=64, max_num_batched_tokens=4)
    a = engine.add_request(PROMPTS[3], GREEDY)
    b = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()                          # `a` is mid-prefill (4 of its tokens done)
    assert engine.requests[a].is_prefilling
    engine.abort(a)
    while engine.has_unfinished_requests():
        engine.step()
    engine.abort(b)                        # aborting a finished request is a no-op
    assert_all_blocks_free(engine)


def test_stop_string_is_never_shown(llm):
    engine = make_engine(llm, num_gpu_blocks=64)
    full = run_all(engine, ["1, 2, 3, 4,"], SamplingParams(max_tokens=12, temperature=0))[0].text
    assert ", 7" in full
    out = run_all(engine, ["1, 2, 3, 4,"], SamplingParams(max_tokens=12, temperature=0, stop=[", 7"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[:full.index(", 7")]


def test_stop_token_ids_and_max_tokens(llm, reference_tokens):
    engine = make_engine(llm, num_gpu_blocks=64)
    reference = reference_tokens[2]
    stop_at = reference[2]
    out = run_all(engine, PROMPTS[2:3], SamplingParams(max_tokens=12, temperature=0,
                                                       stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[:reference.index(stop_at) + 1]
    out = run_all(engine, PROMPTS[2:3], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    engine = make_engine(llm, num_gpu_blocks=128)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    alone = run_all(engine, [PROMPTS[1]], seeded)[0].token_ids
    others = SamplingParams(max_tokens=10, temperature=0.8)
    batched = run_all(engine, PROMPTS[:3], [others, seeded, others])
    assert batched[1].token_ids == alone
    assert_all_blocks_free(engine)


def test_text_token_ids_and_chat_messages_meet_at_one_tokenization_point(llm):
    """add_request takes a string, token ids or chat messages, all through engine.tokenize:
    a conversation as messages and as its rendered token ids is the same request."""
    engine = make_engine(llm, num_gpu_blocks=64)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = llm.tokenizer.apply_chat_template(messages)
    assert engine.tokenize(messages) == (ids, None)
    assert engine.tokenize(ids) == (ids, None)
    assert engine.tokenize("Hello there") == (llm.tokenizer.encode("Hello there"), "Hello there")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    by_messages, by_ids = run_all(engine, [messages, ids], params)
    assert by_messages.prompt_token_ids == ids and by_messages.token_ids == by_ids.token_ids
    assert [o.token_ids for o in llm.chat(messages, params)] == [by_ids.token_ids]
    no_tokenizer = LLMEngine(EngineConfig(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=8),
                             model=llm.engine.model)
    with pytest.raises(ValueError, match="no tokenizer"):
        no_tokenizer.add_request(messages)
    assert no_tokenizer.tokenize(ids) == (ids, None)


@pytest.mark.parametrize("prompt, params, match", [
    ("", GREEDY, "empty"),
    ([], GREEDY, "empty"),
    ("x " * 200, GREEDY, "max_model_len"),
    (123, GREEDY, "prompt must be"),
    ([{"role": "user", "content": "Hi"}, "Hi"], GREEDY, "prompt must be"),
    ([1, 2, 10**9], GREEDY, "token ids"),
    ("hello", "not params", "SamplingParams"),
])
def test_bad_requests_raise_clear_errors(llm, prompt, params, match):
    engine = make_engine(llm, num_gpu_blocks=64, max_model_len=128)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert_all_blocks_free(engine)
    assert run_all(engine, ["Hi"], SamplingParams(max_tokens=2))[0].finished   # still serving


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 0}, "top_k"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"), ({"stop": 5}, "stop must be a list"),
    ({"ignore_eos": "no"}, "ignore_eos"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_model_path_and_option():
    with pytest.raises(ValueError, match="does not exist"):
        llmlab.LLM("/no/such/model/folder")
    with pytest.raises(ValueError, match="unknown engine option"):
        llmlab.LLM(not_an_option=1)


def test_generate_rolls_back_on_bad_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine prompt", ""])
    assert_all_blocks_free(llm.engine)


@pytest.mark.slow
def test_triton_backend_matches_torch_backend_on_embedded_model(llm):
    """Every kernel through Triton (its interpreter on a CPU) gives the same greedy tokens."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3,"]
    torch_tokens = [o.token_ids for o in run_all(make_engine(llm, num_gpu_blocks=32), prompts, params)]
    triton_engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", backend="triton", num_gpu_blocks=32),
                              model=llm.engine.model, tokenizer=llm.tokenizer)
    assert [o.token_ids for o in run_all(triton_engine, prompts, params)] == torch_tokens


@pytest.mark.slow
def test_warm_up_leaves_no_trace(llm, reference_tokens):
    """The GPU engine's start-up batches (here run on the CPU) own no blocks and change no output."""
    engine = make_engine(llm, num_gpu_blocks=256)
    compile_kernels(engine.runner)
    assert_all_blocks_free(engine)
    assert [o.token_ids for o in run_all(engine, PROMPTS)] == reference_tokens
    assert_all_blocks_free(engine)


@pytest.mark.slow
def test_reference_backend_matches_torch_backend_on_embedded_model(llm):
    """The readable spec, run end to end, gives the fused torch backend's greedy tokens,
    with chunked prefill and a mixed prefill + decode step in the way."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "Write a short poem about autumn leaves falling."]
    torch_tokens = [o.token_ids for o in run_all(make_engine(llm, num_gpu_blocks=32), prompts, params)]
    reference_engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", backend="reference", num_gpu_blocks=32,
                                              max_num_batched_tokens=8),
                                 model=llm.engine.model, tokenizer=llm.tokenizer)
    assert [o.token_ids for o in run_all(reference_engine, prompts, params)] == torch_tokens


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=2, max_size=4),
       budget=st.integers(3, 16), blocks=st.integers(10, 16), mode=st.sampled_from(["swap", "recompute"]),
       prefix_caching=st.booleans())
@pytest.mark.slow
def test_random_workloads_keep_greedy_output(llm, reference_tokens, picks, budget, blocks, mode, prefix_caching):
    """Random mixes of the prompts under a small token budget and a KV cache small enough
    to preempt give each prompt's greedy tokens from running alone."""
    engine = make_engine(llm, num_gpu_blocks=blocks, block_size=4, max_num_batched_tokens=budget,
                         preemption_mode=mode, swap_space=0.01, enable_prefix_caching=prefix_caching)
    outputs = run_all(engine, [PROMPTS[i] for i in picks])
    assert [o.token_ids for o in outputs] == [reference_tokens[i] for i in picks]
    assert_all_blocks_free(engine)


@pytest.mark.slow
def test_a_stop_string_that_never_matches_changes_nothing(llm):
    """A request that ends on a stop token id (as on EOS: finish_reason "stop" too) keeps its
    whole text when it also has stop strings that never matched: the text the detokenizer
    held back in case a stop string was starting is released."""
    engine = make_engine(llm, num_gpu_blocks=256)
    first = run_all(engine, [PROMPTS[1]], GREEDY)[0]
    at = next(i for i in range(6, 12) if first.token_ids[i] not in first.token_ids[:i])
    stop_id = first.token_ids[at]     # ends the request after `at` tokens
    without = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])
    with_stop = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id],
                               stop=["a stop string the model never writes"])
    plain, stopped = run_all(engine, [PROMPTS[1]] * 2, [without, with_stop])
    assert plain.finish_reason == stopped.finish_reason == "stop"
    assert len(plain.token_ids) == at + 1 and plain.text and stopped.text == plain.text
    assert_all_blocks_free(engine)


def test_ids_aborts_and_a_bad_prompt_late_in_a_batch(llm):
    """An automatic id skips ids callers chose; abort takes the id as add_request took it
    (str of it); a prompt that cannot be encoded is a ValueError, and LLM.generate leaves
    no earlier prompt of its batch behind in the engine."""
    engine = make_engine(llm, num_gpu_blocks=64)
    assert engine.add_request("Hello", GREEDY, request_id="0") == "0"
    assert engine.add_request("Hello", GREEDY, request_id=1) == "1"
    assert engine.add_request("a", GREEDY) not in ("0", "1")
    engine.abort(1)
    assert "1" not in engine.requests
    for bad in ("\ud800", [{"role": "user", "content": 5}]):
        with pytest.raises(ValueError, match="encoded|content"):
            engine.add_request(bad, GREEDY)
    for rid in list(engine.requests):
        engine.abort(rid)
    front = llmlab.LLM.from_engine(engine)
    with pytest.raises(ValueError):
        front.generate(["fine", "\ud800"], GREEDY)
    with pytest.raises(ValueError):
        front.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": 5}]], GREEDY)
    assert not engine.requests and not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_async_engine_abort_ends_the_readers_stream(llm):
    """AsyncEngine.abort: a reader iterating the stream gets a last output, finish_reason
    "abort", instead of waiting forever; the blocks come back."""
    import asyncio

    from llmlab.server.async_engine import AsyncEngine

    engine = make_engine(llm, num_gpu_blocks=64)
    async_engine = AsyncEngine(engine)

    async def main():
        async_engine.start()
        try:
            group = await async_engine.add_requests([("x", llm.tokenizer.encode("Once upon a time"),
                                                      SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))])
            async for _, out in group.outputs():
                async_engine.abort("x")
            return out
        finally:
            async_engine.stop()

    last = asyncio.run(asyncio.wait_for(main(), 120))
    assert last.finished and last.finish_reason == "abort"
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("name,value", [
    ("device", "gpu"), ("device", None), ("device", "cuda:x"), ("block_size", 16.0), ("block_size", "16"),
    ("block_size", 24), ("num_gpu_blocks", 1.5), ("max_model_len", 100.5), ("max_num_seqs", 2.5),
    ("max_num_batched_tokens", 1.5), ("cpu_kv_cache_gib", float("nan")), ("cpu_kv_cache_gib", "1"),
    ("swap_space", float("inf")), ("async_scheduling", "no"), ("enable_prefix_caching", "no"),
    ("enable_chunked_prefill", 1), ("enforce_eager", None), ("seed", 1.0),
])
def test_bad_engine_config_names_the_field(name, value):
    """A value of the wrong type or range is a ValueError naming the field, before anything
    compares or converts it (no TypeError from deep inside; "no" is not taken as True)."""
    with pytest.raises(ValueError, match=f"EngineConfig.{name} must be"):
        EngineConfig(**{name: value})


@pytest.mark.slow
def test_token_ids_as_a_tensor_an_array_or_numpy_integers(llm):
    """Token ids come as a list of ints, a tuple, a tensor, a numpy array or numpy integers:
    the same prompt each time; True/False are not token ids; a bare number is no prompt."""
    import numpy as np
    import torch

    engine = make_engine(llm, num_gpu_blocks=64)
    ids = llm.tokenizer.encode(PROMPTS[0])
    for same in (tuple(ids), torch.tensor(ids), np.array(ids), [np.int64(t) for t in ids]):
        assert engine.tokenize(same) == (ids, None)
    with pytest.raises(ValueError):
        engine.tokenize([True, False, 5])
    front = llmlab.LLM.from_engine(engine)
    outputs = front.generate(torch.tensor([ids, ids]), GREEDY)
    assert len(outputs) == 2 and outputs[0].token_ids == outputs[1].token_ids
    assert front.generate(tuple(ids), GREEDY)[0].token_ids == outputs[0].token_ids
    with pytest.raises(ValueError, match="prompts must be"):
        front.generate(5, GREEDY)
    assert_all_blocks_free(engine)
