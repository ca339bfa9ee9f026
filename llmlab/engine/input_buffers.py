"""Persistent input buffers: a step's integer inputs reach the device in two copies, with no
host sync, and block tables are kept row by row instead of rebuilt.

`torch.tensor(values, device="cuda")` waits for the device to finish everything queued
before it copies. With async scheduling (engine/in_flight.py) that is the step still running,
so eight such copies per step would undo the overlap. Here every int64 input of a step
(input ids, positions, slots, logits rows) is written into one pinned host buffer and every
int32 one (cu_seqlens, sequence lengths, block tables) into another; each goes to a
persistent device buffer in one `non_blocking` copy, and the batch's tensors are views of it.
Two sets of buffers take turns: a step's host buffer is rewritten two steps later, when the
step that read it has finished. On a CPU the host buffer is the input itself.

Block tables: each request keeps a row of a host table; a step writes only the block ids
its request gained since it was last seen (a decode gains one every block_size steps) and
rewrites a row only when the block manager replaced the table (preemption, swap-in). The
batch's table is then one gather of rows.
"""
from __future__ import annotations

import itertools

import torch

from llmlab.request import Request

# every array starts at a multiple of 16 elements: Triton compiles a kernel once per pointer
# alignment class (16 bytes), so views must be aligned like freshly allocated tensors
ALIGN = 16


class BlockTableRows:
    """One int32 row per request of the block ids it had when last seen, on the host."""

    def __init__(self, width: int, num_rows: int = 64):
        self.table = torch.zeros(num_rows, max(width, 1), dtype=torch.int32)
        self.rows: dict[Request, list] = {}   # request -> [row, its block_table list, ids written]
        self.free_rows = list(range(num_rows - 1, -1, -1))

    def gather(self, requests: list[Request], out: torch.Tensor) -> torch.Tensor:
        """The requests' tables, padded to the longest, written into `out` (int32, at least
        len(requests) x width elements); returns that [len(requests), width] view."""
        rows = [self._row(request) for request in requests]
        width = max((len(r.block_table) for r in requests), default=0)
        view = out[:len(requests) * width].view(len(requests), width)
        torch.index_select(self.table[:, :width], 0, torch.tensor(rows, dtype=torch.int64), out=view)
        return view

    def _row(self, request: Request) -> int:
        entry = self.rows.get(request)
        table = request.block_table
        if entry is None:
            entry = self.rows[request] = [self._take_row(), table, 0]
        elif entry[1] is not table:   # the block manager gave the request a new table
            entry[1], entry[2] = table, 0
        row, _, written = entry
        if len(table) > written:
            if len(table) > self.table.shape[1]:
                self.table = torch.cat([self.table, torch.zeros_like(self.table)], dim=1)
            self.table[row, written:len(table)] = torch.tensor(table[written:], dtype=torch.int32)
            entry[2] = len(table)
        return row

    def _take_row(self) -> int:
        if not self.free_rows:   # rows of finished requests come back first, then the table grows
            for request in [r for r in self.rows if r.finished]:
                self.free_rows.append(self.rows.pop(request)[0])
        if not self.free_rows:
            num_rows = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self.free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self.free_rows.pop()


class InputBuffers:
    def __init__(self, device: torch.device, max_blocks_per_seq: int):
        self.device = device
        self.pinned = device.type == "cuda"
        self.sets = [{}, {}]   # dtype -> (host buffer, device buffer), two sets taking turns
        self.turn = 0
        self.tables = BlockTableRows(max_blocks_per_seq)

    def stage(self, longs: list[list[int]], ints: list[list[int]], table_groups: list[list[Request]]):
        """Device tensors of `longs` (int64) and `ints` (int32), then one block table
        [len(group), longest table] (int32) per group of requests, in that order."""
        buffers = self.sets[self.turn]
        self.turn ^= 1
        lengths = [len(a) for a in ints]
        table_sizes = [len(group) * max((len(r.block_table) for r in group), default=0) for group in table_groups]
        host32, device32, offsets32 = self._buffers(buffers, torch.int32, lengths + table_sizes)
        self._fill(host32, ints, offsets32)
        shapes = []
        for group, offset, size in zip(table_groups, offsets32[len(ints):], table_sizes):
            shapes.append(self.tables.gather(group, host32[offset:offset + size]).shape)
        host64, device64, offsets64 = self._buffers(buffers, torch.int64, [len(a) for a in longs])
        self._fill(host64, longs, offsets64)
        out = []
        for host, device, offsets in ((host64, device64, offsets64), (host32, device32, offsets32)):
            if device is not host:
                device[:offsets[-1]].copy_(host[:offsets[-1]], non_blocking=True)
        out += [device64[o:o + len(a)] for a, o in zip(longs, offsets64)]
        out += [device32[o:o + n] for n, o in zip(lengths, offsets32)]
        out += [device32[o:o + shape.numel()].view(shape) for shape, o in zip(shapes, offsets32[len(ints):])]
        return out

    def _buffers(self, buffers: dict, dtype: torch.dtype, lengths: list[int]):
        """(host, device, offsets): buffers of `dtype` large enough for arrays of `lengths`,
        each starting at a multiple of ALIGN; offsets ends with the total."""
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + -(-n // ALIGN) * ALIGN)
        start, total = offsets[:-1], offsets[-1]
        host, device = buffers.get(dtype, (None, None))
        if host is None or host.numel() < total:   # grows rarely: to the largest step seen
            size = max(total, 2 * host.numel() if host is not None else 4096)
            host = torch.zeros(size, dtype=dtype, pin_memory=self.pinned)
            device = host if not self.pinned else torch.zeros(size, dtype=dtype, device=self.device)
            buffers[dtype] = host, device
        return host, device, start + [total]

    @staticmethod
    def _fill(host: torch.Tensor, arrays: list[list[int]], offsets: list[int]) -> None:
        """Write the arrays at their offsets, with one tensor made from all of them."""
        if not arrays:
            return
        flat = torch.tensor(list(itertools.chain.from_iterable(arrays)), dtype=host.dtype)
        position = 0
        for values, offset in zip(arrays, offsets):
            host[offset:offset + len(values)] = flat[position:position + len(values)]
            position += len(values)
