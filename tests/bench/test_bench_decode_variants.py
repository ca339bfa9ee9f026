"""`llmlab bench decode-variants` at a tiny scale on the CPU (Triton's interpreter): the
same code path the H200 run takes, so that run does not die on its first line."""
from __future__ import annotations

import argparse
import json

import pytest

from llmlab.bench import decode_variants

VARIANTS = ["legacy-n64-w4-s2", "packed-n64-w4-s2"]


def parse(*argv):
    parser = argparse.ArgumentParser()
    decode_variants.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.slow
def test_times_the_baseline_and_every_variant_and_checks_them(tmp_path):
    out = tmp_path / "variants.json"
    args = parse("--out", str(out), "--shapes", "2x40", "--num-heads", "4", "--num-kv-heads", "2",
                 "--head-dim", "64", "--configs", ",".join(VARIANTS), "--splits", "1,2", "--device", "cpu")
    result = decode_variants.main(args)
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    baseline = [row for row in rows if row["cache"] == "float16"]   # the interpreter has no bf16
    assert [row["num_splits"] for row in baseline] == [1, 2]
    assert all(row["ok"] and row["bytes_read"] == 2 * 2 * 40 * 2 * 64 * 2 for row in baseline)   # K and V, fp16
    for cache in ("int8", "fp8"):
        quantized = [row for row in rows if row["cache"] == cache]
        assert [(row["variant"], row["num_splits"]) for row in quantized] == [
            (name, splits) for name in VARIANTS for splits in (1, 2)]
        for row in quantized:
            assert "error" not in row and row["ok"], row
            assert row["ms"] > 0 and row["speedup_vs_bf16"] > 0
            # 2 (K, V) * batch * context * kv heads rows, each 64 codes and a 4-byte scale
            assert row["bytes_read"] == 2 * 2 * 40 * 2 * 68
    best = result["best"]
    assert set(best) == {"float16 2x40", "int8 2x40", "fp8 2x40"}
    fastest_full = min(row["ms"] for row in baseline)
    for cache in ("int8", "fp8"):   # against the full-precision kernel's fastest split count
        assert best[cache + " 2x40"]["speedup_vs_best_bf16"] == round(fastest_full / best[cache + " 2x40"]["ms"], 3)
    assert "speedup_vs_best_bf16" not in best["float16 2x40"]


def test_unknown_config_is_refused():
    with pytest.raises(ValueError, match="unknown configs"):
        decode_variants.main(parse("--configs", "packed-n99-w1-s1", "--device", "cpu"))


@pytest.mark.slow
def test_engine_rows_time_what_the_engine_runs(tmp_path, monkeypatch):
    """--engine adds, per shape, the split count the engine takes and the 8-bit variant it picks
    for that shape; the summary compares the 8-bit one with the best full-precision row."""
    from llmlab import kernels
    from llmlab.kernels.triton.q8_configs import default_q8_config

    monkeypatch.setattr(kernels.knobs, "q8_decode", None)
    result = decode_variants.main(parse("--shapes", "2x40", "--num-heads", "4", "--num-kv-heads", "2",
                                        "--head-dim", "64", "--configs", VARIANTS[1], "--splits", "2",
                                        "--cache-dtypes", "int8", "--device", "cpu", "--engine"))
    engine = [row for row in result["rows"] if row["variant"].startswith("engine: ")]
    assert [(row["variant"], row["cache"], row["num_splits"]) for row in engine] == [
        ("engine: float16", "float16", 1), ("engine: " + default_q8_config(2, 2, 1), "int8", 1)]
    assert all(row["ok"] for row in engine)
    chosen = result["engine"]["int8 2x40"]
    fastest_full = min(row["ms"] for row in result["rows"] if row["cache"] == "float16")
    assert chosen["speedup_vs_best_bf16"] == round(fastest_full / chosen["ms"], 3)
