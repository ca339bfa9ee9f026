"""offline throughput (nano-vllm's benchmark): N requests with random input and output
lengths, EOS ignored; output tokens/s for llmlab, and for HF transformers' batched
`generate` in the same run when --hf is given.

What users run is measured too: sampling settings (--temperature/--top-p/--top-k/--min-p/
--seed, and more settings side by side with --compare), prefix caching on and off in the
same process (--compare-prefix-caching), and prompts that share a prefix (--prefix-len,
--num-prefixes). --compare-async-scheduling runs every setting with the engine's steps one at
a time, then overlapped (EngineConfig.async_scheduling), on the same engine.

`--dataset serving-synthetic` runs `llmlab bench serving`'s prompts instead (bench/prompts.py):
those of `bench serving --seed S --num-prompts N` (its first rate's) for `--workload-seed S
--num-requests N`, with the same length flags, tokenized as the server tokenizes them: the
same token ids and output lengths, so the two commands give the server / offline ratio.

On an H200 (or with --roofline TB_S,TFLOP_S) it also prints the bound: the same requests
simulated through the engine's scheduler with every step at max(bytes / bandwidth, FLOPs /
peak) (experiments/roofline.py), and each run's share of it; and the bound of a forward whose
products, attention and K/V writes run one after another (Roofline(overlapped=False)). --profile-steps then runs the
first setting once more with a hook attached (steps one at a time, each phase synchronised)
and prints where its steps lose time against that bound, by kind and size of step
(experiments/step_profile.py); the first result's JSON holds it as "step_profile"."""
from __future__ import annotations

import time

from llmlab.bench.common import LLAMA3_8B, random_engine, random_hf_model, write_json
from llmlab.machine import machine_name


