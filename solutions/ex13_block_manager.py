"""Exercise 13 -- the engine's block manager: allocation, reference counts, the prefix
cache (a hash chain of full blocks, LRU eviction of cached free blocks) and swapping.
Difficulty: *** (no Triton; Python only; about 90 minutes)

Read first: notebooks/04_paged_kv_cache.ipynb and notebooks/09_prefix_caching.ipynb;
exercise 09 (your allocator grows into this one). Use: `Request` (llmlab/request.py:
block_table, block_hashes, num_cached_blocks, num_computed_tokens, num_tokens,
token_ids_between, prompt_logprobs). Nothing else of llmlab/ is needed.

Task
    This is the class the engine's scheduler calls (llmlab/cache/block_manager.py has the
    same API, and is this exercise's answer: read it after yours passes). A request's `block_table[i]` is the block holding its tokens
    i*block_size .. (i+1)*block_size - 1. Full blocks are shared between requests through
    the prefix cache (vLLM's automatic prefix caching): block i's hash covers every token up
    to the end of block i -- hash((hash of block i-1, tuple of the block's tokens)), block 0
    chained from None -- so equal hashes mean equal prefixes. A shared block is never
    written again (no copy-on-write).
    Write:
      _take_block()          a free block with reference count 1: from free_blocks, or, when
                             none is left, the least recently used evictable block (forget
                             its hash: it is no longer cached).
      allocate(request, n)   grow the table to hold n tokens; RuntimeError (nothing changed)
                             when there are not enough free blocks (evictable ones count).
      free(request)          drop its references (last block first); a block at 0 goes to
                             `evictable` (LRU order, newest last) when it has a hash, else to
                             free_blocks. Empty the table, num_cached_blocks = 0.
      block_hashes(request, k)   the hash chain of its first k full blocks, kept on
                             request.block_hashes (each block is hashed once).
      match_prefix(request)  share the cached blocks of a new request's prompt prefix (at
                             most (num_tokens - 1) // block_size blocks: one token is always
                             left to compute), stopping at the first block not cached: they
                             become its block_table, in order (num_cached_blocks = how many),
                             one reference more each; returns the tokens found (the
                             scheduler sets num_computed_tokens from it, not you). A block
                             taken out of `evictable` must leave it. Counts the blocks it
                             could have found in prefix_queries, those found in prefix_hits.
                             A request with a block table already, or prompt_logprobs, finds
                             nothing (and counts nothing).
      cache_full_blocks(request)   register the blocks that filled since the last call
                             (num_computed_tokens // block_size full blocks).
      swap_out(request)      copy its blocks to host blocks, free the device ones; returns
                             [(device, host)]. swap_in(request): fresh device blocks for its
                             host blocks, returns [(host, device)], the host blocks free again.
    With enable_prefix_caching=False nothing is hashed, matched or cached.

State (set up in __init__; the grader and the engine read it)
    free_blocks, ref_counts       as in exercise 09
    block_hash[b]                 the hash block b is cached under, or None
    cached_blocks                 hash -> block id
    evictable                     OrderedDict of cached blocks no request holds, LRU first
    free_host_blocks, host_tables swapped request id -> its host blocks
    prefix_queries, prefix_hits   blocks looked up / found by match_prefix

Hints
    - Every block is in exactly one place: held (ref_counts > 0), free_blocks, or evictable.
    - match_prefix: a matched block whose count was 0 is in `evictable`; take it out before
      counting it, or a later _take_block evicts a block a request is using.
    - cache_full_blocks: a block already hashed, or a hash already cached by another block,
      is left alone (two requests may compute the same prefix at once).

What you will have built: the KV-cache manager of a paged engine with prefix caching and
swapping; the grader runs the real engine on it (LLMEngine(config, block_manager=BlockManager)).

Grade: `make grade EX=ex13`, or `pytest tests/exercises/test_ex13_block_manager.py --impl=exercises`.
"""
from __future__ import annotations

from collections import OrderedDict

from llmlab.request import Request


class BlockManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True):   # EngineConfig's default
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: list[int] = list(range(num_device_blocks - 1, -1, -1))   # pop() -> 0, 1, ...
        self.ref_counts = [0] * num_device_blocks
        self.block_hash: list[int | None] = [None] * num_device_blocks
        self.cached_blocks: dict[int, int] = {}                   # hash -> block id
        self.evictable: OrderedDict[int, None] = OrderedDict()    # ref 0, hashed; LRU first
        self.free_host_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.host_tables: dict[str, list[int]] = {}               # swapped request -> host blocks
        self.prefix_queries = 0   # blocks looked up / found, for the prefix-cache hit rate
        self.prefix_hits = 0

    # ---- counting --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Device blocks available to allocate (evictable prefix-cache blocks count as free)."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.free_host_blocks)

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """New blocks `request` needs to hold its first `num_tokens` tokens."""
        have = len(request.block_table)
        return max(0, -(-num_tokens // self.block_size) - have)

    def stats(self) -> dict:
        """Free and total blocks on the device and the host, the block size, the prefix hit rate."""
        return {"free_device_blocks": self.num_free_blocks, "total_device_blocks": self.num_device_blocks,
                "free_host_blocks": self.num_free_host_blocks, "total_host_blocks": self.num_host_blocks,
                "block_size": self.block_size, "prefix_hit_rate": self.prefix_hit_rate}

    # ---- allocation ------------------------------------------------------------------
    def allocate(self, request: Request, num_tokens: int) -> list[int]:
        """Grow the request's block table to hold `num_tokens` tokens; returns new block ids."""
        needed = self.blocks_needed(request, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {needed}, {self.num_free_blocks} free")
        new = [self._take_block() for _ in range(needed)]
        request.block_table.extend(new)
        return new

    def _take_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:   # evict the least recently used cached block
            block, _ = self.evictable.popitem(last=False)
            del self.cached_blocks[self.block_hash[block]]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def free(self, request: Request) -> list[int]:
        """Drop the request's references; returns the blocks whose count reached zero."""
        released = []
        # reversed: a prompt's later blocks are evicted before its earlier ones (LRU order)
        for block in reversed(request.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                released.append(block)
                if self.block_hash[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        request.block_table = []
        request.num_cached_blocks = 0
        return released

    # ---- prefix caching --------------------------------------------------------------
    def block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The hash chain of the request's first `num_blocks` full blocks. Each block is
        hashed once, chained from the previous block's hash, and kept on the request: its
        tokens never change, so neither does its hash (no per-step rebuild or re-hash)."""
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(request.token_ids_between(i * bs, (i + 1) * bs)))))
        return hashes[:num_blocks]

    def match_prefix(self, request: Request) -> int:
        """Share the cached blocks of the request's prompt prefix; returns the number of
        tokens found. At least one prompt token is always left to compute (its logits
        give the first output token), so a fully cached prompt reuses all but its last block.
        A request that asks for its prompt's logprobs finds nothing: it needs every prompt
        token's logits, so it computes them all (as vLLM does)."""
        if not self.enable_prefix_caching or request.block_table or request.prompt_logprobs is not None:
            return 0
        usable = (request.num_tokens - 1) // self.block_size
        matched = []
        for h in self.block_hashes(request, usable):
            block = self.cached_blocks.get(h)
            if block is None:
                break
            matched.append(block)
        self.prefix_queries += usable
        self.prefix_hits += len(matched)
        for block in matched:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        request.block_table = matched
        request.num_cached_blocks = len(matched)
        return len(matched) * self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that filled since the last call, so later requests
        can share them. O(new blocks): blocks before `request.num_cached_blocks` are done."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = request.num_cached_blocks
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        for i in range(start, num_full):
            block, h = request.block_table[i], hashes[i]
            if self.block_hash[block] is None and h not in self.cached_blocks:
                self.block_hash[block] = h
                self.cached_blocks[h] = block
        request.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (they become plain free blocks) and
        zero the hit counters: a benchmark's next run starts from a cold cache."""
        for block in self.evictable:
            del self.cached_blocks[self.block_hash[block]]
            self.block_hash[block] = None
            self.free_blocks.append(block)
        self.evictable.clear()
        self.prefix_queries = self.prefix_hits = 0

    def first_block_hash(self, request: Request) -> int | None:
        """The hash of the request's first full prompt block (None if it has none)."""
        if request.num_tokens <= self.block_size:
            return None
        return self.block_hashes(request, 1)[0]

    def prefixes_in_flight(self, running: list[Request]) -> set | None:
        """First-block hashes that `running` requests are computing now (None without prefix
        caching): the scheduler holds back a request whose first block is among them, since
        admitted together both would compute the shared prefix (SGLang's cache-aware admission)."""
        if not self.enable_prefix_caching:
            return None
        return {self.first_block_hash(r) for r in running
                if r.num_computed_tokens < self.block_size and self.first_block_hash(r) is not None}

    def waits_for_prefix(self, request: Request, in_flight: set) -> bool:
        """Whether a running request is computing `request`'s first block now, which the cache
        does not hold yet (so a lookup would find nothing). Asked before the lookup: a step
        spent waiting is no lookup, and the hit rate counts each request's lookup once."""
        first = self.first_block_hash(request)
        return first in in_flight and first not in self.cached_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ---- swapping ----------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return len(request.block_table) <= self.num_free_host_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to host blocks; returns (device, host) copies to make."""
        host = [self.free_host_blocks.pop() for _ in request.block_table]
        copies = list(zip(request.block_table, host))
        self.free(request)
        self.host_tables[request.request_id] = host
        return copies

    def can_swap_in(self, request: Request) -> bool:
        return len(self.host_tables[request.request_id]) <= self.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring the request's blocks back to fresh device blocks; returns (host, device) copies."""
        host = self.host_tables.pop(request.request_id)
        device = [self._take_block() for _ in host]
        request.block_table = device
        request.num_cached_blocks = 0     # fresh blocks: registered again as they are computed
        self.free_host_blocks.extend(reversed(host))
        return list(zip(host, device))

    def free_host(self, request: Request) -> None:
        """Release a swapped request's host blocks (it was aborted while swapped out)."""
        self.free_host_blocks.extend(reversed(self.host_tables.pop(request.request_id, [])))
