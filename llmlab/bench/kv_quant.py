"""KV-cache quantization accuracy: perplexity over a fixed 2,255-token text, mean KL of the
next-token distributions and top-1 agreement against the full-precision cache, for the
engine's int8 (and fp8) caches and for the scale granularities they were chosen over;
then greedy 32-token continuations of test prompts, int8 cache against full precision.

    llmlab bench kv-quant --out kv_quant.json        # the embedded model, CPU: ~2 minutes

Every position's next-token distribution comes from chunked prefill (256 tokens a chunk,
each attending to the chunks before it through the cache), so every query reads K/V back
from the cache it is testing. The engine's caches ("int8", "fp8_e4m3") run its own
kernels; the other granularities are simulated: a store_kv override quantizes and
dequantizes in torch and writes the result into a full-precision cache.
"""
from __future__ import annotations

import math

import torch

from llmlab import kernels
from llmlab.bench.common import write_json
from llmlab.kernels import reference

CHUNK = 256            # prefill chunk (a multiple of the block size: blocks never straddle chunks)
GREEDY_TOKENS = 32
PLAIN_PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a small village by the sea,",
                 "The three primary colors are", "def fibonacci(n):", "Water boils at a temperature of",
                 "The history of the printing press begins", "A good recipe for pancakes needs"]


# ----------------------------------------------------------------------------- granularities

def per_token_head(x, dtype=torch.int8):
    """The engine's scheme: one scale per token per kv head (x [T, Hkv, D])."""
    return reference.dequantize(*reference.quantize(x, dtype))


def per_channel_per_block(x, block_size=16, dtype=torch.int8):
    """KIVI's key scheme: one scale per channel per kv head over each block of tokens.
    Offline only: it needs a whole block's keys before the first can be stored."""
    qmax = reference.QUANT_MAX[dtype]
    out = torch.empty_like(x, dtype=torch.float32)
    for start in range(0, x.shape[0], block_size):
        block = x[start:start + block_size].float()
        scale = block.abs().amax(0).clamp(min=reference.QUANT_EPS) / qmax   # [Hkv, D]
        out[start:start + block_size] = torch.floor(block / scale + 0.5).clamp(-qmax, qmax) * scale
    return out


def per_tensor(x, dtype=torch.int8):
    """One scale for all of a layer's new keys (or values): vLLM's per-tensor granularity,
    its scale here taken from the data (calibration would fix it beforehand)."""
    return reference.dequantize(*reference.quantize(x.reshape(1, -1), dtype)).view(x.shape)


def fp8_unscaled(x):
    """vLLM's fp8 cache without calibration: scale 1, every value cast to e4m3."""
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()


def fp8_per_token_head(x):
    return per_token_head(x, torch.float8_e4m3fn)


def bf16_rounded(x):
    """A bfloat16 cache (what the GPU default stores): the yardstick for 8 bits."""
    return x.to(torch.bfloat16).float()


