"""llmlab.bench.kv_quant on the tiny model: the captured rows are what the cache stores, the
accuracy rows compare every cache with full precision, and both can show their progress (a
notebook cell that runs for seconds says it is alive)."""
import torch

from llmlab.bench import kv_quant

from helpers.engine import TINY, tiny_model, tiny_prompt


def test_capture_and_accuracy_report_their_progress(capsys):
    model, tokens = tiny_model(seed=1), tiny_prompt(260, seed=2)           # two chunks: 256 tokens and 4
    keys, values = kv_quant.capture_kv(model, tokens, progress=True)
    assert keys.shape == values.shape == (TINY.num_layers, 260, TINY.num_kv_heads, TINY.head_dim)
    err = capsys.readouterr().err
    assert "prefill chunks: 100%" in err and "2/2" in err
    rows = kv_quant.accuracy(model, tokens, only=["engine"], progress=True)
    assert [r["cache"] for r in rows] == ["full precision (auto)", "int8, per token-head (engine)"]
    assert rows[0]["mean_kl"] == 0.0 and rows[1]["top1_agreement_pct"] > 90
    assert "4/4" in capsys.readouterr().err                                 # 2 chunks x 2 caches
    kv_quant.capture_kv(model, tokens)
    assert capsys.readouterr().err == ""                                     # quiet unless asked
    assert torch.equal(kv_quant.capture_kv(model, tokens)[0], keys)


def test_your_own_schemes_run_beside_the_chosen_ones():
    """Notebook 13 asks how much of the int8 cache's KL comes from its keys: a scheme that
    quantizes both as the engine does gives the engine's row, one that keeps both gives no KL."""
    model, tokens = tiny_model(seed=1), tiny_prompt(40, seed=2)
    keep = lambda x: x      # noqa: E731
    rows = kv_quant.accuracy(model, tokens, only=["engine"],
                             schemes={"both": (kv_quant.per_token_head, kv_quant.per_token_head),
                                      "neither": (keep, keep), "K only": (kv_quant.per_token_head, keep)})
    by_name = {r["cache"]: r for r in rows}
    assert list(by_name) == ["full precision (auto)", "int8, per token-head (engine)", "both", "neither", "K only"]
    assert by_name["neither"]["mean_kl"] == 0.0 and by_name["both"]["mean_kl"] > 0
    assert abs(by_name["both"]["mean_kl"] - by_name["int8, per token-head (engine)"]["mean_kl"]) \
        <= 0.05 * by_name["both"]["mean_kl"]     # the engine's kernels and the simulation: the same codes
    assert 0 < by_name["K only"]["mean_kl"] < by_name["both"]["mean_kl"] * 1.5
