"""How rank 0 tells the worker ranks what to run: through torch.distributed, not pipes.

Every message is a header of HEADER_LEN int64s that rank 0 broadcasts in the control group
(gloo, on the CPU, with no practical timeout: workers wait there between steps), then its
payload:

    FORWARD  the header carries the batch's shapes and flags and the micro-batch cuts; the
             batch's tensors follow as one int64 tensor, all of them flattened back to back,
             broadcast in the world group. On GPUs that is NCCL, from rank 0's device
             memory to each worker's: no host copy, no pickle, no sync on rank 0.
    SWAP     the plan's (source, destination) block copies, an int64 tensor in the control group
    CAPTURE  capture CUDA graphs of decode steps (parallel/cuda_graphs.py): the sizes in the header,
             the (batch size, splits) keys as an int64 tensor in the control group
    STOP     nothing: the worker leaves its loop and exits

The header is small and fixed-size so that a worker knows every shape before the tensors
arrive and can receive them straight into buffers of the right size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmlab.engine.parallel.placement import Groups
from llmlab.model.llama import ForwardBatch

FORWARD, SWAP, STOP, CAPTURE = 1, 2, 3, 4
HEADER_LEN = 64
MAX_MICRO_BATCHES = 8                       # 14 header slots + 4 per cut fit in HEADER_LEN
BACKENDS = (None, "reference", "torch", "triton")


@dataclass
class ForwardStep:
    """What a worker receives for a FORWARD: the whole batch and where to cut it."""
    input_ids: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]
    batch: ForwardBatch
    cuts: list[tuple[int, int, int, int]]   # pipeline.micro_batch_cuts
    num_blocks: int             # rank 0's KV cache: every rank's has as many blocks
    record: bool                # record a pipeline timeline of this step
    graphed: bool               # replay the CUDA graph of this decode batch (tensor parallel)


def _tensor_fields(num_tokens, num_prefills, prefill_width, num_decodes, decode_width, num_logits):
    """(name, shape, dtype) of each tensor of a FORWARD, in the order they are packed."""
    i32, i64 = torch.int32, torch.int64
    return [("input_ids", (num_tokens,), i64), ("positions", (num_tokens,), i64),
            ("slot_mapping", (num_tokens,), i64),
            ("prefill_cu_seqlens_q", (num_prefills + 1,), i32), ("prefill_seq_lens", (num_prefills,), i32),
            ("prefill_block_tables", (num_prefills, prefill_width), i32),
            ("decode_seq_lens", (num_decodes,), i32), ("decode_block_tables", (num_decodes, decode_width), i32),
            ("logits_indices", (num_logits,), i64)]


def broadcast_header(groups: Groups, values: list[int] | None = None) -> list[int]:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    if values is not None:
        header[:len(values)] = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(header, src=0, group=groups.control)
    return header.tolist()


# ---- rank 0 ------------------------------------------------------------------------------------

def send_forward(groups: Groups, input_ids, positions, batch: ForwardBatch, cuts, num_blocks: int,
                 record: bool, graphed: bool = False) -> None:
    if len(cuts) - 1 > MAX_MICRO_BATCHES:
        raise ValueError(f"at most {MAX_MICRO_BATCHES} micro-batches fit in a header, got {len(cuts) - 1}")
    shapes = [input_ids.shape[0], batch.prefill_seq_lens.shape[0], batch.prefill_block_tables.shape[1],
              batch.decode_seq_lens.shape[0], batch.decode_block_tables.shape[1], batch.logits_indices.shape[0]]
    broadcast_header(groups, [FORWARD, *shapes, batch.num_prefill_tokens, batch.num_splits,
                               BACKENDS.index(batch.backend), num_blocks, int(record), int(graphed), len(cuts),
                               *(value for cut in cuts for value in cut)])
    tensors = {"input_ids": input_ids, "positions": positions}
    packed = torch.cat([(tensors[name] if name in tensors else getattr(batch, name)).reshape(-1).to(torch.int64)
                        for name, _, _ in _tensor_fields(*shapes)])
    dist.broadcast(packed, src=0)


def send_swap(groups: Groups, swap_out_copies, swap_in_copies) -> None:
    broadcast_header(groups, [SWAP, len(swap_out_copies), len(swap_in_copies)])
    pairs = torch.tensor([list(pair) for pair in (*swap_out_copies, *swap_in_copies)], dtype=torch.int64)
    if pairs.numel():
        dist.broadcast(pairs.reshape(-1), src=0, group=groups.control)


def send_capture(groups: Groups, max_num_seqs: int, max_blocks_per_seq: int, num_blocks: int, backend,
                 keys) -> None:
    keys = sorted(keys)
    broadcast_header(groups, [CAPTURE, max_num_seqs, max_blocks_per_seq, num_blocks, BACKENDS.index(backend),
                              len(keys)])
    if keys:
        dist.broadcast(torch.tensor(keys, dtype=torch.int64).reshape(-1), src=0, group=groups.control)


def send_stop(groups: Groups) -> None:
    broadcast_header(groups, [STOP])


# ---- a worker ----------------------------------------------------------------------------------

def receive(groups: Groups, device: torch.device):
    """Wait for rank 0's next message: ("forward", ForwardStep), ("swap", swap-out copies,
    swap-in copies), ("capture", max_num_seqs, max_blocks_per_seq, num_blocks, backend,
    keys) or ("stop",)."""
    header = broadcast_header(groups)
    op = header[0]
    if op == STOP:
        return ("stop",)
    if op == SWAP:
        num_out, num_in = header[1], header[2]
        pairs = torch.empty(2 * (num_out + num_in), dtype=torch.int64)
        if pairs.numel():
            dist.broadcast(pairs, src=0, group=groups.control)
        pairs = [tuple(pair) for pair in pairs.reshape(-1, 2).tolist()]
        return ("swap", pairs[:num_out], pairs[num_out:])
    if op == CAPTURE:
        max_num_seqs, max_blocks_per_seq, num_blocks, backend, num_keys = header[1:6]
        keys = torch.empty(2 * num_keys, dtype=torch.int64)
        if num_keys:
            dist.broadcast(keys, src=0, group=groups.control)
        return ("capture", max_num_seqs, max_blocks_per_seq, num_blocks, BACKENDS[backend],
                [tuple(key) for key in keys.reshape(-1, 2).tolist()])
    if op != FORWARD:
        raise ValueError(f"unknown message {op} from rank 0")
    shapes = header[1:7]
    num_prefill_tokens, num_splits, backend, num_blocks, record, graphed, num_cuts = header[7:14]
    cuts = [tuple(header[14 + 4 * i:18 + 4 * i]) for i in range(num_cuts)]
    fields = _tensor_fields(*shapes)
    packed = torch.empty(sum(torch.Size(shape).numel() for _, shape, _ in fields), dtype=torch.int64, device=device)
    dist.broadcast(packed, src=0)
    tensors, offset = {}, 0
    for name, shape, dtype in fields:
        size = torch.Size(shape).numel()
        tensors[name] = packed[offset:offset + size].reshape(shape).to(dtype)
        offset += size
    input_ids, positions = tensors.pop("input_ids"), tensors.pop("positions")
    batch = ForwardBatch(num_prefill_tokens=num_prefill_tokens, num_splits=num_splits, backend=BACKENDS[backend],
                         **tensors)
    return ("forward", ForwardStep(input_ids, positions, batch, cuts, num_blocks, bool(record), bool(graphed)))
