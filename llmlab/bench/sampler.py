"""sampler: the time of one batched sampling call (`llmlab.sampling.Sampler`) on a
[batch, vocab] block of logits, for the usual settings, next to greedy (the argmax) and to
the sort that a sort-based top-p would need; the top-k settings also with the Triton
sampler's candidates path off (`knobs.sample_top_k_cap = 0`: the radix passes), for its peer."""
from __future__ import annotations

from llmlab.bench.common import median_ms, write_json
from llmlab.machine import machine_name

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.7": dict(temperature=0.7),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_p 0.9, seed 1": dict(temperature=0.7, top_p=0.9, seed=1),
    "temperature 0.7, top_k 50": dict(temperature=0.7, top_k=50),
    "temperature 1.0, top_k 50, top_p 0.95": dict(temperature=1.0, top_k=50, top_p=0.95),
    "temperature 0.8, top_p 0.95, top_k 50": dict(temperature=0.8, top_p=0.95, top_k=50),
    "temperature 0.7, top_k 1024": dict(temperature=0.7, top_k=1024),
    "temperature 0.7, min_p 0.05": dict(temperature=0.7, min_p=0.05),
}


def add_arguments(parser) -> None:
    from llmlab.cli_flags import positive_int

    parser.add_argument("--batch-sizes", default="1,64,128,256")
    parser.add_argument("--vocab", type=int, default=128256, help="default: Llama-3's vocabulary")
    parser.add_argument("--logit-std", type=float, default=1.3,
                        help="spread of the random logits (random Llama-3-8B weights give about 1.3)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--backend", default=None, help="kernel backend (default: the device's)")
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--out", default=None)


def main(args) -> list[dict]:
    import torch

    from llmlab import SamplingParams
    from llmlab.kernels import knobs
    from llmlab.model.llama import LOGITS_DTYPE
    from llmlab.sampling import Sampler

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    from llmlab.config import check_device

    check_device(args.device, device)
    dtype = LOGITS_DTYPE   # what the engine's model hands the sampler, on every device
    sampler = Sampler(backend=args.backend)
    on_gpu = device.type == "cuda"

    def microseconds(fn) -> float:   # median of --repeats calls after one, CUDA events on a GPU
        return 1000 * median_ms(fn, repeats=args.repeats, warmup=1, cuda_events=on_gpu)

    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        gen = torch.Generator(device=device).manual_seed(batch)
        logits = (torch.randn(batch, args.vocab, generator=gen, device=device) * args.logit_std).to(dtype)
        seeds, positions = list(range(batch)), [100] * batch
        row = {"batch": batch}
        for name, setting in SETTINGS.items():
            params = [SamplingParams(**setting)] * batch
            row[name] = microseconds(lambda: sampler(logits, params, seeds, positions).tolist())
        cap = knobs.sample_top_k_cap
        knobs.sample_top_k_cap = 0          # the same top-k settings through the radix passes
        try:
            for name, setting in SETTINGS.items():
                if setting.get("top_k", -1) > 0:
                    params = [SamplingParams(**setting)] * batch
                    row[f"{name} (radix passes)"] = microseconds(
                        lambda: sampler(logits, params, seeds, positions).tolist())
        finally:
            knobs.sample_top_k_cap = cap
        row["torch.sort (for reference)"] = microseconds(lambda: logits.float().sort(dim=-1, descending=True))
        rows.append(row)
    names = list(rows[0])[1:]
    print(f"\nSampler, vocab {args.vocab}, {dtype} logits, on {machine_name(device.type)} "
          f"(microseconds per call, median of {args.repeats}; includes the token ids' copy to the host)")
    print("| setting | " + " | ".join(f"batch {r['batch']}" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{r[name]:.0f}" for r in rows) + " |")
    write_json(args.out, rows, indent=2)
    return rows
