"""The Gluon prefill kernel (gluon/prefill_attention.py) compiles for Hopper (sm_90a) on a
machine without a GPU, into what its docstring says: a loader warpgroup issuing TMA copies
and two consumer warpgroups issuing warpgroup MMAs, registers moved by setmaxnreg, barriers
inside a consumer over its own 128 threads, and stages that fit in shared memory. Its
numerics are checked on a GPU (test_attention.py::test_gpu_warp_specialized_prefill_attention)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmlab.kernels.gluon import prefill_attention as gluon_prefill

pytestmark = pytest.mark.slow     # a process of its own: left out by make test-fast

HOPPER_SHARED_BYTES = 232_448      # the most shared memory a program may have on an H100 / H200
SHAPES = [(128, 16, 2), (128, 16, 3), (64, 128, 2)]   # head_dim, block_size, stages


@pytest.fixture(scope="module")
def compiled():
    if gluon_prefill.gluon is None:
        pytest.skip("this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "helpers.gluon_compile", *(":".join(map(str, s)) for s in SHAPES)],
                            capture_output=True, text=True, timeout=300, env=env,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("head_dim,block_size,stages", SHAPES)
def test_the_kernel_compiles_for_hopper_as_it_says(compiled, head_dim, block_size, stages):
    facts = compiled[f"{head_dim}:{block_size}:{stages}"]
    assert facts["num_warps"] == gluon_prefill.LOADER_WARPS + 2 * gluon_prefill.CONSUMER_WARPS
    expected_shared = 2 * head_dim * (gluon_prefill.BLOCK_M + 2 * stages * gluon_prefill.BLOCK_N)   # Q, K and V stages
    assert expected_shared <= facts["shared"] <= HOPPER_SHARED_BYTES
    assert facts["tma_copies"] == 1 + 2 * gluon_prefill.BLOCK_N // block_size   # Q, then K and V per cache block
    assert facts["wgmma"] > 0
    assert gluon_prefill.CONSUMER_REGISTERS in facts["setmaxnreg_inc"]
    assert any(barrier != 0 and threads == 128 for barrier, threads in facts["named_barriers"]), facts
