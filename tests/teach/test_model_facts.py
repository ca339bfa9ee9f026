"""The facts of the embedded model that notebook 01's questions keep (llmlab/teach/tokens_to_logits.py),
measured again with the model, the way the notebook's cells measure them."""
import pytest
import torch

from llmlab import SamplingParams, viz
from llmlab.teach import tokens_to_logits as facts

pytestmark = pytest.mark.slow      # loads the embedded model


def test_the_kept_facts_are_the_models(llm):
    model, config = llm.engine.model, llm.engine.model_config
    ids = llm.tokenizer.encode(facts.PROMPT)
    with model.capture() as taps:
        llm.generate(ids, SamplingParams(max_tokens=1, temperature=0.0))
    mlp_larger = sum(taps[f"layers.{i}.mlp"][0][-1].norm() > taps[f"layers.{i}.attn"][0][-1].norm()
                     for i in range(config.num_layers))
    assert mlp_larger == facts.LAYERS_MLP_LARGER
    layer = facts.ATTENTION_LAYER
    weights = viz.attention_probs(taps[f"layers.{layer}.q"][0], taps[f"layers.{layer}.k"][0],
                                  torch.arange(len(ids)), config)
    assert weights.sum(dim=(0, 1)).argmax().item() == facts.SINK_POSITION
    greedy = llm.generate(facts.NEXT_TOKEN_PROMPT, SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert greedy.text == facts.NEXT_TOKEN
