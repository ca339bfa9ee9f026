"""Kernel launches per decode step: how many, which, and (on a GPU) the gaps between them.

At batch 1 a decode step of an 8B model is ~300 small launches around the weight-streaming
GEMMs, and each costs GPU time even inside a CUDA graph. This counts them two ways:

- `count_launches(fn)`, on any device: runs fn() and records every kernel it launches:
  each Triton launch, and each torch op that computes something (views, reshapes and
  allocations launch nothing). On a CPU, with the Triton backend in the interpreter, this is
  the launch sequence the same forward has on a GPU, except inside cuBLAS: a GEMM counts
  as one launch, where cuBLAS may add a split-K reduction.
- `profile_kernels(fn)`, on CUDA: the kernels the profiler saw, their busy time, and the
  idle time between them (the launch gaps).

    llmlab bench launches --out results/launches            # Llama-3-8B shape, GPU
    llmlab bench launches --layers 2 --batch-sizes 1,4 --out /tmp/launches   # CPU

(`python -m llmlab.bench.launches` takes the same flags.)

Each forward runs twice: fused (the model as it is) and unfused (rope and store_kv plugged
in as overrides, which makes the model run the pair; see llmlab/kernels/__init__.py), so one
run shows what the fusion saves. See kernels_explained/rope_store_kv.md.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmlab.bench.common import LLAMA3_8B, SMALL_LLAMA, capture_graph, engine_with_random_weights, median_ms, write_json

# ops that move no data: metadata changes and allocations
_NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
              "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size",
              "promote_types", "result_type"}


class _TorchOps(TorchDispatchMode):
    """Appends the name of each computing aten op to `launches` (while `active`)."""

    def __init__(self, launches):
        super().__init__()
        self.launches, self.active = launches, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.active and name not in _NO_LAUNCH and (not func.is_view or _copied(args, out)):
            self.launches.append(name)
        return out


def _copied(args, out) -> bool:
    """Whether an op that may return a view (reshape, contiguous) made a copy instead."""
    source = args[0] if args else None
    if not (isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor)):
        return False
    return out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


def _triton_function_classes():
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    return classes


@contextlib.contextmanager
def count_launches():
    """Inside the block, the yielded list gets one name per kernel launched: the Triton
    kernel's name, or the aten op's. (The interpreter's own torch ops inside a Triton
    launch are not counted.)"""
    launches: list[str] = []
    mode = _TorchOps(launches)
    classes = _triton_function_classes()
    saved = [cls.run for cls in classes]

    def counting(original):
        def run(self, *args, **kwargs):
            launches.append(self.__name__.strip("_").removesuffix("_kernel"))
            mode.active = False          # the interpreter's numpy copies are not launches
            try:
                return original(self, *args, **kwargs)
            finally:
                mode.active = True
        return run

    for cls, original in zip(classes, saved):
        cls.run = counting(original)
    try:
        with mode:
            yield launches
    finally:
        for cls, original in zip(classes, saved):
            cls.run = original


def unfused(backend):
    """Plug the backend's own rope and store_kv in as overrides: the model then runs the
    pair (and decode_attention apart) instead of rope_store_kv, or of rope_store_decode_attention
    in a decode step without splits (the same math, one or two launches more per layer)."""
    from llmlab import kernels

    return kernels.override(rope=kernels.get_kernel("rope", backend), store_kv=kernels.get_kernel("store_kv", backend))


def profile_kernels(fn) -> dict:
    """CUDA only: fn()'s kernels as the profiler saw them (after one run to warm up):
    count, busy time, and the span from the first kernel's start to the last one's end;
    span - busy is the idle time between launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, None
    for start, stop in intervals:   # union of the intervals: overlapping kernels count once
        if end is None or start >= end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = intervals[-1][1] - intervals[0][0] if intervals else 0.0
    names = Counter(e.name for e in kernels)
    return {"kernels": len(kernels), "busy_us": busy, "span_us": span, "gaps_us": span - busy,
            "by_name": dict(names.most_common())}


def decode_step(engine, batch_size: int, context: int, num_splits: int | None = None):
    """fn() running one eager decode forward of `batch_size` sequences at `context` tokens,
    through the engine's runner (a dummy plan on an unused cache). `num_splits` replaces the
    runner's flash-decoding split count (1: no split-K reduce launch)."""
    from llmlab.engine.batch import dummy_plan

    runner = engine.runner
    input_ids, positions, batch = runner.prepare(dummy_plan(engine.config.block_size, decodes=[context] * batch_size))
    if num_splits is not None:
        batch.num_splits = num_splits
    return lambda: runner.forward(input_ids, positions, batch, eager=True)


