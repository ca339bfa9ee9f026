"""Exercise 09, the block allocator: a spec, one behaviour per test. Every check fails with
the case that broke, what differs and what to check (diagnose.fail), never a bare assert."""
import random
from collections import Counter

import pytest

from diagnose import fail

EXERCISE = "ex09_block_allocator"


def expect(ok, case: str, what: str, hint: str) -> None:
    """Fail `case` saying what is wrong and what to check, unless `ok`."""
    if not ok:
        fail(case, [what, f"-> {hint}"])


def check_invariants(allocator, case: str) -> None:
    """What must hold after every operation: reference counts count the block tables that
    hold a block, the free list holds exactly the blocks nobody holds (each once), and each
    table has the blocks its sequence's tokens need."""
    holders = Counter(block for table in allocator.block_tables.values() for block in table)
    for seq_id, table in allocator.block_tables.items():
        twice = sorted(b for b, n in Counter(table).items() if n > 1)
        expect(not twice, case, f"sequence {seq_id} holds block(s) {twice} twice: {table}",
               "a table lists each of its blocks once; take a fresh block from free_blocks for new room")
    free_counts = Counter(allocator.free_blocks)
    twice = sorted(b for b, n in free_counts.items() if n > 1)
    expect(not twice, case, f"block(s) {twice} are in free_blocks twice",
           "a block was freed twice: it goes back to free_blocks once, when its reference count reaches 0 "
           "(in free, release each block of the table once; don't append a block whose count is still above 0)")
    for block in range(allocator.num_blocks):
        count, held = allocator.ref_counts[block], holders[block]
        owners = sorted(s for s, table in allocator.block_tables.items() if block in table)
        if count < held:
            expect(False, case, f"block {block}: reference count {count}, but {held} block tables hold it "
                                f"(sequences {owners})",
                   "fork adds 1 to the count of every block the child shares (the parent's whole table)")
        if count > held:
            expect(False, case, f"block {block}: reference count {count}, but {held} block tables hold it "
                                f"(sequences {owners})",
                   "free takes 1 off every block of the freed table; copy-on-write takes 1 off the shared "
                   "block it stops using")
        if held and block in free_counts:
            expect(False, case, f"block {block} is in free_blocks while sequences {owners} hold it",
                   "a block returns to free_blocks only when its reference count reaches 0 (a fork's blocks are "
                   "still the other sequence's); take blocks out of free_blocks when you hand them out")
        if not held and block not in free_counts:
            expect(False, case, f"block {block} is held by no sequence but is not in free_blocks: it leaked",
                   "free (and copy-on-write) must return each block whose reference count reaches 0 to free_blocks")
    for seq_id, table in allocator.block_tables.items():
        tokens = allocator.seq_lens.get(seq_id)
        expect(tokens is not None and len(table) == -(-tokens // allocator.block_size), case,
               f"sequence {seq_id} holds {len(table)} blocks for {tokens} tokens "
               f"(blocks of {allocator.block_size} tokens)",
               "a sequence of n tokens holds ceil(n / block_size) blocks; seq_lens counts its tokens")


def slot_of(allocator, seq_id, position):
    bs = allocator.block_size
    return allocator.block_tables[seq_id][position // bs] * bs + position % bs


def test_allocate(ex):
    case = "allocate 10, 8 and 0 tokens (blocks of 4)"
    allocator = ex.BlockAllocator(num_blocks=8, block_size=4)
    table = allocator.allocate(0, 10)
    expect(isinstance(table, list) and len(table) == 3 and len(set(table)) == 3, case,
           f"allocate(0, 10) returned {table!r}", "10 tokens need ceil(10 / 4) = 3 distinct blocks: return them")
    expect(table == allocator.block_tables[0] and allocator.seq_lens[0] == 10, case,
           f"block_tables[0] = {allocator.block_tables.get(0)}, seq_lens[0] = {allocator.seq_lens.get(0)}",
           "record the new table in block_tables and the tokens in seq_lens")
    expect(allocator.num_free_blocks == 5, case, f"{allocator.num_free_blocks} blocks free after taking 3 of 8",
           "take the blocks out of free_blocks")
    allocator.allocate(1, 8)
    expect(len(allocator.block_tables[1]) == 2, case,
           f"8 tokens got {len(allocator.block_tables[1])} blocks", "exactly two full blocks: ceil(8 / 4) = 2")
    shared = set(allocator.block_tables[0]) & set(allocator.block_tables[1])
    expect(not shared, case, f"sequences 0 and 1 both got block(s) {sorted(shared)}",
           "a new sequence takes blocks nobody holds")
    empty = allocator.allocate(2, 0)
    expect(empty == [], case, f"allocate(2, 0) returned {empty!r}", "an empty sequence holds no block yet")
    check_invariants(allocator, case)


def test_append_slot(ex):
    case = "append to a sequence of 3 tokens (blocks of 4)"
    allocator = ex.BlockAllocator(num_blocks=8, block_size=4)
    allocator.allocate(0, 3)
    slot, copy = allocator.append_slot(0)                   # position 3: the last slot of block 0
    expect(copy is None and slot == slot_of(allocator, 0, 3), case,
           f"position 3 got slot {slot}, copy {copy}; expected slot {slot_of(allocator, 0, 3)}, no copy",
           "the slot is block_table[p // block_size] * block_size + p % block_size, p = seq_lens before the append")
    expect(allocator.seq_lens[0] == 4 and len(allocator.block_tables[0]) == 1, case,
           f"after it: seq_lens {allocator.seq_lens[0]}, {len(allocator.block_tables[0])} blocks",
           "block 0 had room for a 4th token: no new block; seq_lens grows by 1")
    slot, copy = allocator.append_slot(0)                   # position 4: block 0 is full, a new block
    expect(copy is None and len(allocator.block_tables[0]) == 2 and slot == slot_of(allocator, 0, 4), case,
           f"position 4 got slot {slot}, copy {copy}, {len(allocator.block_tables[0])} blocks",
           "position % block_size == 0: the last block is full, take a new one and write at its slot 0")
    expect(allocator.num_free_blocks == 6, case, f"{allocator.num_free_blocks} blocks free, expected 6",
           "the new block comes out of free_blocks")
    check_invariants(allocator, case)


def test_append_to_an_empty_sequence(ex):
    case = "append to an empty sequence"
    allocator = ex.BlockAllocator(num_blocks=2, block_size=4)
    allocator.allocate(0, 0)
    slot, copy = allocator.append_slot(0)
    expect(copy is None and allocator.block_tables[0] and slot == slot_of(allocator, 0, 0), case,
           f"got slot {slot}, copy {copy}, table {allocator.block_tables[0]}",
           "position 0 of a sequence with no block: take a block (0 % block_size == 0) and write at its slot 0")
    check_invariants(allocator, case)


def test_free(ex):
    case = "free a sequence of 9 tokens, then allocate 16"
    allocator = ex.BlockAllocator(num_blocks=4, block_size=4)
    allocator.allocate(0, 9)
    allocator.free(0)
    expect(0 not in allocator.block_tables and 0 not in allocator.seq_lens, case,
           "sequence 0 is still in block_tables or seq_lens", "free drops the sequence from both")
    check_invariants(allocator, case)                       # names a block freed twice, or never
    expect(allocator.num_free_blocks == 4, case, f"{allocator.num_free_blocks} of 4 blocks free after the free",
           "free returns every block whose reference count reaches 0 to free_blocks")
    allocator.allocate(1, 16)                               # the freed blocks can be used again
    check_invariants(allocator, case)


def test_fork_shares_every_block(ex):
    case = "fork a sequence of 6 tokens, free the child, then the parent"
    allocator = ex.BlockAllocator(num_blocks=8, block_size=4)
    allocator.allocate(0, 6)
    allocator.fork(0, 1)
    expect(allocator.block_tables.get(1) == allocator.block_tables[0] and allocator.seq_lens.get(1) == 6, case,
           f"the child has table {allocator.block_tables.get(1)} and {allocator.seq_lens.get(1)} tokens; "
           f"the parent {allocator.block_tables[0]} and 6",
           "the child starts with the parent's blocks, in order, and its number of tokens")
    expect(allocator.block_tables[1] is not allocator.block_tables[0], case,
           "the child's table is the parent's list object",
           "give the child its own table (list(parent_table)): appending to one must not change the other")
    counts = [allocator.ref_counts[b] for b in allocator.block_tables[0]]
    expect(counts == [2, 2], case, f"after the fork the shared blocks' reference counts are {counts}, expected [2, 2]",
           "fork adds 1 to the count of every block the child shares")
    expect(allocator.num_free_blocks == 6, case, f"{allocator.num_free_blocks} blocks free after the fork, expected 6",
           "forking copies nothing: it takes no block")
    check_invariants(allocator, case)
    allocator.free(1)                                        # the parent still holds every block
    counts = [allocator.ref_counts[b] for b in allocator.block_tables[0]]
    expect(counts == [1, 1] and allocator.num_free_blocks == 6, case,
           f"after freeing the child: counts {counts}, {allocator.num_free_blocks} blocks free "
           "(expected [1, 1] and 6)",
           "freeing the child takes 1 off each shared block; a block is free only at 0 (the parent holds them)")
    check_invariants(allocator, case)
    allocator.free(0)
    expect(allocator.num_free_blocks == 8, case, f"{allocator.num_free_blocks} of 8 blocks free after both",
           "the parent's free brings its blocks to 0: back to free_blocks")
    check_invariants(allocator, case)


def test_copy_on_write_of_a_shared_last_block(ex):
    case = "append to a fork whose last block is shared and half full"
    allocator = ex.BlockAllocator(num_blocks=8, block_size=4)
    allocator.allocate(0, 6)                                # blocks [a, b]; b holds 2 of its 4 tokens
    first, shared = allocator.block_tables[0]
    allocator.fork(0, 1)
    slot, copy = allocator.append_slot(1)                   # writing into b would clobber the parent's slot 6
    new = allocator.block_tables[1][1]
    expect(new != shared and copy == (shared, new), case,
           f"the child's last block is {new} (the shared one was {shared}), copy {copy}",
           "the child must not write into a shared block: take a fresh one and return copy = (shared, fresh)")
    expect(slot == new * 4 + 2, case, f"slot {slot}, expected {new * 4 + 2}",
           "the token goes to the same row of the fresh block (position 6: row 2)")
    expect(allocator.block_tables[0] == [first, shared], case,
           f"the parent's table became {allocator.block_tables[0]}", "copy-on-write changes the writer's table only")
    expect(allocator.block_tables[1] == [first, new], case, f"the child's table is {allocator.block_tables[1]}",
           "only the partly filled last block is copied: the full first block stays shared")
    counts = (allocator.ref_counts[first], allocator.ref_counts[shared], allocator.ref_counts[new])
    expect(counts == (2, 1, 1), case, f"reference counts of the first, the old and the fresh block: {counts}, "
                                      "expected (2, 1, 1)",
           "the child stops using the shared block: take 1 off it; the fresh block starts at 1")
    slot, copy = allocator.append_slot(0)                   # b is the parent's alone now: no copy
    expect(copy is None and slot == shared * 4 + 2, case,
           f"the parent's append got slot {slot}, copy {copy}; expected slot {shared * 4 + 2}, no copy",
           "a block whose reference count is 1 is written in place")
    check_invariants(allocator, case)


def test_no_copy_when_the_shared_last_block_is_full(ex):
    case = "append to a fork whose shared last block is full"
    allocator = ex.BlockAllocator(num_blocks=8, block_size=4)
    allocator.allocate(0, 8)
    allocator.fork(0, 1)
    slot, copy = allocator.append_slot(1)                   # the next token starts a new block anyway
    expect(copy is None and allocator.block_tables[1][:2] == allocator.block_tables[0], case,
           f"copy {copy}, the child's table {allocator.block_tables[1]}",
           "a full last block is never written again: no copy, the child takes a new block after it")
    expect(slot == slot_of(allocator, 1, 8) and allocator.block_tables[1][2] not in allocator.block_tables[0], case,
           f"slot {slot}, the child's table {allocator.block_tables[1]}",
           "position 8 starts a new block of the child's own")
    check_invariants(allocator, case)


def snapshot(allocator):
    return (sorted(allocator.free_blocks), list(allocator.ref_counts),
            {s: list(t) for s, t in allocator.block_tables.items()}, dict(allocator.seq_lens))


def expect_out_of_blocks(ex, allocator, operation, case):
    """`operation()` raises OutOfBlocksError and leaves the allocator as it was."""
    before = snapshot(allocator)
    try:
        operation()
    except ex.OutOfBlocksError:
        pass
    else:
        fail(case, ["no OutOfBlocksError", "-> when there are not enough free blocks, raise OutOfBlocksError"])
    expect(snapshot(allocator) == before, case, "the allocator changed before OutOfBlocksError was raised",
           "check for free blocks before changing anything (free_blocks, ref_counts, tables, seq_lens)")


def test_out_of_blocks_changes_nothing(ex):
    allocator = ex.BlockAllocator(num_blocks=3, block_size=4)
    allocator.allocate(0, 6)                                # 2 blocks, 1 free
    expect_out_of_blocks(ex, allocator, lambda: allocator.allocate(1, 5), "allocate 2 blocks with 1 free")
    expect(1 not in allocator.block_tables, "allocate 2 blocks with 1 free", "sequence 1 exists after the refusal",
           "a refused allocate adds no sequence")
    allocator.fork(0, 1)
    allocator.append_slot(1)                                # copy-on-write takes the last free block
    allocator.append_slot(0)                                # in place: the parent's last block is its own again
    allocator.append_slot(0)                                # position 7, the last slot of that block
    expect_out_of_blocks(ex, allocator, lambda: allocator.append_slot(0), "append past a full block with none free")
    expect(issubclass(ex.OutOfBlocksError, RuntimeError), "OutOfBlocksError", "it is not a RuntimeError",
           "keep the exercise's `class OutOfBlocksError(RuntimeError)`")


def test_out_of_blocks_on_a_new_block_and_on_copy_on_write(ex):
    allocator = ex.BlockAllocator(num_blocks=2, block_size=4)
    allocator.allocate(0, 4)                                # one full block
    allocator.fork(0, 1)
    allocator.append_slot(0)                                # the parent starts block 2: no free block left
    expect_out_of_blocks(ex, allocator, lambda: allocator.append_slot(1), "a fork's new block with none free")

    allocator = ex.BlockAllocator(num_blocks=2, block_size=4)
    allocator.allocate(0, 6)                                # both blocks; the last is half full
    allocator.fork(0, 1)
    expect_out_of_blocks(ex, allocator, lambda: allocator.append_slot(1), "copy-on-write with no free block")


def test_random_workload_keeps_the_invariants(ex):
    """Parallel sampling in miniature: random prompts, forks, appends and frees. No slot
    is ever written by two sequences, and no block leaks."""
    rng = random.Random(0)
    allocator = ex.BlockAllocator(num_blocks=24, block_size=4)
    next_id = 0
    for step in range(400):
        live = list(allocator.block_tables)
        op = rng.choice(["allocate", "append", "append", "append", "fork", "free"] if live else ["allocate"])
        case = f"random workload, operation {step} ({op})"
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
                expect(slot == slot_of(allocator, seq_id, position), case,
                       f"sequence {seq_id}'s position {position} got slot {slot}, its table says "
                       f"{slot_of(allocator, seq_id, position)}",
                       "the slot is block_table[p // block_size] * block_size + p % block_size")
                block = slot // allocator.block_size
                expect(allocator.ref_counts[block] == 1, case,
                       f"sequence {seq_id} writes into block {block}, whose reference count is "
                       f"{allocator.ref_counts[block]}", "a written block must belong to the writer alone: "
                       "copy a shared partly filled last block first (copy-on-write)")
                if copy is not None:
                    expect(copy[1] == block and allocator.ref_counts[copy[0]] >= 1, case,
                           f"copy {copy} for a write into block {block}",
                           "copy = (the shared block, the fresh block the token is written to)")
        except ex.OutOfBlocksError:
            pass
        check_invariants(allocator, case)
    for seq_id in list(allocator.block_tables):
        allocator.free(seq_id)
    expect(allocator.num_free_blocks == 24, "random workload, everything freed",
           f"{allocator.num_free_blocks} of 24 blocks free", "free returns every block once its count reaches 0")
