"""`llmlab.bench.common`, what the benchmarks share: the Llama-3-8B shape, the timers, the
paged caches the kernel benchmarks read, writing --out; and every benchmark reachable as
`llmlab bench NAME`, none reaching into another's private helpers."""
from __future__ import annotations

import ast
import json
import os
import pathlib

import pytest
import torch

from llmlab.bench import common
from llmlab.config import ModelConfig

BENCH = pathlib.Path(common.__file__).parent


def test_the_llama3_8b_weights_are_the_configs_matrices():
    config = ModelConfig.from_hf(common.LLAMA3_8B)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    assert common.LLAMA3_8B_WEIGHTS == {
        "qkv": (q + 2 * kv, config.hidden_size), "o_proj": (config.hidden_size, q),
        "gate_up": (2 * config.intermediate_size, config.hidden_size),
        "down": (config.hidden_size, config.intermediate_size), "lm_head": (config.vocab_size, config.hidden_size)}
    small = ModelConfig.from_hf(common.SMALL_LLAMA)
    assert (small.num_heads // small.num_kv_heads, small.num_layers) == (4, config.num_layers)   # GQA 4, same depth


def test_median_ms_times_repeats_after_the_warm_up(monkeypatch):
    """On the wall clock: `warmup` calls untimed, then the median of `repeats` timed ones."""
    clock = [0.0]
    durations = iter([9.0, 9.0, 0.003, 0.001, 0.002, 0.005])   # seconds: two warm-up calls, then four
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])

    def call():
        clock[0] += next(durations)

    assert common.median_ms(call, repeats=4, warmup=2, cuda_events=False) == pytest.approx(3.0)   # upper middle
    with pytest.raises(StopIteration):                                      # exactly 2 + 4 calls
        call()


def test_paged_cache_shuffles_whole_blocks_and_a_generator_repeats_it():
    seq_lens = [40, 7, 16]
    k_cache, v_cache, block_tables = common.paged_cache(seq_lens, num_kv_heads=2, head_dim=8, block_size=16,
                                                        dtype=torch.float32, device="cpu",
                                                        generator=torch.Generator().manual_seed(0))
    assert k_cache.shape == v_cache.shape == (3 + 1 + 1, 16, 2, 8)
    assert block_tables.dtype == torch.int32 and block_tables.shape == (3, 3)
    used = [block_tables[0, :3], block_tables[1, :1], block_tables[2, :1]]   # the padding is zeros
    assert sorted(torch.cat(used).tolist()) == list(range(5))                # every block once
    again = common.paged_cache(seq_lens, 2, 8, 16, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip((k_cache, v_cache, block_tables), again))


def test_quantized_paged_cache_keeps_the_block_tables_and_scales_each_row():
    from llmlab.kernels import reference

    cache = common.paged_cache([20, 12], 2, 8, 4, torch.float32, "cpu", torch.Generator().manual_seed(1))
    k_codes, v_codes, block_tables, k_scales, v_scales = common.quantize_paged_cache(*cache, torch.int8)
    assert k_codes.dtype == v_codes.dtype == torch.int8 and block_tables is cache[2]
    assert k_scales.shape == v_scales.shape == cache[0].shape[:3]                 # [blocks, block_size, kv heads]
    # int8 keeps 127 steps of each row's largest value: half a step is the worst rounding
    assert torch.allclose(reference.dequantize(k_codes, k_scales), cache[0], atol=0.5 * k_scales.max().item())
    assert set(common.quantized_cache_dtypes("cpu")) == {"int8", "fp8"}         # the interpreter runs both


def test_write_json_writes_only_when_given_a_path(tmp_path):
    common.write_json(None, {"a": 1})                                           # no --out: nothing
    common.write_json(tmp_path / "r.json", [{"ms": 1.5}], indent=2)
    text = (tmp_path / "r.json").read_text()
    assert json.loads(text) == [{"ms": 1.5}] and text == json.dumps([{"ms": 1.5}], indent=2)


def test_machine_lines_name_the_cpu_and_the_software():
    from llmlab import machine

    cores, threads = os.cpu_count(), torch.get_num_threads()
    assert machine.machine_name("cpu") == f"{machine.cpu_name()}, {cores} cores, {threads} threads"
    assert machine.recorded_on("cpu") == f"CPU ({cores} cores), torch {torch.__version__}, {threads} threads"
    assert {"device", "cpu", "cores", "torch_threads", "load", "torch", "triton"} <= set(machine.machine_info())


def test_every_benchmark_module_is_a_command(capsys):
    """`llmlab bench NAME --help` for each module with add_arguments and main, launches too."""
    from llmlab.cli import BENCHMARKS, main

    modules = {f"llmlab.bench.{path.stem}" for path in BENCH.glob("*.py")
               if "def add_arguments(" in path.read_text() and "def main(" in path.read_text()}
    assert modules == set(BENCHMARKS.values())
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "launches", "--help"])
    assert exit_.value.code == 0
    assert "--batch-sizes" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "prefill-variants", "--help"])
    out = capsys.readouterr().out   # the module's docstring: what it measures, its examples
    assert "SEQSxQUERIESxCONTEXT" in out and "llmlab bench prefill-variants --shapes 1x40x40" in out


def test_no_benchmark_imports_another_ones_private_helpers():
    for path in BENCH.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmlab.bench"):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