def add_arguments(parser) -> None:
    from llmlab.bench.prompts import add_synthetic_arguments
    from llmlab.cli_flags import add_engine_arguments, positive_int

    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2); "
                        "'random-llama3-8b' = random bf16 weights in the Llama-3-8B shape")
    parser.add_argument("--num-requests", type=positive_int, default=256)
    parser.add_argument("--dataset", choices=["random", "serving-synthetic"], default="random",
                        help="random: token ids, lengths from the flags below (nano-vllm's); serving-synthetic: "
                             "bench serving's text prompts for --workload-seed (its --seed) and the "
                             "--mean-/--max-input/output-len flags (the model needs a tokenizer)")
    parser.add_argument("--min-len", type=int, default=100, help="input and output lengths are uniform in")
    parser.add_argument("--max-len", type=int, default=1024, help="[min-len, max-len] unless fixed below")
    parser.add_argument("--input-len", type=int, default=None, help="fixed input length")
    parser.add_argument("--output-len", type=int, default=None, help="fixed output length")
    parser.add_argument("--hf", action="store_true", help="also time HF transformers generate")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--hf-num-requests", type=int, default=None,
                        help="time HF on only the first N requests (it is slow); default all")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the random prompts and lengths")
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="every prompt starts with one of --num-prefixes shared prefixes of this many tokens")
    parser.add_argument("--num-prefixes", type=int, default=1)
    add_synthetic_arguments(parser.add_argument_group("--dataset serving-synthetic (bench serving's flags)"))
    sampling = parser.add_argument_group("sampling (one setting; --compare adds more, run in the same process)")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=-1)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--seed", type=int, default=None, help="SamplingParams.seed of every request (default: none)")
    sampling.add_argument("--logprobs", type=int, default=None,
                          help="SamplingParams.logprobs of every request: each token's logprob and the k most likely")
    sampling.add_argument("--compare", nargs="+", default=[], metavar="SETTING",
                          help='more settings, e.g. greedy "temperature=0.7,top_p=0.9" "temperature=0.7,top_p=0.9,seed=1" '
                               '"temperature=0,logprobs=5"')
    parser.add_argument("--compare-prefix-caching", action="store_true",
                        help="run every setting with prefix caching off, then on")
    parser.add_argument("--compare-async-scheduling", action="store_true",
                        help="run every setting with async scheduling off, then on (the same engine: "
                             "it reads engine.async_scheduling every step)")
    parser.add_argument("--warmup", choices=["full", "light"], default="full",
                        help="before timing, run the whole workload once (full) or one short request "
                             "(light). A first pass is slower on both devices: on a GPU it compiles "
                             "kernel variants and captures CUDA graphs for new flash-decoding splits; "
                             "on a CPU it ran 4x slower than the next (16 prompts, embedded model)")
    parser.add_argument("--roofline", default=None, metavar="TB_S,TFLOP_S",
                        help="the per-step bound to compare with: the same requests simulated through the engine's "
                             "scheduler, each step at max(bytes / TB_S, FLOPs / TFLOP_S) (experiments/roofline.py); "
                             "default on an H200 its measured 4.27,790, elsewhere none")
    parser.add_argument("--profile-steps", action="store_true",
                        help="after the timed runs, run the first setting again step by step and print, by kind and "
                             "size of step, wall / forward / sample / host time against the bound (needs one: an "
                             "H200 or --roofline)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    # engine flags from EngineConfig (a bigger batch than the engine's default); --seed above is the sampler's
    add_engine_arguments(parser, defaults={"max_num_seqs": 256, "max_num_batched_tokens": 8192},
                         exclude=("model", "seed"))


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs")


def sampling_settings(args) -> list[dict]:
    """The command line's setting, then each --compare one ("greedy" or key=value,...)."""
    settings = [{k: getattr(args, k) for k in SAMPLING_KEYS}]
    for spec in args.compare:
        setting = dict(settings[0], temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, logprobs=None)
        if spec != "greedy":
            for item in spec.split(","):
                key, _, value = item.partition("=")
                if key not in SAMPLING_KEYS:
                    raise ValueError(f"--compare: unknown sampling key {key!r}; use {', '.join(SAMPLING_KEYS)}")
                try:
                    setting[key] = int(value) if key in ("top_k", "seed", "logprobs") else float(value)
                except ValueError:
                    raise ValueError(f"--compare {spec!r}: {key} needs a number, as {key}=0.7") from None
        settings.append(setting)
    return settings


def describe(setting: dict) -> str:
    logprobs = "" if setting.get("logprobs") is None else f", logprobs={setting['logprobs']}"
    if setting["temperature"] == 0:
        return "greedy" + logprobs
    return ", ".join(f"{k}={v}" for k, v in setting.items() if v is not None and (k == "temperature" or v != {
        "top_p": 1.0, "top_k": -1, "min_p": 0.0}.get(k)))


def build_workload(args, vocab_size: int):
    """The command line's `Workload.throughput`: every request at t = 0, lengths uniform in
    [--min-len, --max-len] unless fixed; with --prefix-len, request i's prompt is shared
    prefix i % --num-prefixes, then its own tokens."""
    from llmlab.experiments import Workload

    if not (args.input_len and args.output_len) and not 0 < args.min_len <= args.max_len:
        raise ValueError(f"--min-len {args.min_len} and --max-len {args.max_len}: need 0 < min <= max")
    return Workload.throughput(args.num_requests, args.min_len, args.max_len, args.input_len, args.output_len,
                               args.prefix_len, args.num_prefixes, args.workload_seed, vocab_size)


def serving_workload(args, engine):
    """bench serving's prompts for --workload-seed as its first rate sends them (prompts.py),
    every request at t = 0, tokenized by `engine.tokenize`, as the server tokenizes them."""
    from llmlab.bench.prompts import for_rate, synthetic_prompts_of
    from llmlab.experiments.workload import Workload, WorkloadRequest

    if engine.tokenizer is None:
        raise ValueError("--dataset serving-synthetic sends text: the model needs a tokenizer "
                         "(with random weights: --tokenizer embedded)")
    prompts = for_rate(synthetic_prompts_of(args, args.num_requests, args.workload_seed), 0)
    return Workload([WorkloadRequest(str(i), 0.0, engine.tokenize(p.text)[0], p.output_len, prompt=p.text)
                     for i, p in enumerate(prompts)])


def build_llm(args, **overrides):
    import llmlab
    from llmlab.cli_flags import engine_kwargs

    kwargs = dict(engine_kwargs(args), **overrides)
    if args.model == "random-llama3-8b":
        return random_engine(args, engine_args=kwargs)[0]
    return llmlab.LLM(args.model, **kwargs)


def warm_up(llm, workload, setting: dict, full: bool) -> None:
    from llmlab import SamplingParams

    if full:
        llm.generate([r.prompt_token_ids for r in workload],
                     [SamplingParams(max_tokens=r.output_len, ignore_eos=True, **setting) for r in workload])
    else:
        llm.generate([workload.requests[0].prompt_token_ids[:16]], SamplingParams(max_tokens=4, **setting))


def roofline_of(args, engine):
    """The Roofline --roofline asks for (on an H200 by default), or None."""
    from llmlab.experiments.roofline import Roofline

    if args.roofline is not None:
        return Roofline.of_engine(engine, *ceilings(args.roofline))
    if engine.device.type == "cuda" and "H200" in machine_name(engine.device):
        return Roofline.of_engine(engine)
    return None


def ceilings(text: str) -> tuple[float, float]:
    """--roofline's TB_S,TFLOP_S: two positive numbers."""
    try:
        tb_s, tflop_s = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--roofline TB_S,TFLOP_S: two numbers, e.g. 4.27,790; got {text!r}") from None
    if not (tb_s > 0 and tflop_s > 0):
        raise ValueError(f"--roofline TB_S,TFLOP_S: both positive, got {text!r}")
    return tb_s, tflop_s


def bound(engine, workload, roofline) -> float:
    """Output tokens/s of `workload` simulated through this engine's scheduler at `roofline`."""
    import dataclasses

    from llmlab.experiments import simulate

    config = dataclasses.replace(engine.config, num_gpu_blocks=engine.runner.num_device_blocks)
    return simulate(workload, config, roofline).summary()["output_tok_s"]


def run_llmlab(llm, workload, setting: dict) -> dict:
    from llmlab import SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, **setting) for r in workload]
    warm_up(llm, workload, setting, full=False)       # this setting's own kernels
    llm.engine.block_manager.reset_prefix_cache()     # each setting starts from a cold cache
    dropped = llm.engine.num_dropped_tokens
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in workload], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    assert tokens == sum(r.output_len for r in workload)
    stats = llm.engine.kv_stats()
    return {"impl": "llmlab", "sampling": describe(setting),
            "prefix_caching": llm.engine.config.enable_prefix_caching,
            "async_scheduling": llm.engine.async_scheduling,
            "dropped_tokens": llm.engine.num_dropped_tokens - dropped,
            "prefix_hit_rate": stats["prefix_hit_rate"], "seconds": elapsed, "output_tokens": tokens,
            "requests_per_s": len(workload) / elapsed, "output_tokens_per_s": tokens / elapsed}