def hadamard(n):
    """The orthonormal n x n Walsh-Hadamard matrix (n a power of two), Sylvester's construction."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def rotated_per_token_head(x):
    """Per token-head int8 after rotating each row by a Hadamard matrix (QuaRot): the rotation
    spreads outlier channels over all of them. Round-trip only: attention would have to
    rotate q (and the output) the same way."""
    h = hadamard(x.shape[-1]).to(x.device)
    return per_token_head(x.float() @ h) @ h.T


# name -> (key function, value function) of the simulated schemes
SIMULATED = {
    "bfloat16 (rounded, the GPU default)": (bf16_rounded, bf16_rounded),
    "int8, K per channel per block, V per token-head (KIVI-style)": (per_channel_per_block, per_token_head),
    "int8, per tensor (one scale per layer and step)": (per_tensor, per_tensor),
    "fp8 e4m3, scale 1 (vLLM uncalibrated)": (fp8_unscaled, fp8_unscaled),
}


def simulated_store_kv(key_fn, value_fn):
    """A store_kv for a full-precision cache that stores what `key_fn`/`value_fn` make of K/V."""
    def store_kv(k, v, k_cache, v_cache, slot_mapping):
        reference.store_kv(key_fn(k).to(k.dtype), value_fn(v).to(v.dtype), k_cache, v_cache, slot_mapping)
    return store_kv


# ----------------------------------------------------------------------------- per-position logits

def _request(token_ids, block_size):
    from llmlab.request import Request
    from llmlab.sampling import SamplingParams

    request = Request("kv-quant", None, list(token_ids), SamplingParams())
    request.block_table = list(range(-(-len(token_ids) // block_size)))
    return request


def new_cache(model, num_tokens, dtype, block_size=16, device=None):
    from llmlab.cache.kv_cache import KVCache

    device = device or model.embed.device
    return KVCache(model.config, -(-num_tokens // block_size), 0, block_size, dtype, device)


def chunk_logprobs(model, token_ids, kv_cache, start, block_size=16, store_kv=None):
    """Log-probabilities [n, vocab] of the token after each of token_ids[start:start + CHUNK],
    with everything before `start` already in kv_cache (one prefill chunk)."""
    from llmlab.engine.batch import prepare
    from llmlab.plan import Plan, ScheduledItem

    device = kv_cache.device.device
    num = min(CHUNK, len(token_ids) - start)
    plan = Plan(prefills=[ScheduledItem(_request(token_ids, block_size), "prefill", num, start)])
    input_ids, positions, batch = prepare(plan, block_size, device)
    batch.logits_indices = torch.arange(num, device=device)   # every position, not only the last
    with kernels.override(**({"store_kv": store_kv} if store_kv else {})):
        logits = model.forward(input_ids, positions, batch, kv_cache.device, kv_cache.device_scales)
    return logits.float().log_softmax(-1)


def variants(model, num_tokens, fp8_supported, only=None, schemes=None):
    """name -> (KVCache, store_kv override or None): the full-precision cache first, then
    every other variant (or those whose names contain one of the strings in `only`), then
    `schemes`, your own: name -> (key function, value function), simulated as SIMULATED's are
    (each function takes rows [T, Hkv, D] and returns what the cache would give back)."""
    dtype = model.embed.dtype
    out = {"full precision (auto)": (new_cache(model, num_tokens, dtype), None),
           "int8, per token-head (engine)": (new_cache(model, num_tokens, torch.int8), None)}
    if fp8_supported:
        out["fp8 e4m3, per token-head (engine)"] = (new_cache(model, num_tokens, torch.float8_e4m3fn), None)
    else:
        out["fp8 e4m3, per token-head (simulated)"] = (new_cache(model, num_tokens, dtype),
                                                        simulated_store_kv(fp8_per_token_head, fp8_per_token_head))
    for name, (key_fn, value_fn) in SIMULATED.items():
        out[name] = (new_cache(model, num_tokens, dtype), simulated_store_kv(key_fn, value_fn))
    first = next(iter(out))
    chosen = {name: run for name, run in out.items()
              if name == first or only is None or any(word in name for word in only)}
    for name, (key_fn, value_fn) in (schemes or {}).items():
        chosen[name] = (new_cache(model, num_tokens, dtype), simulated_store_kv(key_fn, value_fn))
    return chosen


def accuracy(model, token_ids, fp8_supported=False, only=None, progress=False, schemes=None) -> list[dict]:
    """Perplexity, mean KL(full || variant) and top-1 agreement of every variant (`only` and
    your own `schemes`: see variants()), all run chunk by chunk in lockstep (so no variant's
    logits are kept). `progress`: a bar over the prefill chunks of every variant."""
    from tqdm.auto import tqdm

    runs = variants(model, len(token_ids), fp8_supported, only, schemes)
    targets = torch.tensor(token_ids[1:], device=model.embed.device)
    totals = {name: {"nll": 0.0, "kl": 0.0, "top1": 0} for name in runs}
    starts = range(0, len(token_ids) - 1, CHUNK)
    bar = tqdm(total=len(starts) * len(runs), desc="chunks x caches", disable=not progress)
    for start in starts:
        logprobs = {}
        for name, (cache, store) in runs.items():
            logprobs[name] = chunk_logprobs(model, token_ids, cache, start, store_kv=store)
            bar.update()
        num = min(CHUNK, len(token_ids) - 1 - start)   # the last token has no next token
        full = logprobs["full precision (auto)"][:num]
        for name, lp in logprobs.items():
            lp = lp[:num]
            totals[name]["nll"] -= lp.gather(1, targets[start:start + num, None]).sum().item()
            totals[name]["kl"] += (full.exp() * (full - lp)).sum().item()
            totals[name]["top1"] += (lp.argmax(-1) == full.argmax(-1)).sum().item()
    bar.close()
    count = len(token_ids) - 1
    base = math.exp(totals["full precision (auto)"]["nll"] / count)
    rows = []
    for name, t in totals.items():
        ppl = math.exp(t["nll"] / count)
        rows.append({"cache": name, "perplexity": round(ppl, 4), "ppl_change_pct": round(100 * (ppl / base - 1), 3),
                     "mean_kl": float(f"{t['kl'] / count:.3g}"), "top1_agreement_pct": round(100 * t["top1"] / count, 2),
                     "bytes_per_token_per_layer": bytes_per_token(model, runs[name][0].dtype)})
    return rows


def bytes_per_token(model, dtype):
    from llmlab.cache.kv_cache import bytes_per_block

    return bytes_per_block(model.config, 1, dtype) // model.config.num_layers


# ----------------------------------------------------------------------------- round-trip errors

def capture_kv(model, token_ids, progress=False):
    """K (after rope) and V of every layer as the full-precision cache stores them:
    two float32 tensors [num_layers, T, Hkv, D]. `progress`: a bar over the prefill chunks."""
    from tqdm.auto import tqdm

    keys, values = [], []

    def record(k, v, k_cache, v_cache, slot_mapping):
        keys.append(k.float().clone())
        values.append(v.float().clone())
        reference.store_kv(k, v, k_cache, v_cache, slot_mapping)

    cache = new_cache(model, len(token_ids), model.embed.dtype)
    layers = model.config.num_layers
    for start in tqdm(range(0, len(token_ids), CHUNK), desc="prefill chunks", disable=not progress):
        chunk_logprobs(model, token_ids, cache, start, store_kv=record)
    per_layer = lambda xs: torch.stack([torch.cat(xs[i::layers]) for i in range(layers)])  # noqa: E731
    return per_layer(keys), per_layer(values)


def relative_error(x, fn):
    """||fn(x) - x|| / ||x|| of each row: x [L, T, Hkv, D] -> [L, T, Hkv]."""
    approx = torch.stack([fn(layer) for layer in x])
    return (approx - x).norm(dim=-1) / x.norm(dim=-1).clamp(min=1e-12)


ROUND_TRIP = {"int8 per token-head": per_token_head, "int8 per channel per block": per_channel_per_block,
              "int8 per tensor": per_tensor, "int8 per token-head, Hadamard-rotated": rotated_per_token_head,
              "fp8 e4m3 per token-head": fp8_per_token_head,
              "fp8 e4m3 scale 1": fp8_unscaled}


def round_trip_rows(keys, values) -> list[dict]:
    """Mean and worst-layer relative error of K and V under every granularity."""
    rows = []
    for name, fn in ROUND_TRIP.items():
        row = {"scheme": name}
        for label, x in (("k", keys), ("v", values)):
            error = relative_error(x, fn)
            row[f"{label}_rel_err_mean"] = float(f"{error.mean().item():.3g}")
            row[f"{label}_rel_err_worst_layer"] = float(f"{error.mean(dim=(1, 2)).max().item():.3g}")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- greedy agreement

def greedy_prompts(tokenizer) -> list:
    """The CLI demo's chat prompts (through the chat template) and some plain-text openings."""
    from llmlab.cli import DEMO_PROMPTS

    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in DEMO_PROMPTS]
    return chats + PLAIN_PROMPTS


