"""single forward (SwiftLLM's first benchmark): one prefill forward and one decode step
over a grid of (batch size, sequence length), llmlab against HF transformers (sdpa) in
the same process; random bf16 weights in the Llama-3-8B shape unless --model is given."""
from __future__ import annotations

from llmlab.bench.common import LLAMA3_8B, median_ms, random_engine, random_hf_model, write_json


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="random-llama3-8b", help="a HF folder, or random-llama3-8b")
    parser.add_argument("--batch-sizes", default="1,64", help="comma-separated")
    parser.add_argument("--seq-lens", default="512,2048", help="comma-separated")
    parser.add_argument("--prefill-tokens-max", type=int, default=16384,
                        help="skip prefill cells with batch x seq_len above this")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke tests)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--profile", action="store_true",
                        help="print the GPU time per kernel of one eager decode step per cell")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs (the peer for --tp, whose steps are eager)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor_parallel_size: shard llmlab's model over this many GPUs "
                             "(the HF peer stays on one)")


def _profile(fn, title) -> None:
    """Print where the GPU time of fn() goes, by kernel."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"\n{title}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def check_seq_len(seq_len: int, max_model_len: int) -> None:
    """A cell's prefill has seq_len tokens and its decode step a context of seq_len + 1: both
    must fit max_model_len (a longer one overruns the block tables: the CUDA graphs' copy
    failed on 513 blocks of 512). ValueError otherwise, before any batch is built."""
    if seq_len < 1:
        raise ValueError(f"--seq-lens {seq_len} is too short: a sequence has at least 1 token")
    if seq_len >= max_model_len:
        raise ValueError(f"--seq-lens {seq_len} is too long: each cell also runs a decode step after the "
                         f"{seq_len}-token prompt, at context {seq_len + 1}, and the engine holds at most "
                         f"{max_model_len} tokens (max_model_len); use --seq-lens up to {max_model_len - 1}")


def llmlab_cells(engine, batch_size, seq_len, do_prefill, profile=False):
    """(prefill ms, decode ms) for one forward: `batch_size` prompts of `seq_len` tokens,
    then one decode step of those sequences after seq_len cached tokens (graph replay when
    captured). The batches are dummy plans (batch.dummy_plan) over an unused cache."""
    from llmlab.engine.batch import dummy_plan

    check_seq_len(seq_len, engine.max_model_len)
    runner, block_size = engine.runner, engine.config.block_size
    prefill_ms = None
    if do_prefill:
        inputs = runner.prepare(dummy_plan(block_size, prefills=[(seq_len, seq_len)] * batch_size))
        prefill_ms = median_ms(lambda: runner.forward(*inputs))
    inputs = runner.prepare(dummy_plan(block_size, decodes=[seq_len + 1] * batch_size))
    decode_ms = median_ms(lambda: runner.forward(*inputs), repeats=20)
    if profile:
        _profile(lambda: runner.forward(*inputs, eager=True), f"eager decode step, batch {batch_size}, context {seq_len}")
    return prefill_ms, decode_ms


def hf_cells(model, batch_size, seq_len, do_prefill, vocab):
    import torch
    from transformers import DynamicCache

    ids = torch.randint(16, vocab, (batch_size, seq_len), device="cuda")
    prefill_ms = None
    with torch.inference_mode():
        if do_prefill:
            prefill_ms = median_ms(lambda: model(ids, logits_to_keep=1), repeats=5)
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, logits_to_keep=1)
        step = torch.randint(16, vocab, (batch_size, 1), device="cuda")

        def decode():
            model(step, past_key_values=cache, logits_to_keep=1)
            cache.crop(seq_len)

        decode_ms = median_ms(decode, repeats=20)
    return prefill_ms, decode_ms


def main(args) -> list[dict]:
    import torch

    from llmlab.config import ModelConfig

    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    # before the CUDA check and the minutes of building 8B random weights (llmlab_cells checks
    # each cell again against the engine built)
    for seq_len in seq_lens:
        check_seq_len(seq_len, ModelConfig.from_hf(LLAMA3_8B).context_length)
    if not torch.cuda.is_available():
        raise ValueError("single-forward times GPU forwards; it needs a CUDA device")
    max_tokens = max(b * s for b in batch_sizes for s in seq_lens) + max(batch_sizes)
    block_size = 16
    llm, hf_config = random_engine(args, num_gpu_blocks=max_tokens // block_size + 2 * max(batch_sizes) + 8,
                                   max_num_seqs=max(batch_sizes),
                                   max_num_batched_tokens=min(args.prefill_tokens_max, max_tokens))
    engine = llm.engine
    cells = [(b, s) for b in batch_sizes for s in seq_lens]
    results = []
    for b, s in cells:
        p, d = llmlab_cells(engine, b, s, b * s <= args.prefill_tokens_max, args.profile)
        impl = "llmlab" + (f" (tp={args.tp})" if args.tp > 1 else "") + (" eager" if args.enforce_eager else "")
        results.append({"impl": impl, "batch_size": b, "seq_len": s, "prefill_ms": p, "decode_ms": d})
    if not args.no_hf:
        if engine.executor is not None:   # tensor parallel: free the other GPUs' workers now
            engine.executor.shutdown()
        del llm, engine
        torch.cuda.empty_cache()
        model = random_hf_model(hf_config, torch.bfloat16, "cuda")
        for b, s in cells:
            p, d = hf_cells(model, b, s, b * s <= args.prefill_tokens_max, hf_config["vocab_size"])
            results.append({"impl": "hf-transformers (sdpa)", "batch_size": b, "seq_len": s,
                            "prefill_ms": p, "decode_ms": d})
    name = torch.cuda.get_device_name()
    print(f"\nsingle forward, Llama-3-8B shape, bf16, {name}")
    print("| impl | batch | seq len | prefill ms | decode ms |\n|---|---|---|---|---|")
    for r in results:
        p = "-" if r["prefill_ms"] is None else f"{r['prefill_ms']:.2f}"
        print(f"| {r['impl']} | {r['batch_size']} | {r['seq_len']} | {p} | {r['decode_ms']:.2f} |")
    write_json(args.out, {"device": name, "results": results}, indent=2)
    return results
