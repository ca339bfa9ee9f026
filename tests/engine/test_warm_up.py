"""warm_up.warm_up, the one place everything is compiled or captured at start-up: on a GPU
with the Triton backend it captures the decode graphs (the ladder, then every graph_keys
key) and the prompt graphs, then runs the kernel-variant batches, then warms the sampler, in that order; on a
CPU it does nothing. A recording stand-in for the runner and sampler shows the order
without a GPU (tests/engine/test_gpu.py and test_overlap.py check the real thing on one)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmlab.engine.warm_up import compile_kernels, graph_keys, warm_up
from llmlab.model.llama import LOGITS_DTYPE


def one_split(num_seqs, context):
    return 1


def stand_ins(device: str, backend: str, calls: list):
    graphs = SimpleNamespace(sizes=[1, 2, 4, 8], capture=lambda keys: calls.append(("capture", sorted(keys))))
    config = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=False, pipeline_parallel_size=1)

    def make_decode_graphs():
        calls.append(("ladder",))
        return graphs

    runner = SimpleNamespace(
        device=torch.device(device), backend=backend, config=config, block_size=4, max_model_len=64,
        model_config=SimpleNamespace(vocab_size=32), num_splits=one_split,
        kv_cache=SimpleNamespace(device=torch.zeros(1, 2, 64)),   # [layers, k/v, num_blocks]: 64 blocks
        make_decode_graphs=make_decode_graphs, make_prompt_graphs=lambda: calls.append(("prompt",)),
        execute=lambda plan: calls.append(("execute",)))
    sampler = SimpleNamespace(warm_up=lambda *args: calls.append(("sampler", *args)))
    return runner, sampler, config


def test_a_gpu_engine_captures_graphs_then_compiles_kernels_then_warms_the_sampler(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    calls = []
    runner, sampler, config = stand_ins("cuda", "triton", calls)
    warm_up(runner, sampler, config)
    assert calls[0] == ("ladder",)
    assert calls[1] == ("capture", graph_keys([1, 2, 4, 8], 8, 64, one_split))
    assert calls[2] == ("prompt",)
    assert calls[3:-1] and all(c == ("execute",) for c in calls[3:-1])   # the kernel-variant batches
    assert calls[-1] == ("sampler", 32, torch.device("cuda"), LOGITS_DTYPE, 8)


@pytest.mark.parametrize("setting", [dict(enforce_eager=True), dict(pipeline_parallel_size=2)])
def test_eager_and_pipeline_parallel_engines_capture_no_decode_graphs(monkeypatch, setting):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    calls = []
    runner, sampler, config = stand_ins("cuda", "triton", calls)
    vars(config).update(setting)
    warm_up(runner, sampler, config)
    assert {c[0] for c in calls} == {"execute", "sampler"} and calls[-1][0] == "sampler"


@pytest.mark.parametrize("device, backend", [("cpu", "triton"), ("cpu", "torch"), ("cuda", "torch")])
def test_nothing_is_compiled_or_captured_off_a_gpu_with_triton(device, backend):
    calls = []
    warm_up(*stand_ins(device, backend, calls))
    assert calls == []


def test_the_kernel_batches_skip_shapes_the_engine_cannot_hold(monkeypatch):
    calls = []
    runner, _, _ = stand_ins("cpu", "torch", calls)
    shapes = []
    runner.execute = lambda plan: shapes.append(max(i.start_position + i.num_tokens for i in plan.items))
    compile_kernels(runner)
    assert shapes and max(shapes) <= runner.max_model_len
