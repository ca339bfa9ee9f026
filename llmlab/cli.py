"""`llmlab generate | chat | demo | convert | serve | bench ...`."""
from __future__ import annotations

import argparse
import os
import sys
import time

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a GPU is.",
    "Give me three tips for learning to cook.",
    "What is 12 times 7?",
    "Name the planets of the solar system.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
]


def _load(args):
    import llmlab
    from llmlab.cli_flags import engine_kwargs

    start = time.perf_counter()
    print(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'} ...", file=sys.stderr, flush=True)
    llm = llmlab.LLM(**engine_kwargs(args))
    print(f"loaded in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return llm


def _params(args):
    import llmlab

    return llmlab.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                 seed=getattr(args, "seed", None))


def _stream(engine, prompt, params) -> str:
    """Run one request, printing its text as it grows; returns the final text."""
    request_id = engine.add_request(prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                print(out.delta_text, end="", flush=True)
                if out.finished:
                    print()
                    return out.text


def cmd_generate(args) -> None:
    llm = _load(args)
    prompt = args.prompt
    if args.chat_template:
        prompt = [{"role": "user", "content": prompt}]   # the engine renders the template
    _stream(llm.engine, prompt, _params(args))


def cmd_chat(args) -> None:
    llm = _load(args)
    messages = []
    print("chat with the model; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        print("model> ", end="", flush=True)
        reply = _stream(llm.engine, messages, _params(args))
        messages.append({"role": "assistant", "content": reply})


def cmd_demo(args) -> None:
    import llmlab

    llm = _load(args)
    params = llmlab.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    conversations = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS]
    llm.chat(conversations[:1], llmlab.SamplingParams(max_tokens=4))   # warm-up
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(DEMO_PROMPTS, outputs):
        print(f"\n>>> {prompt}\n{out.text.strip()}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{len(outputs)} prompts batched together: {total} tokens in {elapsed:.2f}s "
          f"= {total / elapsed:.1f} tokens/s on {llm.engine.device.type} ({llm.engine.backend} kernels)")


def cmd_convert(args) -> None:
    from llmlab.model.gguf_convert import convert_gguf

    print(convert_gguf(args.gguf, args.out))


# Each benchmark module defines add_arguments(parser) and main(args); heavy imports
# happen inside main, so `llmlab --help` stays fast.
BENCHMARKS = {
    "kernels": "llmlab.bench.kernels",
    "decode-variants": "llmlab.bench.decode_variants",
    "prefill-variants": "llmlab.bench.prefill_variants",
    "single-forward": "llmlab.bench.single_forward",
    "offline": "llmlab.bench.offline",
    "serving": "llmlab.bench.serving",
    "guidellm": "llmlab.bench.guidellm_vs_serving",
    "prompt-batch": "llmlab.bench.prompt_batch",
    "hooks": "llmlab.bench.hooks",
    "kv-quant": "llmlab.bench.kv_quant",
    "calibrate": "llmlab.bench.calibrate",
    "simulate": "llmlab.bench.simulate",
    "head-of-line": "llmlab.bench.head_of_line",
    "sampler": "llmlab.bench.sampler",
    "gemv": "llmlab.bench.gemv",
    "launches": "llmlab.bench.launches",
}


def _missing(command: str, package: str):
    def fail(args):
        raise ValueError(f"`{command}` needs the Python package {package!r}, which is not installed")
    return fail


def _add_module_parsers(sub, modules: dict, help_prefix: str) -> None:
    import importlib

    for name, module_name in modules.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:
                continue    # this command is not part of this version
            p = sub.add_parser(name, help=f"{help_prefix} {name} (unavailable: needs {err.name})")
            p.set_defaults(func=_missing(name, err.name))
            continue
        doc = (module.__doc__ or "").strip()
        # --help shows the module's docstring (what it measures, its examples) above the flags
        p = sub.add_parser(name, help=f"{help_prefix} {name}: {doc.splitlines()[0] if doc else ''}".strip(),
                           description=doc or None, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.main)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="llmlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, max_tokens=128):
        from llmlab.cli_flags import add_engine_arguments

        p.add_argument("--max-tokens", type=int, default=max_tokens)
        p.add_argument("--temperature", type=float, default=0.0)
        # --seed is the sampling seed here (SamplingParams.seed), not EngineConfig.seed
        add_engine_arguments(p, exclude=("seed",))

    p = sub.add_parser("generate", help="generate text for one prompt, streaming")
    p.add_argument("prompt")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user message")
    common(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat, streaming")
    p.add_argument("--seed", type=int, default=None)
    common(p, max_tokens=256)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("demo", help="a batch of prompts on the embedded model, with tokens/s")
    common(p, max_tokens=64)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("convert", help="convert a .gguf file to a HF-style folder")
    p.add_argument("gguf")
    p.add_argument("out")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("bench", help="benchmarks: " + " | ".join(BENCHMARKS))
    _add_module_parsers(p.add_subparsers(dest="benchmark", required=True), BENCHMARKS, "benchmark")

    _add_module_parsers(sub, {"serve": "llmlab.server.serve"}, "")

    args = parser.parse_args(argv)
    out = getattr(args, "out", None) if args.command == "bench" else None
    if out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):   # before the run, not after it
        parser.exit(2, f"llmlab: error: --out {out}: the folder {os.path.dirname(os.path.abspath(out))} does not exist\n")
    try:
        args.func(args)
    except (ValueError, OSError) as err:   # bad values, missing or unwritable files
        parser.exit(2, f"llmlab: error: {err}\n")
    except Exception as err:
        if type(err).__module__.split(".")[0] != "httpx":   # bench serving, head-of-line --url
            raise
        parser.exit(2, f"llmlab: error: {type(err).__name__}: {err} (is a server running at that address?)\n")


if __name__ == "__main__":
    main()
