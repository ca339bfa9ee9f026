"""Exercise 09, the block allocator: a spec, one behaviour per test."""
import random
from collections import Counter

import pytest

EXERCISE = "ex09_block_allocator"


def check_invariants(allocator):
    """What must hold after every operation."""
    holders = Counter(block for table in allocator.block_tables.values() for block in table)
    for block in range(allocator.num_blocks):
        assert allocator.ref_counts[block] == holders[block], f"block {block}'s reference count"
    assert sorted(allocator.free_blocks) == [b for b in range(allocator.num_blocks) if holders[b] == 0]
    for seq_id, table in allocator.block_tables.items():
        assert len(table) == -(-allocator.seq_lens[seq_id] // allocator.block_size), f"sequence {seq_id}'s table"
        assert len(set(table)) == len(table), f"sequence {seq_id} holds a block twice"


def slot_of(allocator, seq_id, position):
    bs = allocator.block_size
    return allocator.block_tables[seq_id][position // bs] * bs + position % bs


def test_allocate(ex):
    allocator = ex.BlockAllocator(num_blocks=8, block_size=4)
    table = allocator.allocate(0, 10)                       # 10 tokens: 3 blocks of 4
    assert len(table) == 3 and len(set(table)) == 3
    assert table == allocator.block_tables[0] and allocator.seq_lens[0] == 10
    assert allocator.num_free_blocks == 5
    assert allocator.allocate(1, 8) and len(allocator.block_tables[1]) == 2   # exactly two full blocks
    assert not set(allocator.block_tables[0]) & set(allocator.block_tables[1])
    assert allocator.allocate(2, 0) == []                   # an empty sequence holds nothing yet
    check_invariants(allocator)


def test_append_slot(ex):
    allocator = ex.BlockAllocator(num_blocks=8, block_size=4)
    allocator.allocate(0, 3)
    slot, copy = allocator.append_slot(0)                   # position 3: the last slot of block 0
    assert copy is None and slot == slot_of(allocator, 0, 3)
    assert allocator.seq_lens[0] == 4 and len(allocator.block_tables[0]) == 1
    slot, copy = allocator.append_slot(0)                   # position 4: block 0 is full, a new block
    assert copy is None and len(allocator.block_tables[0]) == 2 and slot == slot_of(allocator, 0, 4)
    assert allocator.num_free_blocks == 6
    check_invariants(allocator)


def test_append_to_an_empty_sequence(ex):
    allocator = ex.BlockAllocator(num_blocks=2, block_size=4)
    allocator.allocate(0, 0)
    slot, copy = allocator.append_slot(0)
    assert copy is None and allocator.block_tables[0] and slot == slot_of(allocator, 0, 0)
    check_invariants(allocator)


def test_free(ex):
    allocator = ex.BlockAllocator(num_blocks=4, block_size=4)
    allocator.allocate(0, 9)
    allocator.free(0)
    assert allocator.num_free_blocks == 4 and 0 not in allocator.block_tables and 0 not in allocator.seq_lens
    allocator.allocate(1, 16)                               # the freed blocks can be used again
    check_invariants(allocator)


def test_fork_shares_every_block(ex):
    allocator = ex.BlockAllocator(num_blocks=8, block_size=4)
    allocator.allocate(0, 6)
    allocator.fork(0, 1)
    assert allocator.block_tables[1] == allocator.block_tables[0] and allocator.seq_lens[1] == 6
    assert allocator.block_tables[1] is not allocator.block_tables[0], "the child needs its own table"
    assert all(allocator.ref_counts[b] == 2 for b in allocator.block_tables[0])
    assert allocator.num_free_blocks == 6                   # forking copies nothing
    allocator.free(1)                                        # the parent still holds every block
    assert all(allocator.ref_counts[b] == 1 for b in allocator.block_tables[0])
    assert allocator.num_free_blocks == 6
    allocator.free(0)
    assert allocator.num_free_blocks == 8
    check_invariants(allocator)


def test_copy_on_write_of_a_shared_last_block(ex):
    allocator = ex.BlockAllocator(num_blocks=8, block_size=4)
    allocator.allocate(0, 6)                                # blocks [a, b]; b holds 2 of its 4 tokens
    first, shared = allocator.block_tables[0]
    allocator.fork(0, 1)
    slot, copy = allocator.append_slot(1)                   # writing into b would clobber the parent's slot 6
    new = allocator.block_tables[1][1]
    assert new != shared and copy == (shared, new), "copy the shared block's rows into a fresh block"
    assert slot == new * 4 + 2
    assert allocator.block_tables[0] == [first, shared]     # the parent keeps its blocks
    assert allocator.block_tables[1] == [first, new]        # the full first block stays shared
    assert allocator.ref_counts[first] == 2 and allocator.ref_counts[shared] == 1 and allocator.ref_counts[new] == 1
    slot, copy = allocator.append_slot(0)                   # b is the parent's alone now: no copy
    assert copy is None and slot == shared * 4 + 2
    check_invariants(allocator)


def test_no_copy_when_the_shared_last_block_is_full(ex):
    allocator = ex.BlockAllocator(num_blocks=8, block_size=4)
    allocator.allocate(0, 8)
    allocator.fork(0, 1)
    slot, copy = allocator.append_slot(1)                   # the next token starts a new block anyway
    assert copy is None and allocator.block_tables[1][:2] == allocator.block_tables[0]
    assert slot == slot_of(allocator, 1, 8) and allocator.block_tables[1][2] not in allocator.block_tables[0]
    check_invariants(allocator)


def snapshot(allocator):
    return (sorted(allocator.free_blocks), list(allocator.ref_counts),
            {s: list(t) for s, t in allocator.block_tables.items()}, dict(allocator.seq_lens))


def test_out_of_blocks_changes_nothing(ex):
    allocator = ex.BlockAllocator(num_blocks=3, block_size=4)
    allocator.allocate(0, 6)                                # 2 blocks, 1 free
    before = snapshot(allocator)
    with pytest.raises(ex.OutOfBlocksError):
        allocator.allocate(1, 5)                            # needs 2
    assert snapshot(allocator) == before and 1 not in allocator.block_tables

    allocator.fork(0, 1)
    allocator.append_slot(1)                                # copy-on-write takes the last free block
    assert allocator.num_free_blocks == 0
    allocator.append_slot(0)                                # in place: the parent's last block is its own again
    allocator.append_slot(0)                                # position 7, the last slot of that block
    before = snapshot(allocator)
    with pytest.raises(ex.OutOfBlocksError):
        allocator.append_slot(0)                            # position 8 needs a new block
    assert snapshot(allocator) == before
    assert issubclass(ex.OutOfBlocksError, RuntimeError)


def test_out_of_blocks_on_a_new_block_and_on_copy_on_write(ex):
    allocator = ex.BlockAllocator(num_blocks=2, block_size=4)
    allocator.allocate(0, 4)                                # one full block
    allocator.fork(0, 1)
    allocator.append_slot(0)                                # the parent starts block 2: no free block left
    before = snapshot(allocator)
    with pytest.raises(ex.OutOfBlocksError):
        allocator.append_slot(1)                            # the child needs a new block too
    assert snapshot(allocator) == before

    allocator = ex.BlockAllocator(num_blocks=2, block_size=4)
    allocator.allocate(0, 6)                                # both blocks; the last is half full
    allocator.fork(0, 1)
    before = snapshot(allocator)
    with pytest.raises(ex.OutOfBlocksError):
        allocator.append_slot(1)                            # copy-on-write needs a free block
    assert snapshot(allocator) == before


def test_random_workload_keeps_the_invariants(ex):
    """Parallel sampling in miniature: random prompts, forks, appends and frees. No slot
    is ever written by two sequences, and no block leaks."""
    rng = random.Random(0)
    allocator = ex.BlockAllocator(num_blocks=24, block_size=4)
    next_id = 0
    for _ in range(400):
        live = list(allocator.block_tables)
        op = rng.choice(["allocate", "append", "append", "append", "fork", "free"] if live else ["allocate"])
        try:
            if op == "allocate":
                allocator.allocate(next_id, rng.randint(0, 12))
                next_id += 1
            elif op == "fork":
                allocator.fork(rng.choice(live), next_id)
                next_id += 1
            elif op == "free":
                allocator.free(rng.choice(live))
            else:
                seq_id = rng.choice(live)
                position = allocator.seq_lens[seq_id]
                slot, copy = allocator.append_slot(seq_id)
                assert slot == slot_of(allocator, seq_id, position)
                block = slot // allocator.block_size
                assert allocator.ref_counts[block] == 1, "a written block must belong to the writer alone"
                if copy is not None:
                    assert copy[1] == block and allocator.ref_counts[copy[0]] >= 1
        except ex.OutOfBlocksError:
            pass
        check_invariants(allocator)
    for seq_id in list(allocator.block_tables):
        allocator.free(seq_id)
    assert allocator.num_free_blocks == 24
