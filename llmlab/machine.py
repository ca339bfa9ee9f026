"""Which machine measured a time, whether it was busy, and what software ran: what a
timing figure or a benchmark's output must say. Plain data, no plotting: experiments and
benchmarks record it, llmlab.viz writes it under a figure's title.

On a shared or loaded machine the same step can take ten times longer (a 10-token prefill:
265 ms quiet, 2,172 ms while other jobs ran), so a figure about time states the machine,
the threads torch used and the load, and warns when the load was high.

    info = machine_info()     # {"device": ..., "cores": 2, "torch_threads": 2, "load": 0.4, "torch": ...}
    machine_note(info)        # "measured on Intel Xeon ... · 2 cores · torch 2 threads · load 0.4"
    machine_name("cpu")       # "Intel Xeon ..., 2 cores, 2 threads"          (a benchmark's table)
    recorded_on("cuda")       # "NVIDIA H200, torch 2.9.0, Triton 3.5.0"    (a saved trace or cost model)
"""
from __future__ import annotations

import os
import platform

# A 1-minute load average above this share of the cores means other work competed for them.
BUSY_LOAD_PER_CORE = 0.75


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def versions() -> dict:
    """The versions of torch and Triton (None where Triton is not installed)."""
    import torch

    try:
        import triton
    except ImportError:
        return {"torch": torch.__version__, "triton": None}
    return {"torch": torch.__version__, "triton": triton.__version__}


def machine_info() -> dict:
    """The machine now: device name (the GPU's, else the CPU's), CPU model, cores, torch
    threads, 1-minute load average (None where the OS has none), torch and Triton versions."""
    import torch

    gpu = torch.cuda.is_available()
    try:
        load = round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        load = None
    cpu = cpu_name()
    return {"device": torch.cuda.get_device_name() if gpu else cpu, "cpu": cpu, "cores": os.cpu_count() or 1,
            "torch_threads": torch.get_num_threads(), "load": load, "gpu": gpu, **versions()}


def machine_name(device="cuda") -> str:
    """The GPU's name, or the CPU model, its cores and torch's threads (CPU numbers vary by
    host): the machine a benchmark's table names."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def recorded_on(device="cuda", info: dict | None = None) -> str:
    """The machine and software a saved measurement (a trace, a cost model) was made with:
    this machine's `device`, or the machine that `info` (a machine_info() dict recorded with
    the measurement) describes."""
    import torch

    if info is not None:
        if info.get("gpu"):
            return f"{info.get('device', 'GPU')}, torch {info.get('torch', '?')}, Triton {info.get('triton', '?')}"
        return f"CPU ({info.get('cores', '?')} cores), torch {info.get('torch', '?')}, " \
               f"{info.get('torch_threads', '?')} threads"
    software = versions()
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {software['torch']}, Triton {software['triton']}"
    return f"CPU ({os.cpu_count()} cores), torch {software['torch']}, {torch.get_num_threads()} threads"


def is_busy(info: dict) -> bool:
    """Whether other work competed for the CPU (only CPU timings are that sensitive)."""
    load = info.get("load")
    return load is not None and not info.get("gpu") and load > BUSY_LOAD_PER_CORE * info.get("cores", 1)


def machine_note(info: dict | None = None, spread: float | None = None) -> str:
    """One line for a figure: the machine, and a warning when it was busy or when repeats of
    the same measurement differ by more than 2x (`spread` = slowest / fastest)."""
    info = info or machine_info()
    parts = [str(info.get("device", "unknown machine")), f"{info.get('cores', '?')} cores",
             f"torch {info.get('torch_threads', '?')} threads"]
    if info.get("load") is not None:
        parts.append(f"load {info['load']:.1f}")
    note = "measured on " + " · ".join(parts)
    if is_busy(info):
        note += " — BUSY MACHINE: other work competed for the cores; times may be several times too slow"
    elif spread is not None and spread > 2:
        note += f" — repeats differ up to {spread:.1f}x: the machine was busy at times"
    return note
