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
