"""Which machine measured a time, and whether it was busy: what a timing figure must say.

On a shared or loaded machine the same step can take ten times longer (a 10-token prefill:
265 ms quiet, 2,172 ms while other jobs ran), so a figure about time states the machine,
the threads torch used and the load, and warns when the load was high.

    info = machine_info()          # {"device": ..., "cores": 2, "torch_threads": 2, "load": 0.4}
    machine_note(info)             # "Intel Xeon ... · 2 cores · torch 2 threads · load 0.4"
"""
from __future__ import annotations

import os
import platform

# A 1-minute load average above this share of the cores means other work competed for them.
BUSY_LOAD_PER_CORE = 0.75


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def machine_info() -> dict:
    """The machine now: device name, cores, torch threads, 1-minute load average (None where
    the OS has none)."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else _cpu_name()
    try:
        load = round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        load = None
    return {"device": device, "cores": os.cpu_count() or 1, "torch_threads": torch.get_num_threads(),
            "load": load, "gpu": torch.cuda.is_available()}


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
