"""Exercise 15, the LLaMA decoder layer: each part against HF transformers' own
LlamaDecoderLayer holding the embedded model's layer 3 (built here from one layer's weights:
no whole-model load), on the engine's batch layout (prefill chunks then decodes, a paged
cache); then llmlab's own layer on a random model with q/k/v biases, and the real engine with
the student's layer. Every check fails with the case that broke, what differs and what to check."""
import dataclasses
import math

import pytest
import torch

import llmlab
from diagnose import fail
from llmlab.config import ModelConfig
from llmlab.model.llama import ForwardBatch, LlamaModel

EXERCISE = "ex15_decoder_layer"
LAYER = 3
BLOCK_SIZE = 4      # small blocks: every sequence below ends in a partial block
# float32 through a layer of hidden 576, summed in other orders than HF's (fused projections,
# paged attention): ~1e-6 of the largest value (the mlp's reach ~500); 1e-5 of it leaves room
# and still catches any real mistake
RELATIVE_TOL = 1e-5


def expect(ok, case: str, what: str, hint: str) -> None:
    if not ok:
        fail(case, [what, f"-> {hint}"])


def close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a.float(), b.float(), atol=RELATIVE_TOL * b.abs().max().item(), rtol=1e-4))


def differ(actual, expected) -> str:
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape:
        return f"got {getattr(actual, 'shape', type(actual).__name__)}, expected shape {tuple(expected.shape)}"
    worst = (actual.float() - expected.float()).abs().nan_to_num(float("inf")).max().item()
    return f"differs from HF by up to {worst:.3g} (values up to {expected.abs().max().item():.3g})"


# ---- the reference: HF transformers' layer holding llmlab's weights -------------------------------
def hf_layer(config: ModelConfig, weights):
    """HF's LlamaDecoderLayer (eager attention) with `weights` (a LayerWeights), and its rotary embedding."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hf_config = LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attention_bias=config.attention_bias, num_hidden_layers=1, vocab_size=config.vocab_size)
    hf_config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(hf_config, layer_idx=0).eval()
    q, k, v = weights.qkv.split([config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim,
                                 config.num_kv_heads * config.head_dim])
    gate, up = weights.gate_up.chunk(2)
    state = {"input_layernorm.weight": weights.input_norm, "post_attention_layernorm.weight": weights.post_norm,
             "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
             "self_attn.o_proj.weight": weights.o_proj, "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
             "mlp.down_proj.weight": weights.down}
    if weights.qkv_bias is not None:
        for name, b in zip("qkv", weights.qkv_bias.split(
                [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2)):
            state[f"self_attn.{name}_proj.bias"] = b
    layer.load_state_dict({n: t.detach().clone().float() for n, t in state.items()})
    return layer, LlamaRotaryEmbedding(hf_config)


class Reference:
    """What HF computes for whole sequences: the layer's output, the attention block's output
    (after o_proj), the rotated keys and the values, at every position."""

    def __init__(self, layer, rotary, x):        # x [L, hidden]: one sequence's layer input
        L = x.shape[0]
        positions = torch.arange(L)[None]
        cos_sin = rotary(x[None], positions)
        mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
        attn = layer.self_attn
        with torch.inference_mode():
            normed = layer.input_layernorm(x[None])
            self.attn = attn(normed, attention_mask=mask, position_embeddings=cos_sin)[0][0]
            self.out = layer(x[None], attention_mask=mask, position_embeddings=cos_sin)[0]
            if self.out.dim() == 3:
                self.out = self.out[0]
            self.h = x + self.attn
            shape = (L, -1, attn.head_dim)
            k = attn.k_proj(normed)[0].view(shape)
            self.v = attn.v_proj(normed)[0].view(shape)
            self.k_before_rope = k
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
            q = attn.q_proj(normed)[0].view(L, -1, attn.head_dim)
            _, k_rot = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], *cos_sin)
            self.k = k_rot[0].transpose(0, 1)
            _, v_rot = apply_rotary_pos_emb(q.transpose(0, 1)[None], self.v.transpose(0, 1)[None], *cos_sin)
            self.v_rotated = v_rot[0].transpose(0, 1)     # a mistake's values: rope is for q and k only


def layer_setup(llm):
    """(model config, layer weights, HF layer, its rotary embedding) for the embedded model's layer 3."""
    model = llm.engine.model
    layer, rotary = hf_layer(model.config, model.layers[LAYER])
    return model.config, model.layers[LAYER], layer, rotary


