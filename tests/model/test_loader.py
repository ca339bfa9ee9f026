"""Model loading, proven against HF transformers.

For each model family llmlab supports (LLaMA-2, LLaMA-3.x, Mistral, Qwen2) and each weight
format a HF folder can hold (single / sharded safetensors, single / sharded PyTorch .bin),
a tiny random model written by transformers' own classes must give, through the whole
engine, the logits transformers computes for the same tokens. Broken inputs must raise
ValueError saying what is wrong. GGUF's Q/K row permutation must be undone exactly.
"""
from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import llmlab
from llmlab.config import ModelConfig
from llmlab.model.gguf_convert import unpermute_qk
from llmlab.model.loader import load_config
from helpers.hf_checkpoints import (LLAMA3_ROPE_SCALING, VARIANTS, VOCAB_SIZE, WEIGHT_FORMATS, build_hf_model,
                                    save)

MAX_TOKENS = 12
# what ModelConfig keeps of a llama3 rope scaling (the type is implied)
LLAMA3_ROPE_SCALING_VALUES = {k: v for k, v in LLAMA3_ROPE_SCALING.items() if k != "rope_type"}


# ---- helpers ---------------------------------------------------------------------------

def engine_for(folder, max_num_batched_tokens=256):
    # 64 blocks of 16 tokens hold every sequence here; no swap space, nothing is preempted
    return llmlab.LLMEngine(llmlab.EngineConfig(
        model=str(folder), dtype="float32", device="cpu", num_gpu_blocks=64, block_size=16,
        swap_space=0, max_num_batched_tokens=max_num_batched_tokens))


def random_prompt(length, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (length,), generator=generator).tolist()


def run_engine(engine, prompts, max_tokens=MAX_TOKENS):
    """Greedy-decode `prompts` together. Returns one (tokens, logits) per prompt, where
    logits[j] is the engine's logits row at position len(prompt) - 1 + j: the prompt's last
    token, then each decode step. Rows are matched to requests and positions through the
    step trace, so chunked prefills and mixed batches are handled the same way."""
    params = llmlab.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    recorder = llmlab.Recorder()
    engine.hooks.attach(recorder)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    tokens = {}
    with engine.model.capture(["logits"]) as taps:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
    forwards = [step for step in recorder.trace.steps if step.scheduled]
    assert len(forwards) == len(taps["logits"]), "one logits capture per forward"
    rows = {rid: {} for rid in ids}        # request id -> {position: logits row}
    for step, logits in zip(forwards, taps["logits"]):
        sampling = [item for item in step.scheduled if item.request_id in step.sampled]   # a row each
        assert logits.shape == (len(sampling), VOCAB_SIZE)
        for item, row in zip(sampling, logits):
            rows[item.request_id][item.start_position + item.num_tokens - 1] = row
    results = []
    for rid, prompt in zip(ids, prompts):
        positions = range(len(prompt) - 1, len(prompt) - 1 + max_tokens)
        results.append((tokens[rid], torch.stack([rows[rid][p] for p in positions])))
    return results, recorder.trace


@torch.no_grad()
def hf_logits(hf, prompt, generated):
    """HF's logits, from one full forward over the prompt and the generated tokens, at the
    positions the engine produced logits for."""
    ids = prompt + generated[:-1]
    return hf(torch.tensor([ids])).logits[0, len(prompt) - 1:].float()


def assert_logits_close(ours, reference):
    # Both sides are float32, so only summation order differs (fused q/k/v and gate/up
    # matmuls, paged attention vs one dense softmax, another rope formula): errors of a few
    # float32 ulps of the logit scale, ~1e-6 relative. 1e-4 of the scale leaves room for
    # that and still fails on any real loading bug (a dropped bias, a swapped norm, a
    # wrong rope frequency), which moves logits by a sizeable fraction of the scale.
    scale = reference.abs().max().item()
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-4 * scale)


# ---- fixtures --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_model():
    """variant -> the transformers model (built once per module)."""
    models = {}

    def get(variant):
        if variant not in models:
            models[variant] = build_hf_model(variant)
        return models[variant]
    return get


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, hf_model):
    """(variant, weight format) -> a folder transformers wrote (written once per module)."""
    folders = {}

    def get(variant, weight_format="safetensors"):
        key = (variant, weight_format)
        if key not in folders:
            folder = tmp_path_factory.mktemp(f"{variant}-{weight_format}")
            folders[key] = save(hf_model(variant), folder, weight_format)
        return folders[key]
    return get


