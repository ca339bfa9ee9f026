"""Notebook 04, the paged KV cache: each answer is what the block playground (the engine's own
BlockManager) does."""
from __future__ import annotations

from llmlab.cache.block_manager import BlockManager
from llmlab.teach.check import integer, number, right, wrong
from llmlab.viz import BlockPlayground


def playground(num_device_blocks: int = 12) -> BlockPlayground:
    return BlockPlayground(BlockManager(num_device_blocks=num_device_blocks, num_host_blocks=6, block_size=4,
                                        enable_prefix_caching=True))


def requests_that_fit(num_tokens: int) -> int:
    pool, count = playground(), 0
    while True:
        try:
            pool.allocate(f"r{count}", num_tokens)
        except RuntimeError:      # out of KV blocks
            return count
        count += 1


def q1(answer):
    """A pool of 12 device blocks of 4 tokens, as in the first playground: how many requests with
    10-token prompts can you allocate before it says out of KV blocks?"""
    value = number(answer)
    if value == 48 / 10:
        return wrong("that divides slots by tokens; a request gets whole blocks, and its last one is "
                     "partly empty: ceil(10 / 4) blocks each.")
    if integer(answer) == requests_that_fit(10):
        return right("each takes 3 blocks (the third only half full): the pool holds 48 slots but only "
                     "that many whole requests.")
    return wrong("a 10-token prompt needs ceil(10 / 4) blocks; try it in the playground.")


def blocks_shared_by_fork(num_tokens: int) -> int:
    pool = playground()
    parent = pool.allocate("a", num_tokens)
    child = pool.fork("a", "b")
    return len(set(parent.block_table) & set(child.block_table))


def q2(answer):
    """Fork a request of 12 tokens (a multiple of 4, so all its blocks are full): how many blocks does
    the fork share with its parent?"""
    count = integer(answer)
    if count == blocks_shared_by_fork(12):
        return right("a request always computes at least its last prompt token (its logits give the next "
                     "token), so the block holding that token is computed again, in a block of its own.")
    if count == 12 // 4:
        return wrong("all three are full, but is the last one found in the cache? What must a new request "
                     "always compute itself? Try it in the playground.")
    return wrong("fork a 12-token request in the playground and compare the two rows of the block table.")


def blocks_after_decoding(prompt_tokens: int, decoded: int) -> int:
    pool = playground()
    pool.allocate("a", prompt_tokens)
    return len(pool.append("a", decoded).block_table)


def q3(answer):
    """A request with a 10-token prompt decodes 7 more tokens (block size 4): how many blocks does it hold?"""
    count = integer(answer)
    if count == blocks_after_decoding(10, 7):
        return right("17 tokens, 4 to a block: a new block opens only when the last one is full.")
    if count == blocks_after_decoding(10, 0):
        return wrong("the decoded tokens need slots too: a new block opens whenever the last one is full.")
    return wrong("count the tokens the request holds after decoding, then whole blocks of 4.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3}