def greedy_agreement(llm, prompts, kv_cache_dtype="int8", **engine_args) -> dict:
    """Greedy continuations (up to 32 tokens) with the full-precision cache and with
    kv_cache_dtype, the same model weights: how many are identical, and where they part."""
    from llmlab import EngineConfig, LLMEngine, LLM, SamplingParams

    base = llm.engine.config
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0)
    outputs = {}
    for cache in ("auto", kv_cache_dtype):
        config = EngineConfig(device=base.device, dtype=base.dtype, backend=base.backend,
                              kv_cache_dtype=cache, **engine_args)
        engine = LLMEngine(config, model=llm.engine.model, tokenizer=llm.tokenizer)
        outputs[cache] = [o.token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    first_difference = []
    for a, b in zip(outputs["auto"], outputs[kv_cache_dtype]):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first_difference.append(None if a == b else same)
    return {"kv_cache_dtype": kv_cache_dtype, "prompts": len(prompts),
            "identical": sum(d is None for d in first_difference), "first_difference": first_difference}


# ----------------------------------------------------------------------------- CLI

def add_arguments(parser) -> None:
    from llmlab.cli_flags import add_engine_arguments, positive_int

    parser.add_argument("--num-tokens", type=positive_int, default=None, help="evaluate on the text's first N tokens")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    # the model, device, dtype, backend, ...; every cache dtype is measured, so that flag is not one
    add_engine_arguments(parser, defaults={"num_gpu_blocks": 512}, exclude=("kv_cache_dtype",))


def run(llm, num_tokens=None) -> dict:
    from llmlab.bench.kv_quant_text import text

    device = llm.engine.device
    fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    token_ids = llm.tokenizer.encode(text())[:num_tokens]
    model = llm.engine.model
    result = {"model": llm.engine.config.model or "embedded SmolLM2-135M-Instruct", "device": str(device),
              "dtype": str(model.embed.dtype).removeprefix("torch."), "backend": llm.engine.backend,
              "num_tokens": len(token_ids)}
    result["accuracy"] = accuracy(model, token_ids, fp8)
    keys, values = capture_kv(model, token_ids)
    result["round_trip"] = round_trip_rows(keys, values)
    del keys, values
    prompts = greedy_prompts(llm.tokenizer)
    result["greedy"] = [greedy_agreement(llm, prompts, cache, num_gpu_blocks=llm.engine.config.num_gpu_blocks)
                        for cache in (["int8", "fp8_e4m3"] if fp8 else ["int8"])]
    return result


def print_tables(result) -> None:
    print(f"{result['model']} on {result['device']} ({result['dtype']}, {result['backend']} kernels), "
          f"{result['num_tokens']} tokens")
    print("| cache | bytes/token/layer | perplexity | change | mean KL | top-1 agreement |\n|---|---|---|---|---|---|")
    for r in result["accuracy"]:
        print(f"| {r['cache']} | {r['bytes_per_token_per_layer']} | {r['perplexity']:.3f} | {r['ppl_change_pct']:+.2f}% "
              f"| {r['mean_kl']:.2e} | {r['top1_agreement_pct']:.1f}% |")
    print("\n| scheme | K rel. error (mean / worst layer) | V rel. error (mean / worst layer) |\n|---|---|---|")
    for r in result["round_trip"]:
        print(f"| {r['scheme']} | {r['k_rel_err_mean']:.2e} / {r['k_rel_err_worst_layer']:.2e} "
              f"| {r['v_rel_err_mean']:.2e} / {r['v_rel_err_worst_layer']:.2e} |")
    for g in result["greedy"]:
        print(f"\ngreedy {GREEDY_TOKENS} tokens, {g['kv_cache_dtype']} vs full precision: {g['identical']} of "
              f"{g['prompts']} identical; first differing token of the others: "
              f"{[d for d in g['first_difference'] if d is not None]}")


def main(args) -> dict:
    import llmlab
    from llmlab.cli_flags import engine_kwargs

    llm = llmlab.LLM(**engine_kwargs(args))
    result = run(llm, args.num_tokens)
    print_tables(result)
    write_json(args.out, result)
    return result
