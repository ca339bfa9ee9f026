"""Keep freed memory inside the process, so a CPU forward does not page-fault on every large
temporary tensor.

glibc's malloc serves each allocation above M_MMAP_THRESHOLD (128 KiB at start, growing
only as it sees frees) with fresh pages from the OS and hands them back on free. torch's
CPU allocator mallocs every tensor, so a decode step's gathered K/V copies and MLP
activations (hundreds of KiB to several MiB, every layer, every step) pay a page fault per
4 KiB on first touch. Raising the mmap and trim thresholds keeps such blocks in the heap
for reuse: a decode step of 27 sequences with contexts up to 324 tokens went from 134 to
100 ms on a 2-core CPU. (PyTorch's CPU tuning guide suggests jemalloc or tcmalloc for the
same reason; this needs nothing installed.) The setting is process-wide, so a peer
measured in the same process (`llmlab bench offline --hf`) gets it too.
"""
from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20    # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = 256 << 20   # keep up to this much free memory at the top of the heap

_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's thresholds once per process; True if they are set (Linux with glibc)."""
    global _done
    if not _done and platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        try:
            libc = ctypes.CDLL("libc.so.6")
            _done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                         and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
        except (OSError, AttributeError):
            _done = False
    return _done
