"""The embedded model through llmlab matches HF transformers loading the same GGUF file."""
import pytest
import torch

import llmlab

# HF transformers loads the same GGUF file once (the hf_model fixture): about 45 s on a CPU
pytestmark = pytest.mark.slow

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Describe the sea in three long sentences, with many adjectives."}],
    [{"role": "user", "content": "List five fruits."},
     {"role": "assistant", "content": "Apple, banana, cherry, date, elderberry."},
     {"role": "user", "content": "Now five vegetables."}],
]


def hf_greedy(hf_model, prompt_ids, max_new_tokens):
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_tokens_match_hf_batched(llm, hf_model):
    params = llmlab.SamplingParams(max_tokens=24, temperature=0.0)
    outputs = llm.chat(CONVERSATIONS, params)   # all four batched in one engine
    for conversation, out in zip(CONVERSATIONS, outputs):
        prompt_ids = llm.tokenizer.apply_chat_template(conversation)
        expected = hf_greedy(hf_model, prompt_ids, 24)
        # HF stops after EOS too, so both lists end at the same place
        assert out.token_ids == expected[:len(out.token_ids)], conversation
        assert len(out.token_ids) == len(expected) or out.finish_reason == "stop"


def test_chat_template_matches_hf_tokenizer(llm):
    from transformers import AutoTokenizer

    from llmlab.model.loader import embedded_gguf_path

    path = embedded_gguf_path()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for conversation in CONVERSATIONS:
        expected = hf_tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert llm.tokenizer.apply_chat_template(conversation) == list(expected)


def test_logits_close_to_hf(llm, hf_model):
    """Last-token logits after prefill, and after each of a few decode steps."""
    engine = llm.engine
    prompt_ids = llm.tokenizer.apply_chat_template(CONVERSATIONS[2])
    params = llmlab.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with engine.model.capture(["logits"]) as taps:
        out = llm.generate([prompt_ids], params)[0]
    ours = torch.cat(taps["logits"])                       # [1 prefill + 3 decodes, vocab]
    ids = prompt_ids + out.token_ids
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1:len(ids) - 1]
    # float32 over 30 layers with different summation orders (fused projections, paged
    # attention): differences of ~1e-4 relative to logits of magnitude ~10-30
    torch.testing.assert_close(ours, theirs.float(), atol=2e-3, rtol=1e-3)


def test_hook_points_match_hf_modules(llm, hf_model):
    """The captured hook points equal the outputs of the corresponding HF modules."""
    prompt_ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    captured = {}

    def grab(name):
        def hook(module, args, output):
            captured[name] = (output[0] if isinstance(output, tuple) else output)[0].detach()
        return hook

    layer = hf_model.model.layers[3]
    handles = [hf_model.model.embed_tokens.register_forward_hook(grab("embed")),
               layer.self_attn.q_proj.register_forward_hook(grab("layers.3.q")),
               layer.self_attn.v_proj.register_forward_hook(grab("layers.3.v")),
               layer.self_attn.register_forward_hook(grab("layers.3.attn")),
               layer.mlp.register_forward_hook(grab("layers.3.mlp"))]
    try:
        with torch.inference_mode():
            hf_model(torch.tensor([prompt_ids]))
    finally:
        for h in handles:
            h.remove()
    with llm.engine.model.capture(list(captured)) as taps:
        llm.generate([prompt_ids], llmlab.SamplingParams(max_tokens=1))
    for name, expected in captured.items():
        ours = taps[name][0].reshape(expected.shape)
        torch.testing.assert_close(ours, expected, atol=1e-3, rtol=1e-3, msg=name)