# ---- the checkpoints are what they claim -----------------------------------------------

def test_llama3_config_json_carries_the_llama3_rope_scaling(checkpoint):
    raw = json.loads((checkpoint("llama3") / "config.json").read_text())
    # transformers 5 writes "rope_parameters"; transformers 4 wrote "rope_scaling"
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    assert {k: rope[k] for k in LLAMA3_ROPE_SCALING} == LLAMA3_ROPE_SCALING


def test_qwen2_checkpoint_has_nonzero_qkv_biases(checkpoint):
    weights = load_file(checkpoint("qwen2") / "model.safetensors")
    for part in ("q", "k", "v"):
        assert weights[f"model.layers.0.self_attn.{part}_proj.bias"].abs().min() > 0


@pytest.mark.parametrize("weight_format, expected_files", [
    ("safetensors", ["model.safetensors"]),
    ("sharded_safetensors", ["model.safetensors.index.json", "model-00001-of-*.safetensors",
                             "model-00002-of-*.safetensors"]),
    ("bin", ["pytorch_model.bin"]),
    ("sharded_bin", ["pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin",
                     "pytorch_model-00002-of-00002.bin"]),
])
def test_checkpoint_is_written_in_the_weight_format(checkpoint, weight_format, expected_files):
    folder = checkpoint("llama2", weight_format)
    for pattern in expected_files:
        assert list(folder.glob(pattern)), f"no {pattern} in {sorted(p.name for p in folder.iterdir())}"
    other = "*.bin" if "safetensors" in weight_format else "*.safetensors"
    assert not list(folder.glob(other))


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_config_matches_the_hf_config(checkpoint, hf_model, variant):
    config, hf = load_config(checkpoint(variant)), hf_model(variant)
    hf_attention = hf.model.layers[0].self_attn
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.config.num_attention_heads, hf.config.num_key_value_heads, hf_attention.head_dim)
    assert config.rope_theta == hf.config.rope_parameters["rope_theta"]
    assert config.rope_scaling == (LLAMA3_ROPE_SCALING_VALUES if variant == "llama3" else None)
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.attention_bias == (variant == "qwen2")


# ---- logits parity with transformers ---------------------------------------------------

@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_hf_at_every_step(checkpoint, hf_model, variant, weight_format):
    # 37 prompt tokens + 12 decodes cross two block boundaries (block_size 16) and reach
    # positions where llama3's scaled frequencies differ from the unscaled ones
    prompt = random_prompt(37, seed=1)
    [(tokens, logits)], _ = run_engine(engine_for(checkpoint(variant, weight_format)), [prompt])
    assert logits.shape == (MAX_TOKENS, VOCAB_SIZE)
    assert tokens == logits.argmax(-1).tolist()      # greedy picks the argmax of each row
    assert_logits_close(logits, hf_logits(hf_model(variant), prompt, tokens))


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_match_hf_generate(checkpoint, hf_model, variant):
    prompt = random_prompt(29, seed=2)
    [(tokens, _)], _ = run_engine(engine_for(checkpoint(variant)), [prompt])
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # eos_token_id=None: HF must not stop early, as the engine is told by ignore_eos
        out = hf_model(variant).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    assert tokens == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("max_num_batched_tokens", [
    256,   # both prompts prefill in the first step, then decode side by side
    24,    # chunked prefill: the long prompt's chunks ride along with the short one's decodes
])
@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_prompts_give_the_same_logits_as_each_alone(checkpoint, hf_model, variant,
                                                            max_num_batched_tokens):
    folder, prompts = checkpoint(variant), [random_prompt(23, seed=3), random_prompt(50, seed=4)]
    together, trace = run_engine(engine_for(folder, max_num_batched_tokens), prompts)
    assert any(len({item.request_id for item in step.scheduled}) == 2 for step in trace.steps), \
        "the two requests never shared a step"
    chunked = any(item.kind == "prefill" and item.start_position > 0
                  for step in trace.steps for item in step.scheduled)
    assert chunked == (max_num_batched_tokens < len(prompts[1]))
    for prompt, (tokens, logits) in zip(prompts, together):
        [(alone_tokens, alone_logits)], _ = run_engine(engine_for(folder), [prompt])
        assert tokens == alone_tokens
        assert_logits_close(logits, alone_logits)
        assert_logits_close(logits, hf_logits(hf_model(variant), prompt, tokens))


