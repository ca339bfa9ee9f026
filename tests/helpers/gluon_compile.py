"""Compile the Gluon prefill kernel for Hopper (sm_90a) on a machine without a GPU, and say
what came out, as JSON on stdout: `python -m helpers.gluon_compile HEAD_DIM:BLOCK_SIZE:STAGES ...`.

A process of its own: Triton compiles only where its interpreter is off, which llmlab's
kernels switch on at import on a machine without CUDA (interpreter.py); here torch is told
there is CUDA before anything imports Triton, so nothing switches it on."""
from __future__ import annotations

import json
import re
import sys

import torch

torch.cuda.is_available = lambda: True   # before Triton and llmlab are imported: compiled, not interpreted


def compile_for_hopper(head_dim: int, block_size: int, stages: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from llmlab.kernels.gluon import prefill_attention as gluon_prefill

    s, o, p, rows, smem = gluon_prefill._layouts(head_dim, torch.bfloat16)
    q = torch.empty(300, 32, head_dim, dtype=torch.bfloat16)
    cache = torch.empty(40, block_size, 8, head_dim, dtype=torch.bfloat16)
    q_desc = TensorDescriptor(q, [300, 32 * head_dim], [q.stride(0), 1], [gluon_prefill.BLOCK_M, head_dim], smem)
    kv_desc = TensorDescriptor(cache, [40 * block_size, 8 * head_dim], [cache.stride(1), 1], [block_size, head_dim],
                               smem)
    kernel = gluon_prefill._prefill_ws_kernel
    signature = dict(q_desc=mangle_type(q_desc), k_desc=mangle_type(kv_desc), v_desc=mangle_type(kv_desc),
                     block_tables_ptr="*i32", cu_seqlens_q_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*bf16",
                     qk_scale="fp32", stride_ot="i32", stride_oh="i32", stride_table="i32", num_seqs="i32",
                     num_queries_per_kv="i32")
    constants = dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_S=32, STAGES=stages, S_LAYOUT=s, O_LAYOUT=o,
                     P_LAYOUT=p, ROWS_LAYOUT=rows, KV_SMEM=smem, num_warps=gluon_prefill.LOADER_WARPS)
    signature.update({name: "constexpr" for name in constants})
    source = GluonASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=gluon_prefill.LOADER_WARPS))
    ptx = compiled.asm["ptx"]
    return dict(num_warps=compiled.metadata.num_warps, shared=compiled.metadata.shared,
                tma_copies=ptx.count("cp.async.bulk.tensor"), wgmma=ptx.count("wgmma.mma_async"),
                setmaxnreg_inc=sorted({int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)}),
                named_barriers=sorted({(int(b), int(n)) for b, n in re.findall(r"bar\.sync\s+(\d+),\s*(\d+);", ptx)}))


if __name__ == "__main__":
    print(json.dumps({arg: compile_for_hopper(*map(int, arg.split(":"))) for arg in sys.argv[1:]}))
