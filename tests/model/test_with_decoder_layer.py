"""LlamaModel.with_decoder_layer, the plug-in point of exercise 15: a new model object over
the same weight tensors whose layers are run by the given class, one object per layer."""
import torch

from llmlab.config import ModelConfig
from llmlab.model.llama import ForwardBatch, LlamaModel

CONFIG = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=3,
                     num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0)


class Spy:
    """A decoder layer that records its calls and adds 1 to the stream."""
    calls = []

    def __init__(self, config, weights):
        self.config, self.weights = config, weights

    def __call__(self, hidden, residual, positions, batch, k_cache, v_cache, k_scales=None, v_scales=None):
        Spy.calls.append((self, residual is None, k_cache.data_ptr(), k_scales))
        return hidden + 1, hidden if residual is None else residual


def test_plugged_layers_run_in_order_on_their_own_cache_layer():
    model = LlamaModel.random(CONFIG, torch.float32, "cpu")
    plugged = model.with_decoder_layer(Spy)
    assert model.plugged_layers is None, "the model it was made from is unchanged"
    assert all(layer.weights is weights and layer.config is CONFIG
               for layer, weights in zip(plugged.plugged_layers, model.layers)), "the same weight tensors, not copies"
    kv_cache = torch.zeros(CONFIG.num_layers, 2, 2, 4, 1, 8)
    ints = lambda *v: torch.tensor(v, dtype=torch.int32)   # noqa: E731
    batch = ForwardBatch(num_prefill_tokens=2, slot_mapping=torch.tensor([0, 1]), prefill_cu_seqlens_q=ints(0, 2),
                         prefill_seq_lens=ints(2), prefill_block_tables=ints(0)[None], decode_seq_lens=ints(),
                         decode_block_tables=torch.zeros(0, 1, dtype=torch.int32), logits_indices=torch.tensor([1]))
    Spy.calls.clear()
    hidden = torch.zeros(2, CONFIG.hidden_size)
    out, residual = plugged.decoder_layers(hidden, None, torch.arange(2), batch, kv_cache)
    assert [(layer, first) for layer, first, _, _ in Spy.calls] == list(zip(plugged.plugged_layers,
                                                                             [True, False, False]))
    assert [ptr for _, _, ptr, _ in Spy.calls] == [kv_cache[i, 0].data_ptr() for i in range(3)]
    assert torch.equal(out, torch.full_like(hidden, 3.0)) and torch.equal(residual, hidden)
