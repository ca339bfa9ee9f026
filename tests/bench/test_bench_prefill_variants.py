"""`llmlab bench prefill-variants` at a tiny scale on the CPU (Triton's interpreter): the
same code path the H200 run takes, so that run does not die on its first line, and a
variant that computes the wrong thing is reported as such and never picked."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from llmlab.bench import prefill_variants

VARIANTS = ["m64-n64-w4-s3", "m64-n64-w4-s3-gqa", "m128-n64-w8-s3-dq"]   # -dq: 8-bit caches only
SHAPES = "1x40x40,2x24x72"    # a whole prompt; two chunks of 24 after 48 cached tokens


def parse(*argv):
    parser = argparse.ArgumentParser()
    prefill_variants.add_arguments(parser)
    return parser.parse_args(list(argv))


def tiny(out, *extra):
    return parse("--out", str(out), "--shapes", SHAPES, "--num-heads", "4", "--num-kv-heads", "2",
                 "--head-dim", "64", "--configs", ",".join(VARIANTS), "--device", "cpu", *extra)


def test_causal_flops_count_the_pairs_the_mask_keeps():
    for queries, context in ((40, 40), (24, 72), (1, 9)):
        positions = torch.arange(context - queries, context)
        kept = (torch.arange(context)[None, :] <= positions[:, None]).sum().item()
        assert prefill_variants.causal_flops(3, queries, context, 4, 64) == 4 * 4 * 64 * kept * 3


@pytest.mark.slow
def test_times_every_variant_on_every_cache_and_checks_them(tmp_path):
    out = tmp_path / "variants.json"
    result = prefill_variants.main(tiny(out))
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    for shape in ("1x40x40", "2x24x72"):
        for cache in ("float16", "int8", "fp8"):   # the interpreter has no bf16
            mine = [row for row in rows if row["shape"] == shape and row["cache"] == cache]
            assert [row["variant"] for row in mine] == ["default (m64-n32-w4-s1)"] + VARIANTS[:2 if cache == "float16" else 3]
            assert [row["heads_per_program"] for row in mine] == [1, 1, 2, 1][:len(mine)]   # group 2 packs at 64 rows
            for row in mine:
                assert "error" not in row and row["ok"], row
                assert row["tflop_s"] == float(f"{row['flops'] / row['ms'] / 1e9:.4g}") > 0
                assert (row["variant"].startswith("default") and cache == "float16") or row["vs_default"] > 0
    best = result["best"]
    assert set(best) == {f"{cache} {shape}" for cache in ("float16", "int8", "fp8") for shape in ("1x40x40", "2x24x72")}
    for shape in ("1x40x40", "2x24x72"):
        fastest = best[f"float16 {shape}"]["ms"]
        assert fastest == min(row["ms"] for row in rows if row["shape"] == shape and row["cache"] == "float16")
        assert best[f"int8 {shape}"]["vs_best_16bit"] == round(fastest / best[f"int8 {shape}"]["ms"], 3)


@pytest.mark.slow
def test_a_wrong_variant_is_reported_and_never_the_best(tmp_path, monkeypatch):
    from llmlab.kernels.triton import prefill_attention as triton_prefill

    right = triton_prefill.prefill_attention

    def planted(*args, config=None, **kwargs):   # the packed variant drops its last head
        out = right(*args, config=config, **kwargs)
        if config == VARIANTS[1]:
            out[:, -1] = 0
        return out
    monkeypatch.setattr(triton_prefill, "prefill_attention", planted)
    result = prefill_variants.main(tiny(tmp_path / "v.json", "--cache-dtypes", "int8"))
    wrong = [row for row in result["rows"] if row["variant"] == VARIANTS[1]]
    assert len(wrong) == 4 and not any(row["ok"] for row in wrong)   # 2 shapes x (fp16, int8)
    assert all(row["variant"] != VARIANTS[1] for row in result["best"].values())


def test_the_engines_name_for_the_fp8_cache_is_taken(tmp_path):
    result = prefill_variants.main(parse("--shapes", "1x16x16", "--num-heads", "2", "--num-kv-heads", "1",
                                         "--head-dim", "16", "--configs", "m64-n64-w4-s3", "--cache-dtypes",
                                         "fp8_e4m3", "--device", "cpu"))
    assert {row["cache"] for row in result["rows"]} == {"float16", "fp8"}
    assert all(row["ok"] for row in result["rows"])


def test_unknown_configs_and_shapes_are_refused():
    with pytest.raises(ValueError, match="unknown configs"):
        prefill_variants.main(parse("--configs", "m99-n1-w1-s1", "--device", "cpu"))
    for shape, words in (("4096x4096", "SEQSxQUERIESxCONTEXT"), ("1x50x40", "QUERIES <= CONTEXT")):
        with pytest.raises(ValueError, match=words):
            prefill_variants.main(parse("--shapes", shape, "--device", "cpu"))
    for argv, words in ((["--num-kv-heads", "0"], "positive multiple"), (["--head-dim", "48"], "--head-dim 48"),
                        (["--block-size", "12"], "--block-size 12")):
        with pytest.raises(ValueError, match=words):
            prefill_variants.main(parse(*argv, "--device", "cpu"))
