"""offline throughput (nano-vllm's benchmark): N requests with random input and output
lengths, EOS ignored; output tokens/s for llmlab, and for HF transformers' batched
`generate` in the same run when --hf is given."""
from __future__ import annotations

import json
import random
import time


def add_arguments(parser) -> None:
    from llmlab.config import add_engine_arguments

    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2); "
                        "'random-llama3-8b' = random bf16 weights in the Llama-3-8B shape")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="input and output lengths are uniform in")
    parser.add_argument("--max-len", type=int, default=1024, help="[min-len, max-len] unless fixed below")
    parser.add_argument("--input-len", type=int, default=None, help="fixed input length")
    parser.add_argument("--output-len", type=int, default=None, help="fixed output length")
    parser.add_argument("--hf", action="store_true", help="also time HF transformers generate")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--hf-num-requests", type=int, default=None,
                        help="time HF on only the first N requests (it is slow); default all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    # engine flags from EngineConfig (a bigger batch than the engine's default); --seed above is the workload's
    add_engine_arguments(parser, defaults={"max_num_seqs": 256, "max_num_batched_tokens": 8192},
                         exclude=("model", "seed"))


def workload(args, vocab_size: int):
    """(prompt token ids, output length) per request; ids avoid the first 16 (special) tokens."""
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.num_requests):
        n_in = args.input_len or rng.randint(args.min_len, args.max_len)
        n_out = args.output_len or rng.randint(args.min_len, args.max_len)
        requests.append(([rng.randint(16, vocab_size - 1) for _ in range(n_in)], n_out))
    return requests


def build_llm(args):
    import llmlab
    from llmlab.bench.single_forward import random_engine
    from llmlab.config import engine_kwargs

    if args.model == "random-llama3-8b":
        return random_engine(args)[0]
    return llmlab.LLM(args.model, **engine_kwargs(args))


def run_llmlab(llm, requests) -> dict:
    from llmlab import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    llm.generate([requests[0][0][:16]], SamplingParams(max_tokens=4))   # warm-up
    start = time.perf_counter()
    outputs = llm.generate([ids for ids, _ in requests], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    assert tokens == sum(n for _, n in requests)
    return {"impl": "llmlab", "seconds": elapsed, "output_tokens": tokens,
            "requests_per_s": len(requests) / elapsed, "output_tokens_per_s": tokens / elapsed}


def hf_model(args, dtype, device):
    """The HF transformers peer: the same folder, or random weights in the same shape."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model == "random-llama3-8b":
        from llmlab.bench.single_forward import LLAMA3_8B

        config = LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k != "model_type"})
        config._attn_implementation = "sdpa"
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                return LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(torch.float32)
    from llmlab.model.loader import resolve_model

    return AutoModelForCausalLM.from_pretrained(str(resolve_model(args.model)), dtype=dtype).to(device).eval()


def run_hf(model, requests, batch_size, device) -> dict:
    """HF generate in static batches (left-padded); a batch runs until its longest output is
    done, and only the requested tokens count, which is the cost of static batching."""
    import torch

    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    def generate(batch):
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=device)
        new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)

    generate(requests[:1])   # warm-up
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        generate(requests[i:i + batch_size])
    if device != "cpu":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(n for _, n in requests)
    return {"impl": f"hf-transformers generate (batch {batch_size}, {len(requests)} requests)",
            "seconds": elapsed, "output_tokens": tokens, "requests_per_s": len(requests) / elapsed,
            "output_tokens_per_s": tokens / elapsed}


def main(args) -> list[dict]:
    import gc
    import platform

    import torch

    llm = build_llm(args)
    engine = llm.engine
    dtype, device, backend = engine.dtype, engine.device.type, engine.backend
    requests = workload(args, engine.model_config.vocab_size)
    results = [run_llmlab(llm, requests)]
    del llm, engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    if args.hf:
        hf_requests = requests[:args.hf_num_requests or len(requests)]
        results.append(run_hf(hf_model(args, dtype, device), hf_requests, args.hf_batch_size, device))
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    print(f"\n{args.num_requests} requests on {name} ({dtype}, {backend} kernels)")
    print("| impl | seconds | req/s | output tok/s |\n|---|---|---|---|")
    for r in results:
        r.update(device=name, dtype=str(dtype))
        print(f"| {r['impl']} | {r['seconds']:.2f} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} |")
    if len(results) == 2:
        print(f"llmlab / HF = {results[0]['output_tokens_per_s'] / results[1]['output_tokens_per_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results
