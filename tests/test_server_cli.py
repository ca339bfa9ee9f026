"""The engine flags of every `llmlab` command come from EngineConfig's fields (one place):
a new field is a new flag everywhere, with its comment as help and vLLM's spelling."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from llmlab import cli
from llmlab.cli_flags import add_engine_arguments, engine_argv, engine_kwargs
from llmlab.config import EngineConfig


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def help_of(capsys, *argv) -> str:
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("command, excluded", [
    (["serve"], ()), (["generate"], ("seed",)), (["chat"], ("seed",)), (["demo"], ("seed",)),
    (["bench", "offline"], ("seed",)),   # their --seed is the sampling / workload seed
])
def test_every_engine_field_is_a_flag_of_every_command(capsys, command, excluded):
    text = help_of(capsys, *command)
    from llmlab.cli_flags import NOT_FLAGS

    for name in EngineConfig.field_names():
        if name not in excluded + NOT_FLAGS:
            assert flag(name) + " " in text or flag(name) + "," in text, (command, name)


def test_flags_parse_into_engine_config_kwargs():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--max-num-seqs", "3", "--no-enable-chunked-prefill", "--enable-prefix-caching",
                              "-tp", "1", "--gpu-memory-utilization", "0.5", "--dtype", "float32"])
    kwargs = engine_kwargs(args)
    assert kwargs == dict(max_num_seqs=3, enable_chunked_prefill=False, enable_prefix_caching=True,
                          tensor_parallel_size=1, gpu_memory_utilization=0.5, dtype="float32")
    config = EngineConfig(**kwargs)      # flags not given keep EngineConfig's defaults
    assert config.block_size == EngineConfig.block_size and config.max_num_seqs == 3
    assert engine_kwargs(parser.parse_args([])) == {}


def test_engine_argv_gives_the_same_flags_again():
    """What a benchmark passes on to the `llmlab serve` it starts (bench head-of-line --flood-clients)."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--max-num-seqs", "3", "--no-enable-chunked-prefill", "--enable-prefix-caching",
                              "-tp", "1", "--gpu-memory-utilization", "0.5", "--dtype", "float32"])
    argv = engine_argv(args)
    assert engine_kwargs(parser.parse_args(argv)) == engine_kwargs(args)
    assert engine_argv(parser.parse_args([])) == []


def test_help_is_the_field_comment_and_defaults_can_differ(capsys):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, defaults={"max_num_seqs": 256}, exclude=("model",))
    parser.print_help()
    text = " ".join(capsys.readouterr().out.split())
    assert "--block-size INT tokens per KV block (default: 16)" in text
    assert "--max-num-seqs INT requests running at once (a step's batch); None = sized to the device" in text
    assert "(sizing.py: 64 on a CPU) (default: 256)" in text
    assert "--model" not in text
    assert engine_kwargs(parser.parse_args([])) == {"max_num_seqs": 256}
    booleans = [f.name for f in dataclasses.fields(EngineConfig) if f.type in ("bool", bool)]
    assert booleans and all(f"--no-{flag(name)[2:]}" in text for name in booleans)


def test_the_cpu_token_budget_is_smaller_than_the_gpu_one():
    """Head-of-line blocking on a CPU: a 2048-token step takes ~30 s there (BENCHMARKS.md)."""
    from llmlab import sizing

    assert sizing.token_budget(EngineConfig(device="cpu")) == sizing.CPU_TOKEN_BUDGET
    assert sizing.CPU_TOKEN_BUDGET < min(row.server_tokens for row in sizing.GPU_SIZES)
    assert sizing.token_budget(EngineConfig(device="cpu", max_num_batched_tokens=64)) == 64


def test_allowed_hosts_default_to_loopback_names_on_loopback():
    from llmlab.server.serve import allowed_hosts_for

    def args(host, allowed=None):
        return argparse.Namespace(host=host, allowed_hosts=allowed)
    assert allowed_hosts_for(args("127.0.0.1")) == ["localhost", "127.0.0.1", "::1"]
    assert allowed_hosts_for(args("0.0.0.0")) == ["*"]     # exposed on purpose: use --allowed-hosts
    assert allowed_hosts_for(args("0.0.0.0", "llm.example.com, *.lan")) == ["llm.example.com", "*.lan"]
