"""single forward (SwiftLLM's first benchmark): one prefill forward and one decode step
over a grid of (batch size, sequence length), llmlab against HF transformers (sdpa) in
the same process; random bf16 weights in the Llama-3-8B shape unless --model is given.

--mixed-prompt-lens P1,P2,... adds whole engine steps (scheduler, forward, sampler, async
scheduling, as a server runs them) that mix decodes with a prompt: for each batch size B,
B requests decode at the first --seq-lens context while, before every step, a new P-token
prompt arrives (max_tokens 1: it is read and answered in that step). Milliseconds per step
in steady state, P = 0 (decodes alone) first: what a prompt's arrival costs every running
stream, the tail of a server's time between tokens.

--knobs S1 S2 ... times settings of `kernels.knobs` side by side in one process, the same-run
peers of a fast path behind a knob (e.g. --knobs fold_norms=0 fold_norms=1): for each, in
turn, --knob-rounds times, the engine is built again on the same weights (building 8B random
weights once takes minutes), so its warm-up and CUDA graphs follow the setting."""
from __future__ import annotations

from llmlab.bench.common import LLAMA3_8B, median_ms, random_engine, random_hf_model, write_json
from llmlab.kernels.tuning import knobs_set, parse_setting


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
    parser.add_argument("--mixed-prompt-lens", default="",
                        help="comma-separated prompt lengths: also time engine steps of decodes plus one such prompt")
    parser.add_argument("--knobs", nargs="+", default=[], metavar="SETTING",
                        help="time these kernels.knobs settings side by side, each field=value[,field=value] "
                             "(e.g. fold_norms=0 fold_norms=1): the engine is built again on the same weights "
                             "for each (its CUDA graphs captured under it), in turn, --knob-rounds times")
    parser.add_argument("--knob-rounds", type=int, default=2, help="rounds over the --knobs settings")
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


def mixed_steps(engine, batch_size, context, prompt_len, steps=40) -> float:
    """Median-free steady state: ms per `engine.step()` over `steps` steps in which
    `batch_size` requests decode (after `context` prompt tokens) and, when prompt_len > 0, a
    new prompt of that many tokens arrives before each step (max_tokens 1). The same steps
    once before, untimed (compiles and captures what they need)."""
    import time

    import torch

    from llmlab import SamplingParams

    generator = torch.Generator().manual_seed(prompt_len)

    def ids(n):
        return torch.randint(16, engine.model_config.vocab_size, (n,), generator=generator).tolist()

    running = [engine.add_request(ids(context), SamplingParams(max_tokens=10_000, ignore_eos=True))
               for _ in range(batch_size)]
    while any(engine.requests[r].num_computed_tokens < context for r in running):   # their prompts read
        engine.step()

    def run():
        for _ in range(steps):
            if prompt_len:
                engine.add_request(ids(prompt_len), SamplingParams(max_tokens=1, ignore_eos=True))
            engine.step()

    run()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    run()
    sync()
    ms = (time.perf_counter() - start) / steps * 1000
    for request_id in running:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return ms


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
    import gc

    import torch

    from llmlab import LLMEngine
    from llmlab.config import ModelConfig
    from llmlab.llm import LLM

    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    # before the CUDA check and the minutes of building 8B random weights (llmlab_cells checks
    # each cell again against the engine built)
    for seq_len in seq_lens:
        check_seq_len(seq_len, ModelConfig.from_hf(LLAMA3_8B).context_length)
    settings = [parse_setting(spec) for spec in args.knobs]   # a typo fails before the weights are built
    if settings and args.tp > 1:
        raise ValueError("--knobs builds the engine again for each setting: tensor parallel (--tp) is not supported")
    if args.knob_rounds < 1:
        raise ValueError(f"--knob-rounds must be at least 1, got {args.knob_rounds}")
    if not torch.cuda.is_available():
        raise ValueError("single-forward times GPU forwards; it needs a CUDA device")
    mixed = sorted({0, *(int(x) for x in args.mixed_prompt_lens.split(",") if x)}) if args.mixed_prompt_lens else []
    max_tokens = max(b * s for b in batch_sizes for s in seq_lens) + max(batch_sizes)
    block_size = 16
    # mixed steps: the decodes' contexts grow by 2 x 40 steps (+ their prompt's last block), plus one prompt
    mixed_blocks = (max(batch_sizes) * ((seq_lens[0] + 100) // block_size + 2) + max(mixed) // block_size + 2
                    if mixed else 0)
    with knobs_set(settings[0] if settings else {}):   # its warm-up and graphs: the first run's
        llm, hf_config = random_engine(args,
                                       num_gpu_blocks=max(max_tokens // block_size + 2 * max(batch_sizes) + 8,
                                                          mixed_blocks),
                                       max_num_seqs=max(batch_sizes) + (1 if mixed else 0),
                                       max_num_batched_tokens=max(min(args.prefill_tokens_max, max_tokens),
                                                                  max(batch_sizes) + max(mixed, default=0)))
    engine = llm.engine
    cells = [(b, s) for b in batch_sizes for s in seq_lens]
    results, mixed_rows = [], []
    impl = "llmlab" + (f" (tp={args.tp})" if args.tp > 1 else "") + (" eager" if args.enforce_eager else "")
    runs = [(f" [{spec}] #{r + 1}", values)
            for r in range(args.knob_rounds) for spec, values in zip(args.knobs, settings)]
    for i, (label, values) in enumerate(runs or [("", {})]):
        with knobs_set(values):
            if i > 0:   # the same weights; warm-up and graphs under this setting
                parts = engine.config, engine.model, engine.tokenizer
                del llm, engine
                gc.collect()   # the old engine's cache and graphs go before the new one's are made
                torch.cuda.empty_cache()
                llm = LLM.from_engine(LLMEngine(parts[0], model=parts[1], tokenizer=parts[2]))
                engine = llm.engine
                del parts
            name = impl + label
            for b, s in cells:
                p, d = llmlab_cells(engine, b, s, b * s <= args.prefill_tokens_max, args.profile)
                results.append({"impl": name, "batch_size": b, "seq_len": s, "prefill_ms": p, "decode_ms": d})
            mixed_rows += [{"impl": name, "batch_size": b, "seq_len": seq_lens[0], "prompt_len": p,
                            "step_ms": mixed_steps(engine, b, seq_lens[0], p)} for b in batch_sizes for p in mixed]
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
    if mixed_rows:
        print(f"\nengine steps: decodes at context {seq_lens[0]} plus one new prompt a step")
        print("| impl | batch | prompt tokens | ms per step | vs decodes alone |\n|---|---|---|---|---|")
        for r in mixed_rows:
            alone = next(m["step_ms"] for m in mixed_rows if m["impl"] == r["impl"]
                         and m["batch_size"] == r["batch_size"] and not m["prompt_len"])
            print(f"| {r['impl']} | {r['batch_size']} | {r['prompt_len']} | {r['step_ms']:.2f} | "
                  f"{r['step_ms'] / alone:.2f}x |")
    write_json(args.out, {"device": name, "results": results, "mixed_steps": mixed_rows}, indent=2)
    return results