def test_llama3_rope_scaling_changes_logits_at_the_positions_tested(hf_model):
    """Guards the parity tests: were the scaling a no-op at these positions, a loader that
    ignored it would pass them."""
    scaled = hf_model("llama3")
    config = copy.deepcopy(scaled.config)
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    unscaled = scaled.__class__(config).eval()
    unscaled.load_state_dict(scaled.state_dict())
    prompt = random_prompt(37, seed=1)
    with torch.no_grad():
        a, b = scaled(torch.tensor([prompt])).logits[0], unscaled(torch.tensor([prompt])).logits[0]
    assert (a - b).abs().max() > 100 * 1e-4 * a.abs().max()


def test_transformers4_config_layout_loads_the_same(checkpoint, hf_model, tmp_path):
    """Hub checkpoints written by transformers 4 (e.g. Llama-3.1/3.2) keep rope_theta and
    rope_scaling at the top level of config.json instead of under rope_parameters."""
    folder = tmp_path / "llama3-transformers4"
    shutil.copytree(checkpoint("llama3"), folder)
    raw = json.loads((folder / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(raw))
    prompt = random_prompt(37, seed=1)
    [(tokens, logits)], _ = run_engine(engine_for(folder), [prompt])
    assert_logits_close(logits, hf_logits(hf_model("llama3"), prompt, tokens))


def test_model_config_reads_both_rope_layouts():
    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=2)
    new = ModelConfig.from_hf(   # transformers 5
        {**base, "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE_SCALING}})
    old = ModelConfig.from_hf(   # transformers 4
        {**base, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE_SCALING})
    assert new == old
    assert new.rope_theta == 500000.0 and new.rope_scaling == LLAMA3_ROPE_SCALING_VALUES


# ---- broken inputs raise ValueError that says what is wrong ----------------------------

def copy_checkpoint(checkpoint, tmp_path, variant="llama2"):
    folder = tmp_path / "model"
    shutil.copytree(checkpoint(variant), folder)
    return folder


def edit_config(folder, **changes):
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def edit_weights(folder, edit):
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors")


def test_unsupported_architecture_is_rejected(checkpoint, tmp_path):
    folder = copy_checkpoint(checkpoint, tmp_path)
    edit_config(folder, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2'"):
        engine_for(folder)


def test_folder_without_config_json_is_rejected(checkpoint, tmp_path):
    folder = copy_checkpoint(checkpoint, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        engine_for(folder)


def test_config_json_that_is_not_json_is_rejected(checkpoint, tmp_path):
    folder = copy_checkpoint(checkpoint, tmp_path)
    (folder / "config.json").write_text("{'model_type': 'llama',")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        engine_for(folder)


def test_folder_without_weight_files_is_rejected(checkpoint, tmp_path):
    folder = copy_checkpoint(checkpoint, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors or \*\.bin weight files"):
        engine_for(folder)


def test_checkpoint_missing_a_tensor_is_rejected(checkpoint, tmp_path):
    folder = copy_checkpoint(checkpoint, tmp_path)
    edit_weights(folder, lambda w: w.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight' is missing"):
        engine_for(folder)


def test_untied_checkpoint_missing_lm_head_is_rejected(checkpoint, tmp_path):
    # tie_word_embeddings is false, so the output projection is its own tensor: using the
    # embedding instead would run, and silently produce a different model
    folder = copy_checkpoint(checkpoint, tmp_path)
    edit_weights(folder, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"'lm_head\.weight' is missing"):
        engine_for(folder)


def test_tensor_with_the_wrong_shape_is_rejected(checkpoint, tmp_path):
    folder = copy_checkpoint(checkpoint, tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"   # llama2: 4 kv heads x 16 = 64 rows
    edit_weights(folder, lambda w: w.update({name: torch.zeros(32, 64)}))
    with pytest.raises(ValueError, match=r"k_proj\.weight' has shape \(32, 64\), config expects \(64, 64\)"):
        engine_for(folder)


def test_nonexistent_path_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        engine_for(tmp_path / "no-such-model")


def test_file_that_is_not_gguf_is_rejected(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a .gguf file"):
        engine_for(path)


def test_corrupt_gguf_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMLAB_CACHE", str(tmp_path / "cache"))   # never touch ~/.cache
    path = tmp_path / "x.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        engine_for(path)
    assert not list((tmp_path / "cache").glob("x-*")), "a failed conversion left a cached folder"


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64}},              # transformers 5
    {"rope_parameters": None, "rope_theta": 10000.0,
     "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},  # 4
])
def test_unsupported_rope_scaling_is_rejected(checkpoint, tmp_path, rope):
    folder = copy_checkpoint(checkpoint, tmp_path)
    edit_config(folder, **rope)
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        engine_for(folder)


# ---- GGUF: undoing llama.cpp's Q/K row permutation -------------------------------------

def llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`, applied to Q and K weights."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HEAD_LAYOUTS = [(1, 2), (1, 8), (2, 4), (3, 16), (4, 64), (9, 64), (8, 128)]   # (heads, head_dim)


@pytest.mark.parametrize("n_head, head_dim", HEAD_LAYOUTS)
def test_unpermute_qk_inverts_llama_cpp_permute(n_head, head_dim):
    w = np.random.default_rng(n_head).standard_normal((n_head * head_dim, 5)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    if head_dim >= 4:   # with 2 dims per head the permutation is the identity
        assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_qk(permuted, n_head), w)
    assert np.array_equal(llama_cpp_permute(unpermute_qk(w, n_head), n_head), w)


@pytest.mark.parametrize("n_head, head_dim", HEAD_LAYOUTS)
def test_unpermuted_weights_with_hf_rope_compute_what_llama_cpp_computes(n_head, head_dim):
    """Why the permutation exists: llama.cpp rotates adjacent pairs (2i, 2i+1), HF rotates
    (i, i + D/2), both by position * theta^(-2i/D). GGUF weights with llama.cpp's rope give
    the HF weights with HF's rope, in permuted row order; un-permuting restores HF's."""
    rng = np.random.default_rng(head_dim)
    w_hf = rng.standard_normal((n_head * head_dim, 5))
    x, position = rng.standard_normal(5), 7
    angles = position * 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)   # [D/2]
    cos, sin = np.cos(angles), np.sin(angles)

    def rope_hf(q):   # q [H, D]
        first, second = q[:, :head_dim // 2], q[:, head_dim // 2:]
        return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=1)

    def rope_llama_cpp(q):
        even, odd = q[:, 0::2], q[:, 1::2]
        out = np.empty_like(q)
        out[:, 0::2], out[:, 1::2] = even * cos - odd * sin, odd * cos + even * sin
        return out

    w_gguf = llama_cpp_permute(w_hf, n_head)
    llama_cpp_q = rope_llama_cpp((w_gguf @ x).reshape(n_head, head_dim)).reshape(-1)
    hf_q = rope_hf((unpermute_qk(w_gguf, n_head) @ x).reshape(n_head, head_dim)).reshape(-1)
    np.testing.assert_allclose(unpermute_qk(llama_cpp_q, n_head), hf_q, rtol=1e-12, atol=1e-12)


@pytest.mark.slow     # transformers reads and converts the whole GGUF file (~20 s)
def test_hf_reference_loads_without_progress_bars_and_leaves_the_setting_alone(capsys):
    import transformers
    from transformers import modeling_gguf_pytorch_utils

    from llmlab.model.loader import hf_reference

    gguf_bar = modeling_gguf_pytorch_utils.tqdm
    model = hf_reference(dtype=torch.float32)
    assert "%|" not in capsys.readouterr().err            # no tqdm bar drawn
    assert not model.training and model.config.num_hidden_layers == 30
    assert transformers.utils.logging.is_progress_bar_enabled() and modeling_gguf_pytorch_utils.tqdm is gguf_bar


def test_a_gguf_is_converted_once_per_contents_not_per_path(tmp_path):
    """Each fresh virtual environment holds the embedded file at a new path: the converted
    folder's key is the file's contents, so a clean clone reuses the folder a previous one made."""
    from llmlab.model.loader import _content_key

    data = bytes(range(256)) * 20_000              # 5 MB: both ends sampled
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(data)
    assert _content_key(a) == _content_key(b)
    changed = bytearray(data)
    changed[-1] ^= 1                               # the last byte: tensor data ends a file
    b.write_bytes(changed)
    assert _content_key(a) != _content_key(b)
    b.write_bytes(data[:-1])                        # a truncated copy
    assert _content_key(a) != _content_key(b)
