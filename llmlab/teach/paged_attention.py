"""Notebook 05, PagedAttention v1 and v2: how flash-decoding splits a context, from
`viz.decode_split_ranges` (the kernel's own loop bounds, restated)."""
from __future__ import annotations

from llmlab.teach.check import integer, right, wrong
from llmlab.viz import decode_split_ranges

BLOCK_N = 32     # the interpreter's key tiles in the notebook


def empty_splits(seq_len: int, num_splits: int, block_n: int) -> int:
    return sum(start >= end for start, end in decode_split_ranges(seq_len, num_splits, block_n))


def q1(answer):
    """With num_splits = 16 (and BLOCK_N = 32), how many of the 17-token sequence's splits read no key?"""
    count = integer(answer)
    if count == empty_splits(17, 16, BLOCK_N):
        return right("every split takes the same number of whole 32-key tiles, and 17 keys make one tile: "
                     "split 0 reads it, the rest start past the end (start >= end) and write a softmax "
                     "weight of 0 (lse = -inf).")
    if count == 16:
        return wrong("some split does read the 17 keys.")
    return wrong("print viz.decode_split_ranges(17, 16, 32): a split whose start is at or past its end reads "
                 "nothing.")


def q2(answer):
    """The H200's batch-1 case: 32768 keys, 66 splits, BLOCK_N = 64 (viz.decode_splits([32768], 66, 64)).
    How many of the 66 splits read no key?"""
    count = integer(answer)
    if count == empty_splits(32768, 66, 64):
        return right("512 tiles of 64 keys, the same whole number of tiles per split (rounded up): the last "
                     "splits run out of tiles. The programs still launch; they exit at once.")
    if count == 0:
        return wrong("splits take equal whole numbers of tiles, rounded up: does 66 x that number exceed "
                     "the tiles there are?")
    return wrong("count the ranges with start >= end in viz.decode_split_ranges(32768, 66, 64).")


def programs(batch: int, num_kv_heads: int, num_splits: int) -> int:
    return batch * num_kv_heads * num_splits      # the grid (sequence, kv head, split) of _decode_attention_kernel


def q3(answer):
    """With num_splits = 16 for the notebook's 3 sequences (4 query heads sharing 2 kv heads): how many
    programs does the decode_attention launch start (not counting combine_splits)?"""
    count = integer(answer)
    if count == programs(3, 2, 16):
        return right("one program per (sequence, kv head, split): each reads its kv head once for all the "
                     "query heads that share it.")
    if count == programs(3, 4, 16):
        return wrong("a program handles one kv head and all the query heads that share it.")
    if count == programs(3, 2, 16) + 3 * 4:
        return wrong("that includes the combine's programs; count decode_attention's grid only.")
    return wrong("the grid is printed by the launches cell: (sequences, kv heads, splits).")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3}
