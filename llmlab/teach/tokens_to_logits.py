"""Notebook 01, from tokens to logits: the KV cache's size per token, what the residual stream
adds up, and what the model predicts.

q1 is computed from the model's config. q2-q4 are facts of the embedded model's forward pass,
measured once and kept here (tests/teach/test_model_facts.py measures them again with the
model; each is far from a tie, so rounding on another CPU cannot flip it).
"""
from __future__ import annotations

from llmlab.teach.ground_truth import embedded_config
from llmlab.teach.check import integer, right, text, wrong

PROMPT = "The quick brown fox jumps over the lazy"
# the last token of PROMPT: layers whose MLP output has a larger norm than their attention output
LAYERS_MLP_LARGER = 27
ATTENTION_LAYER, SINK_POSITION = 3, 0       # the key with the most attention weight in layer 3 (all heads, all queries)
NEXT_TOKEN_PROMPT, NEXT_TOKEN = "The sun rises in the", " sky"     # greedy; " east" is second


def q1(answer):
    """How many numbers does one token leave in the KV cache, over all layers, K and V together?"""
    c = embedded_config()
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim
    value = integer(answer)
    if value == per_token:
        return right(f"K and V, {c.num_layers} layers, {c.num_kv_heads} kv heads of {c.head_dim}: grouped-query "
                     f"attention makes it {c.num_heads // c.num_kv_heads}x smaller than one kv head per query head.")
    mistakes = {2 * c.num_layers * c.hidden_size: "you counted the query heads (the hidden size is their width); "
                "K and V have fewer heads (grouped-query attention: look at the shapes of layers.0.k and layers.0.v)",
                c.num_layers * c.num_kv_heads * c.head_dim: "the cache keeps both the key and the value",
                2 * c.num_kv_heads * c.head_dim: "every layer has a cache of its own"}
    return wrong(mistakes.get(value, "multiply what one layer keeps per token (the shapes of layers.0.k and "
                                     "layers.0.v, one token's row) by the number of layers."))


def q2(answer):
    """In how many of the 30 layers does the MLP add a larger vector (norm) than attention to the last
    token's residual stream?"""
    count = integer(answer)
    if count == LAYERS_MLP_LARGER:
        return right("the MLPs write most of the residual stream for this token; attention adds less, and in "
                     "a few layers more.")
    if count == 30 - LAYERS_MLP_LARGER:
        return wrong("that counts the layers where attention's vector is the larger one.")
    return wrong("compare taps[f'layers.{i}.attn'][0][-1].norm() with taps[f'layers.{i}.mlp'][0][-1].norm() "
                 "for every layer i ([-1]: the last token's row) and count.")


def q3(answer):
    """In layer 3, which key position (0 = the first token) gets the most attention weight, summed over
    every query row and every head?"""
    position = integer(answer)
    if position == SINK_POSITION:
        return right("most heads park their weight on the first token when nothing else matters: an "
                     "attention sink.")
    return wrong("sum viz.attention_probs(...) (shape [heads, query, key]) over heads and queries and take "
                 "the argmax; one head's heatmap alone can mislead.")


def q4(answer):
    """Prompt "The sun rises in the": which token does the model pick next, greedily?"""
    token = text(answer)
    if token.strip().lower() == NEXT_TOKEN.strip():
        return right("and not ' east', the textbook answer, which is second: a 135M model's knowledge is thin.")
    if token.strip().lower() == "east":
        return wrong("the textbook answer, but is it the model's? Run the top-5 cell on this prompt.")
    return wrong("set prompt = 'The sun rises in the' and run the notebook down to the top-5 cell: greedy "
                 "takes the first row.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3, "q4": q4}
