"""Exercise 09 -- the KV-cache block allocator: allocate, append a slot, fork, free,
with reference counts and copy-on-write.  Difficulty: ** (no Triton; Python only)

Read first: notebooks/04_paged_kv_cache.ipynb (and llmlab/cache/block_manager.py, the
engine's version, which shares full prefix blocks instead of forking; it is also exercise
13's answer: leave it for after that one if you mean to write it).

Task
    PagedAttention (Kwon et al., 2023) stores each sequence's KV cache in fixed-size
    blocks of block_size token slots, anywhere in a pool of num_blocks; a sequence's
    block table lists its blocks in order, so token position p lives in slot

        block_table[p // block_size] * block_size + p % block_size.

    Write the methods of `BlockAllocator`:
      allocate(seq_id, num_tokens)  a new sequence holding num_tokens tokens (its prompt):
                                    take ceil(num_tokens / block_size) free blocks.
      append_slot(seq_id)           room for one more token; returns (slot, copy). A new
                                    block is taken when the last one is full. If the last
                                    block is partly filled and shared with a fork, the
                                    sequence must not write into it: copy-on-write -- take
                                    a fresh block, return copy = (shared_block, new_block)
                                    (the engine copies its rows), and use the new block.
                                    Otherwise copy is None.
      fork(parent_id, child_id)     the child shares all of the parent's blocks (parallel
                                    sampling, beam search): no copying, reference counts +1.
      free(seq_id)                  drop the sequence; a block returns to the free list
                                    when its reference count reaches 0.
    When there are not enough free blocks, raise OutOfBlocksError and change nothing.

State (already set up in __init__; the grader reads it)
    free_blocks  list of block ids no sequence uses
    ref_counts   ref_counts[b] = how many sequences' block tables hold block b
    block_tables block_tables[seq_id] = that sequence's blocks, in order
    seq_lens     seq_lens[seq_id] = tokens it holds

Hints
    - Blocks needed for n tokens: -(-n // block_size) (ceil division).
    - In append_slot, the new token's position is seq_lens[seq_id] (before the append);
      position % block_size == 0 means the last block is full (or there is none).
    - Check for free blocks before changing anything.

Grade: `make grade`, or `pytest tests/exercises/test_ex09_block_allocator.py --impl=exercises`.
"""
from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """Not enough free blocks for the operation; the allocator is left unchanged."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes 0, 1, ...
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def _take_block(self) -> int:
        block = self.free_blocks.pop()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Blocks for a new sequence of num_tokens tokens; returns its block table."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        needed = -(-num_tokens // self.block_size)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(f"need {needed} blocks, {self.num_free_blocks} free")
        self.block_tables[seq_id] = [self._take_block() for _ in range(needed)]
        self.seq_lens[seq_id] = num_tokens
        return self.block_tables[seq_id]

    def append_slot(self, seq_id: int) -> tuple[int, tuple[int, int] | None]:
        """Room for the sequence's next token: returns (its slot, a (source, destination)
        block copy to make first, or None)."""
        table = self.block_tables[seq_id]
        position = self.seq_lens[seq_id]
        offset = position % self.block_size
        copy = None
        if offset == 0:
            # the last block is full (or there is none yet): start a new one
            if self.num_free_blocks == 0:
                raise OutOfBlocksError("no free block for the next token")
            table.append(self._take_block())
        elif self.ref_counts[table[-1]] > 1:
            # Copy-on-write: the partly filled last block is shared with a fork, whose
            # token would be overwritten. Write into a private copy instead.
            if self.num_free_blocks == 0:
                raise OutOfBlocksError("no free block for copy-on-write")
            shared = table[-1]
            table[-1] = self._take_block()
            self.ref_counts[shared] -= 1  # still >= 1: the other sequence keeps it
            copy = (shared, table[-1])
        self.seq_lens[seq_id] = position + 1
        return table[-1] * self.block_size + offset, copy

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child starts as a copy of the parent that shares every block."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        self.block_tables[child_id] = list(self.block_tables[parent_id])
        self.seq_lens[child_id] = self.seq_lens[parent_id]
        for block in self.block_tables[child_id]:
            self.ref_counts[block] += 1

    def free(self, seq_id: int) -> None:
        """Drop the sequence; blocks no other sequence holds become free."""
        for block in self.block_tables.pop(seq_id):
            self._release(block)
        del self.seq_lens[seq_id]