@pytest.fixture(scope="module")
def setup(llm):
    return layer_setup(llm)


def layer_input(config, length: int, seed: int):
    """A layer's input of `length` tokens at the scale of a real residual stream (~1)."""
    return torch.randn(length, config.hidden_size, generator=torch.Generator().manual_seed(seed))


# ---- the engine's batch layout, by hand ------------------------------------------------------------
class PagedSequences:
    """A paged cache and sequences in shuffled blocks; `batch` lays out one step: prefill
    chunks (sequence, first position, count) then decodes (sequence) at their next position."""

    def __init__(self, config, lengths: list[int], num_blocks: int = 40, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        per_seq = [math.ceil(n / BLOCK_SIZE) for n in lengths]
        self.tables = [[order.pop() for _ in range(n)] for n in per_seq]
        self.max_blocks = max(per_seq)
        shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)
        self.computed = [0] * len(lengths)

    def slot(self, seq: int, position: int) -> int:
        return self.tables[seq][position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    def table_rows(self, seqs):
        return torch.tensor([self.tables[s] + [0] * (self.max_blocks - len(self.tables[s])) for s in seqs],
                            dtype=torch.int32).reshape(len(seqs), self.max_blocks)

    def batch(self, prefills: list[tuple[int, int]], decodes: list[int]):
        """(positions, ForwardBatch, [(seq, positions)]) of one step; advances `computed`."""
        rows, cu = [], [0]
        for seq, count in prefills:
            first = self.computed[seq]
            rows.append((seq, list(range(first, first + count))))
            cu.append(cu[-1] + count)
        for seq in decodes:
            rows.append((seq, [self.computed[seq]]))
        positions = [p for _, ps in rows for p in ps]
        slots = [self.slot(seq, p) for seq, ps in rows for p in ps]
        for seq, ps in rows:
            self.computed[seq] = ps[-1] + 1
        prefill_seqs = [s for s, _ in prefills]
        batch = ForwardBatch(
            num_prefill_tokens=cu[-1], slot_mapping=torch.tensor(slots, dtype=torch.int64),
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            prefill_seq_lens=torch.tensor([self.computed[s] for s in prefill_seqs], dtype=torch.int32),
            prefill_block_tables=self.table_rows(prefill_seqs),
            decode_seq_lens=torch.tensor([self.computed[s] for s in decodes], dtype=torch.int32),
            decode_block_tables=self.table_rows(decodes),
            logits_indices=torch.tensor([len(positions) - 1]), backend="torch")
        return torch.tensor(positions, dtype=torch.int64), batch, rows

    def cached(self, cache, seq: int, length: int):
        return torch.stack([cache.view(-1, *cache.shape[2:])[self.slot(seq, p)] for p in range(length)])


def run_attention(module_layer, seqs: PagedSequences, inputs, normed, prefills, decodes):
    positions, batch, rows = seqs.batch(prefills, decodes)
    x = torch.cat([normed[seq][ps] for seq, ps in rows])
    with torch.inference_mode():
        out = module_layer.attention(x, positions, batch, seqs.k_cache, seqs.v_cache)
    return out, rows


def split_rows(out, rows):
    """The output rows of each (seq, positions) entry of a step, in order."""
    parts, at = [], 0
    for seq, ps in rows:
        parts.append((seq, ps, out[at:at + len(ps)]))
        at += len(ps)
    return parts


# ---- the cases ---------------------------------------------------------------------------------------
def test_mlp(ex, setup):
    config, weights, hf, _ = setup
    case = "mlp of 5 rows"
    x = layer_input(config, 5, seed=1)
    with torch.inference_mode():
        got, expected = ex.DecoderLayer(config, weights).mlp(x, "torch"), hf.mlp(x)
        gate, up = (x @ weights.gate_up.T).chunk(2, dim=-1)
        swapped = (torch.nn.functional.silu(up) * gate) @ weights.down.T
    if close(got, swapped):
        fail(case, ["your mlp computes silu(up) * gate",
                    "-> weights.gate_up holds the gate rows first, then the up rows: silu_mul(linear(x, gate_up)) is "
                    "silu(gate) * up"])
    expect(close(got, expected), case, f"the mlp's output {differ(got, expected)}",
           "mlp(x) = linear(silu_mul(linear(x, weights.gate_up)), weights.down): silu of the gate half times the up "
           "half, then the down projection")


def check_cache(seqs, ref, seq, length, case):
    k, v = seqs.cached(seqs.k_cache, seq, length), seqs.cached(seqs.v_cache, seq, length)
    if not k.abs().sum() and not v.abs().sum():
        fail(case, ["the cache slots of the batch's tokens are still empty",
                    "-> store k and v into k_cache and v_cache at batch.slot_mapping (kernels.store_kv), before "
                    "attending: the attention kernels read every key from the cache"])
    if close(k, ref.k_before_rope[:length]):
        fail(case, ["the cache holds the keys before rope",
                    "-> store the keys after rope: rope(q, k, positions, ...) first, then store_kv of the rotated k "
                    "(later tokens read these keys and need them rotated)"])
    if close(v, ref.v_rotated[:length]):
        fail(case, ["the cache holds the values rotated by rope",
                    "-> rope turns q and k only (the positions go into the scores q . k); v is stored and attended as "
                    "linear(x, weights.qkv) gives it"])
    expect(close(v, ref.v[:length]), case, f"the values in the cache {differ(v, ref.v[:length])}",
           "v is the last Hkv * head_dim columns of linear(x, weights.qkv): split the columns as "
           "[H D | Hkv D | Hkv D]")
    expect(close(k, ref.k[:length]), case, f"the keys in the cache {differ(k, ref.k[:length])}",
           "k is the middle Hkv * head_dim columns of linear(x, weights.qkv), rotated by rope at `positions`")


def test_attention_of_one_prompt(ex, setup):
    config, weights, hf, rotary = setup
    case = "attention over one prompt of 13 tokens (prefill only, block_size 4)"
    x = layer_input(config, 13, seed=2)
    ref = Reference(hf, rotary, x)
    with torch.inference_mode():
        normed = [hf.input_layernorm(x)]
    seqs = PagedSequences(config, [13])
    out, _ = run_attention(ex.DecoderLayer(config, weights), seqs, [x], normed, [(0, 13)], [])
    check_cache(seqs, ref, 0, 13, case)
    if close(out, ref.attn):
        return
    first_ok = close(out[:1], ref.attn[:1]) if isinstance(out, torch.Tensor) and out.shape == ref.attn.shape else False
    fail(case, [f"the attention block's output {differ(out, ref.attn)}",
                "-> position 0 matches (rope turns it by 0, and it sees only its own key): check rope on q (the same "
                "positions as k) and the scale 1/sqrt(head_dim)" if first_ok else
                "-> check the split of q (the first H * head_dim columns), the attention's arguments "
                "(prefill_block_tables, prefill_cu_seqlens_q, prefill_seq_lens) and o_proj on the [T, H * D] output"])


def test_attention_chunks_and_decodes(ex, setup):
    """A prompt chunked over two steps beside another prompt that then decodes, then a step
    of decodes only: the engine's mixed batches."""
    config, weights, hf, rotary = setup
    lengths = [18, 23]
    xs = [layer_input(config, n, seed=3 + i) for i, n in enumerate(lengths)]
    refs = [Reference(hf, rotary, x) for x in xs]
    with torch.inference_mode():
        normed = [hf.input_layernorm(x) for x in xs]
    seqs = PagedSequences(config, lengths)
    layer = ex.DecoderLayer(config, weights)
    steps = [("a prefill of both prompts (10 and 21 tokens)", [(0, 10), (1, 21)], []),
             ("prompt 0's second chunk (8 tokens) and a decode of prompt 1", [(0, 8)], [1]),
             ("a decode-only step (no prefill token)", [], [1])]
    for name, prefills, decodes in steps:
        case = f"step {name}"
        out, rows = run_attention(layer, seqs, xs, normed, prefills, decodes)
        expect(isinstance(out, torch.Tensor) and out.shape == (sum(len(ps) for _, ps in rows), config.hidden_size),
               case, f"the output is {getattr(out, 'shape', out)!r}",
               "one output row per token of the batch, [T, hidden]: prefill rows, then decode rows")
        bad = []
        for i, (seq, ps, got) in enumerate(split_rows(out, rows)):
            if not close(got, refs[seq].attn[ps]):
                bad.append(("prefill" if i < len(prefills) else "decode", seq, ps))
        if not bad:
            continue
        kinds = {kind for kind, _, _ in bad}
        described = ", ".join(f"{kind} of prompt {seq} (positions {ps[0]}..{ps[-1]})" for kind, seq, ps in bad)
        num_decodes = len(decodes)
        expected_out = torch.cat([refs[seq].attn[ps] for seq, ps in rows])
        decodes_first = torch.cat([out[num_decodes:], out[:num_decodes]]) if prefills and decodes else None
        if decodes_first is not None and close(decodes_first, expected_out):
            hint = ("the output rows are the decodes' then the prefill's: the batch holds the prefill chunks first "
                    "(rows [:num_prefill_tokens]), then the decodes, and the output keeps that order: "
                    "torch.cat([prefill_attention(...), decode_attention(...)])")
        elif kinds == {"decode"}:
            hint = ("the rows after batch.num_prefill_tokens are decodes, one per sequence: decode_attention of "
                    "q[num_prefill_tokens:] with decode_block_tables, decode_seq_lens and batch.num_splits; a step "
                    "with no prefill token calls decode_attention only")
        elif kinds == {"prefill"}:
            hint = ("the first batch.num_prefill_tokens rows are prefill chunks: prefill_attention of "
                    "q[:num_prefill_tokens] with prefill_cu_seqlens_q and prefill_seq_lens (the context after this "
                    "step: a later chunk attends to the earlier ones in the cache)")
        else:
            hint = "check which rows go to which attention (num_prefill_tokens) and that k, v are stored first"
        fail(case, [f"differ from HF: {described}", f"-> {hint}"])


def test_layer_first(ex, setup):
    """The first layer (residual None): hidden + residual is the layer's output."""
    config, weights, hf, rotary = setup
    case = "the whole layer on a prompt of 9 tokens, residual None (the first layer)"
    x = layer_input(config, 9, seed=5)
    ref = Reference(hf, rotary, x)
    seqs = PagedSequences(config, [9])
    positions, batch, _ = seqs.batch([(0, 9)], [])
    with torch.inference_mode():
        result = ex.DecoderLayer(config, weights)(x, None, positions, batch, seqs.k_cache, seqs.v_cache)
    expect(isinstance(result, tuple) and len(result) == 2, case, f"the layer returned {type(result).__name__}",
           "return (hidden, residual): the mlp's output and the residual stream, kept apart")
    hidden, residual = result
    expect(close(residual, ref.h), case, f"the residual returned {differ(residual, ref.h)}",
           "the residual after the layer is x + the attention block's output: rms_norm(attn, post_norm, eps, "
           "residual) returns it as its second value (with residual None, the input x is the residual)")
    expect(close(hidden + residual, ref.out), case, f"hidden + residual {differ(hidden + residual, ref.out)}",
           "the mlp takes the post-attention norm of x + attention (weights.post_norm), and its output is the "
           "hidden returned")


def test_layer_after_another(ex, setup):
    """A later layer: its input arrives as (hidden, residual), the stream being their sum."""
    config, weights, hf, rotary = setup
    case = "the whole layer on a prompt of 9 tokens, given (hidden, residual) of a previous layer"
    x = layer_input(config, 9, seed=6)
    ref = Reference(hf, rotary, x)
    residual_in = layer_input(config, 9, seed=7)
    seqs = PagedSequences(config, [9])
    positions, batch, _ = seqs.batch([(0, 9)], [])
    with torch.inference_mode():
        hidden, residual = ex.DecoderLayer(config, weights)(x - residual_in, residual_in, positions, batch,
                                                            seqs.k_cache, seqs.v_cache)
    expect(close(hidden + residual, ref.out), case, f"hidden + residual {differ(hidden + residual, ref.out)}",
           "the layer's input is hidden + residual: the input norm adds them first, rms_norm(hidden, input_norm, "
           "eps, residual), and carries their sum on as the residual")


def test_agrees_with_llmlab_on_a_random_model(ex):
    """llmlab's own layers and yours, on a random 2-layer model with q/k/v biases (Qwen2's
    layout) and 4 query heads per kv head: the same logits for a chunked prompt and decodes."""
    case = "a random model with qkv biases and 8 heads over 2 kv heads, prefill + decode steps"
    config = ModelConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=8, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         attention_bias=True)
    model = LlamaModel.random(config, torch.float32, "cpu", seed=0)
    plugged = model.with_decoder_layer(ex.DecoderLayer)
    results = []
    for runner in (model, plugged):
        seqs = PagedSequences(config, [14, 7])
        cache = torch.zeros(config.num_layers, 2, *seqs.k_cache.shape)
        ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(0))
        outs = []
        for prefills, decodes in [([(0, 6), (1, 6)], []), ([(0, 8)], [1])]:
            positions, batch, rows = seqs.batch(prefills, decodes)
            batch = dataclasses.replace(batch, logits_indices=torch.arange(len(positions)))
            outs.append(runner.forward((ids[:len(positions)] + positions) % 128, positions, batch, cache))
        results.append(torch.cat(outs))
    expect(close(results[1], results[0]), case, f"the logits {differ(results[1], results[0])} (llmlab's own layers)",
           "pass weights.qkv_bias to the qkv linear (None for LLaMA, set for Qwen2), and keep the head counts "
           "apart: config.num_heads for q, config.num_kv_heads for k and v")


@pytest.mark.slow   # the 30-layer model, two engines
def test_end_to_end(ex, llm):
    """The engine with your layer in each of the 30 layers: the default engine's greedy text,
    with the prompts' prefill chunked beside decodes."""
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived"]
    greedy = llmlab.SamplingParams(max_tokens=5, temperature=0.0)

    def run(**plugged):
        config = llmlab.EngineConfig(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=64,
                                     max_num_batched_tokens=16, async_scheduling=False)
        engine = llmlab.LLMEngine(config, model=llm.engine.model, tokenizer=llm.tokenizer, **plugged)
        return [o.text for o in llmlab.LLM.from_engine(engine).generate(prompts, greedy)]

    expected, actual = run(), run(decoder_layer=ex.DecoderLayer)
    expect(actual == expected, "the engine with your DecoderLayer in every layer", f"texts {actual!r}, expected {expected!r}",
           "the cases above name the part; if they pass, check what differs in the engine's batches: several "
           "prefill chunks and decodes in one step, blocks of 16")
