"""What the tensor- and pipeline-parallel tests share: tiny random HF models, a greedy run
that records every forward's logits, and a shutdown that checks nothing is left behind."""
from __future__ import annotations

import multiprocessing

import torch
import torch.distributed as dist
import transformers

import llmlab
from llmlab import SamplingParams
from helpers.hf_checkpoints import COMMON, save

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# The parallel runs multiply the same numbers as the whole model; only the order of the
# fp32 sums changes (o_proj and down become tp partial sums added by the all-reduce, and a
# micro-batch's matrix products have fewer rows). That moves logits of size ~1-10 by a few
# ulps per layer, ~1e-6; a wrongly cut weight or a layer run twice moves them by O(1).
ATOL = RTOL = 1e-4

TINY_VOCAB = 250       # not a multiple of 4: TP=4 pads the vocab-parallel embedding to 252


def build_tiny(folder, config_name, model_name, **kwargs):
    """A tiny HF model with every weight random (as helpers/hf_checkpoints.py builds them), saved."""
    config = getattr(transformers, config_name)(**{**COMMON, "vocab_size": TINY_VOCAB, **kwargs})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
    return save(model, folder, "safetensors")


def greedy_run(engine, prompts, params=GREEDY):
    """Greedy tokens per prompt, the logits of every forward, and the trace."""
    recorder = llmlab.Recorder()
    engine.hooks.attach(recorder)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    with engine.model.capture(["logits"]) as taps:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    return [done[i] for i in ids], taps["logits"], recorder.trace


def shut_down(engine):
    """Stop the workers; each must exit cleanly, and the process group must be gone."""
    processes = [w.process for w in engine.executor.workers]
    engine.executor.shutdown()
    assert [p.exitcode for p in processes] == [0] * len(processes)
    assert not dist.is_initialized()
    assert multiprocessing.active_children() == []


def kill_mid_step(engine, rank: int) -> list[BaseException]:
    """Freeze worker `rank`, start a step (rank 0 then waits for it inside the step: in a
    collective or for its activations), kill the worker; return what the step raised. The
    step must end, not hang on the dead rank."""
    import os
    import signal
    import threading

    worker = next(w for w in engine.executor.workers if w.rank == rank)
    os.kill(worker.process.pid, signal.SIGSTOP)
    errors = []

    def step():
        try:
            engine.step()
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    thread.join(timeout=1.0)      # by now rank 0 waits on the frozen worker (or has failed)
    os.kill(worker.process.pid, signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive(), "rank 0 still waits on a dead worker"
    return errors