def per_layer(launches: list[str], num_layers: int) -> dict:
    """The step's launches as one layer's sequence (every layer launches the same kernels)
    and what runs outside the layers (embedding, final norm, lm_head). A layer starts at
    its input rms_norm and has two: layer 0 runs from the first rms_norm to the third (with
    one layer, the third is the final norm)."""
    norms = [i for i, name in enumerate(launches) if name == "rms_norm"]
    if len(norms) != 2 * num_layers + 1:
        raise ValueError(f"expected {2 * num_layers + 1} rms_norm launches, saw {len(norms)}")
    layer = launches[norms[0]:norms[2]]
    outside = Counter(launches)
    outside.subtract({name: n * num_layers for name, n in Counter(layer).items()})
    return {"per_layer": layer, "per_layer_total": len(layer), "outside_layers": dict(+outside)}


def measure(engine, batch_sizes, context, num_splits=None) -> list[dict]:
    backend, num_layers = engine.runner.backend, engine.runner.model_config.num_layers
    rows = []
    for batch_size in batch_sizes:
        step = decode_step(engine, batch_size, context, num_splits)
        for variant in ("fused", "unfused"):
            with unfused(backend) if variant == "unfused" else contextlib.nullcontext():
                step()                       # compile / warm up outside the count
                with count_launches() as launches:
                    step()
                row = {"batch_size": batch_size, "context": context, "variant": variant, "backend": backend,
                       "num_splits": num_splits or engine.runner.num_splits(batch_size, context),
                       "num_layers": num_layers, "launches": len(launches), **per_layer(launches, num_layers),
                       "sequence": launches}
                if torch.cuda.is_available():
                    replay = capture_graph([step])   # as the engine captures decode steps
                    row["eager_ms"] = median_ms(step, repeats=20)
                    row["graph_ms"] = median_ms(replay, repeats=20)
                    # the profiler's event API moves between torch versions: a failure there
                    # must not lose the counts and timings above
                    for key, fn in (("graph_profile", replay), ("eager_profile", step)):
                        try:
                            row[key] = profile_kernels(fn)
                        except Exception as error:  # noqa: BLE001
                            row[key + "_error"] = repr(error)
            rows.append(row)
    return rows


def random_engine(shape: str, num_layers: int | None, batch_sizes, context: int, backend: str | None):
    """An engine on random weights in the Llama-3-8B shape ("8b", bf16 on CUDA) or a small
    one of the same layout ("small", for a CPU), graphs off: each forward runs as called."""
    from llmlab import EngineConfig

    hf = dict(SMALL_LLAMA if shape == "small" else LLAMA3_8B)
    if num_layers:
        hf["num_hidden_layers"] = num_layers
    fields = dict(model="random-llama3-8b", num_gpu_blocks=(context // 16 + 2) * max(batch_sizes) + 8,
                  max_num_seqs=max(batch_sizes), max_num_batched_tokens=max(max(batch_sizes), 256),
                  max_model_len=context + 16, enforce_eager=True)
    if backend:
        fields["backend"] = backend
    if not torch.cuda.is_available():
        fields.update(device="cpu", dtype="float32")
    return engine_with_random_weights(EngineConfig(**fields), hf)


def add_arguments(parser) -> None:
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--context", type=int, default=513, help="tokens per sequence, the new one included")
    parser.add_argument("--shape", choices=["8b", "small"], default=None,
                        help="model shape: Llama-3-8B (default on CUDA) or a small one (default on a CPU)")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--backend", default=None, help="kernel backend (default: the device's; on a CPU, "
                                                        "'triton' counts the GPU's launch sequence)")
    parser.add_argument("--num-splits", type=int, default=None,
                        help="flash-decoding splits (default: the runner's choice; 1: no split-K reduce)")
    parser.add_argument("--out", required=True, help="a directory: launches.json (launches_splits<N>.json) goes there")


def main(args) -> list[dict]:
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    shape = args.shape or ("8b" if torch.cuda.is_available() else "small")
    engine = random_engine(shape, args.layers, batch_sizes, args.context, args.backend)
    rows = measure(engine, batch_sizes, args.context, args.num_splits)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "launches.json" if args.num_splits is None else f"launches_splits{args.num_splits}.json"
    write_json(out / name, rows)
    for row in rows:
        extra = ""
        if "graph_profile" in row:
            p = row["graph_profile"]
            extra = (f"; in a graph: {p['kernels']} GPU kernels, busy {p['busy_us'] / 1000:.3f} ms, "
                     f"gaps {p['gaps_us'] / 1000:.3f} ms; eager {row['eager_ms']:.3f} ms, graph {row['graph_ms']:.3f} ms")
        print(f"batch {row['batch_size']:3} {row['variant']:8} splits {row['num_splits']} {row['launches']:4} launches, "
              f"{row['per_layer_total']} per layer: {' '.join(row['per_layer'])}; "
              f"outside the layers: {row['outside_layers']}{extra}")
    return rows


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