def profile_run(llm, workload, setting: dict, roofline) -> list[dict]:
    """Run `workload` once more with a hook recording each step (no blocks) and return
    experiments.step_profile's rows against `roofline` (the last, "all", with the run's seconds)."""
    from llmlab import SamplingParams
    from llmlab.experiments.step_profile import profile_steps
    from llmlab.hooks import Recorder

    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, **setting) for r in workload]
    llm.engine.block_manager.reset_prefix_cache()
    recorder = Recorder(blocks=False, idle_before_steps=[])   # every request arrives at once: never idle
    llm.engine.hooks.attach(recorder)
    try:
        start = time.perf_counter()
        llm.generate([r.prompt_token_ids for r in workload], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.engine.hooks.detach(recorder)
    rows = profile_steps(recorder.trace, roofline)
    rows[-1]["run_seconds"] = elapsed
    return rows


def hf_model(args, dtype, device):
    """The HF transformers peer: the same folder, or random weights in the same shape."""
    from transformers import AutoModelForCausalLM

    if args.model == "random-llama3-8b":
        return random_hf_model(LLAMA3_8B, dtype, device)
    from llmlab.model.loader import resolve_model

    return AutoModelForCausalLM.from_pretrained(str(resolve_model(args.model)), dtype=dtype).to(device).eval()


def run_hf(model, requests, batch_size, device) -> dict:
    """HF generate in static batches (left-padded) of `requests` (WorkloadRequests); a batch
    runs until its longest output is done, and only the requested tokens count, which is the
    cost of static batching."""
    import torch

    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    requests = [(r.prompt_token_ids, r.output_len) for r in requests]   # (prompt ids, output length)

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

    import torch

    from llmlab.experiments.roofline import Roofline
    from llmlab.experiments.step_profile import format_profile

    settings = sampling_settings(args)
    if args.roofline is not None:
        ceilings(args.roofline)   # a malformed value fails before the model loads
    caching = [False, True] if args.compare_prefix_caching else [None]   # None: the flags' choice
    results, vocab, meta, limit, profile = [], None, None, None, None
    for enable in caching:
        llm = build_llm(args, **({} if enable is None else {"enable_prefix_caching": enable}))
        engine = llm.engine
        meta = engine.dtype, engine.device.type, engine.backend
        vocab = engine.model_config.vocab_size
        workload = serving_workload(args, engine) if args.dataset == "serving-synthetic" else build_workload(args, vocab)
        roofline = roofline_of(args, engine)
        if args.profile_steps and roofline is None:   # before the warm-up runs the workload
            raise ValueError("--profile-steps compares each step with the bound: pass --roofline TB_S,TFLOP_S "
                             "(on an H200 it is the default)")
        warm_up(llm, workload, settings[0], full=args.warmup == "full")
        if roofline is not None and limit is None:
            peaks = roofline.meta["roofline"]
            in_sequence = Roofline.of_engine(engine, peaks["tb_s"], peaks["tflop_s"], overlapped=False)
            limit = (bound(engine, workload, roofline), bound(engine, workload, in_sequence), peaks)
        overlaps = [False, True] if args.compare_async_scheduling else [engine.async_scheduling]
        for setting in settings:
            for overlap in overlaps:
                engine.async_scheduling = overlap   # read every step, so it may change between runs
                results.append(run_llmlab(llm, workload, setting))
        if args.profile_steps and profile is None:
            profile = results[0]["step_profile"] = profile_run(llm, workload, settings[0], roofline)
        del llm, engine
        gc.collect()
        if meta[1] == "cuda":
            torch.cuda.empty_cache()
    dtype, device, backend = meta
    if args.hf:
        hf_requests = workload.requests[:args.hf_num_requests or args.num_requests]   # the same for every engine
        results.append(run_hf(hf_model(args, dtype, device), hf_requests, args.hf_batch_size, device))
    name = machine_name(device)
    shared = f", prompts share {args.num_prefixes} prefix(es) of {args.prefix_len} tokens" if args.prefix_len else ""
    print(f"\n{args.num_requests} requests on {name} ({dtype}, {backend} kernels{shared})")
    print("| impl | sampling | prefix caching | async scheduling | seconds | req/s | output tok/s | vs first row |\n"
          "|---|---|---|---|---|---|---|---|")
    first = results[0]["output_tokens_per_s"]
    for r in results:
        r.update(device=name, dtype=str(dtype))
        caching_cell = {True: f"on (hit rate {r.get('prefix_hit_rate', 0):.2f})", False: "off"}.get(r.get("prefix_caching"), "")
        overlap_cell = {True: "on", False: "off"}.get(r.get("async_scheduling"), "")
        print(f"| {r['impl']} | {r.get('sampling', 'greedy')} | {caching_cell} | {overlap_cell} | {r['seconds']:.2f} | "
              f"{r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['output_tokens_per_s'] / first:.3f} |")
    if args.hf:
        print(f"llmlab / HF = {results[0]['output_tokens_per_s'] / results[-1]['output_tokens_per_s']:.2f}x")
    if limit is not None:
        tok_s, sequential_tok_s, peaks = limit
        for r in results:
            if r["impl"] == "llmlab":
                r["of_bound"] = r["output_tokens_per_s"] / tok_s
                r["of_bound_in_sequence"] = r["output_tokens_per_s"] / sequential_tok_s
        print(f"bound: {tok_s:.1f} output tok/s (these requests through the engine's scheduler, each step at max(bytes "
              f"/ {peaks['tb_s']:g} TB/s, FLOPs / {peaks['tflop_s']:g} TFLOP/s)); the first row at "
              f"{first / tok_s:.1%} of it; with each step's products, attention and K/V writes one after another "
              f"(as llmlab's forward runs them): {sequential_tok_s:.1f}, the first row at "
              f"{first / sequential_tok_s:.1%}")
    if profile is not None:
        first = results[0]
        print(f"\nwhere the first row's steps lose time ({first['sampling']}, prefix caching "
              f"{'on' if first['prefix_caching'] else 'off'}): the same requests again, one step at a time with each "
              f"phase synchronised (so slower than the timed run, host work included), each step against the bound "
              f"of its own shape (the line above simulates the whole workload):\n{format_profile(profile)}")
    write_json(args.out, results, indent=2)
    return results
