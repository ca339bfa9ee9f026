"""Prefix caching is on by default, as in vLLM (BENCHMARKS.md, "Prefix caching": free when
nothing is shared): in EngineConfig, in a BlockManager built without the flag, in the
simulator, and in every command's flags, where --no-enable-prefix-caching turns it off.
On by default, its hit rate is on every server's /metrics: it counts each lookup once."""
from __future__ import annotations

import importlib

import pytest

from llmlab import EngineConfig, cli
from llmlab.cache.block_manager import BlockManager
from llmlab.cli_flags import engine_kwargs
from llmlab.experiments import CostModel, Workload, simulate
from llmlab.request import Request
from llmlab.sampling import SamplingParams
from llmlab.scheduler import Scheduler


def test_engine_config_and_block_manager_agree():
    assert EngineConfig().enable_prefix_caching is True
    assert BlockManager(8, 0, 4).enable_prefix_caching is EngineConfig().enable_prefix_caching


def test_the_simulator_caches_prefixes_unless_told_not_to():
    workload = Workload.shared_prefix(2, 3, prefix_len=32, suffix_len=4, output_len=2, seed=0, vocab_size=100)
    cost = CostModel.constant(0.01, {"num_gpu_blocks": 64, "max_model_len": 256})

    def prefill_tokens(**overrides):
        config = EngineConfig(device="cpu", block_size=4, num_gpu_blocks=64, **overrides)
        return sum(s.num_prefill_tokens for s in simulate(workload, config, cost).steps)

    prompts = sum(len(r.prompt_token_ids) for r in workload)
    assert prefill_tokens(enable_prefix_caching=False) == prompts
    assert prefill_tokens() < prompts          # the default: later requests find the prefix


@pytest.mark.parametrize("command, module", [(["serve"], "llmlab.server.serve"),
                                             (["bench", "offline"], "llmlab.bench.offline"),
                                             (["bench", "head-of-line"], "llmlab.bench.head_of_line")])
@pytest.mark.parametrize("flags, enabled", [([], True), (["--no-enable-prefix-caching"], False),
                                            (["--enable-prefix-caching"], True)])
def test_commands_build_their_engine_config_from_the_flags(monkeypatch, command, module, flags, enabled):
    seen = []
    # the command's own main would load a model; its parsed arguments are what matters here
    monkeypatch.setattr(importlib.import_module(module), "main", seen.append)
    cli.main([*command, *flags])
    (args,) = seen
    assert EngineConfig(**engine_kwargs(args)).enable_prefix_caching is enabled


def test_a_request_held_back_for_a_prefix_in_flight_is_looked_up_once():
    # two requests with one 12-token prompt arrive together: the second waits a step while
    # the first computes the shared blocks, then finds both usable blocks ((12 - 1) // 4)
    config = EngineConfig(device="cpu", block_size=4, num_gpu_blocks=32, max_num_batched_tokens=64)
    blocks = BlockManager(32, 0, config.block_size)
    scheduler = Scheduler(config, blocks, max_model_len=128)
    first, second = (Request(rid, None, list(range(10, 22)), SamplingParams(max_tokens=2)) for rid in "ab")
    scheduler.add(first)
    scheduler.add(second)
    for admitted in (["a"], ["b"]):
        plan = scheduler.schedule()
        assert [i.request.request_id for i in plan.prefills] == admitted
        scheduler.update(plan, [1] * len(plan.sampling_items))
    assert plan.prefix_hit_tokens == {"b": 8}
    # a's lookup (0 of 2) and b's (2 of 2); b's step in the queue looked nothing up
    assert (blocks.prefix_queries, blocks.prefix_hits) == (4, 2) and blocks.prefix_hit_rate == 0.5
