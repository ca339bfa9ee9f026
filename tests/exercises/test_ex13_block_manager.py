"""Exercise 13, the engine's block manager with prefix caching: a spec, one behaviour per test,
then the real engine run on the student's BlockManager. Every check fails with the case that
broke, what differs and what to check (diagnose.fail), never a bare assert."""
from collections import Counter

import pytest

import llmlab
from llmlab.request import Request
from diagnose import fail

EXERCISE = "ex13_block_manager"
BLOCK = 4   # tokens per block in the unit cases: small, so a few tokens span several blocks


def expect(ok, case: str, what: str, hint: str) -> None:
    """Fail `case` saying what is wrong and what to check, unless `ok`."""
    if not ok:
        fail(case, [what, f"-> {hint}"])


def request(request_id, token_ids) -> Request:
    return Request(str(request_id), None, list(token_ids), llmlab.SamplingParams())


def computed(manager, req, num_tokens=None) -> Request:
    """The engine's part: the request's first num_tokens (default all) are computed; their
    full blocks are registered in the prefix cache."""
    req.num_computed_tokens = req.num_tokens if num_tokens is None else num_tokens
    manager.cache_full_blocks(req)
    return req


def check_invariants(manager, live: list[Request], case: str) -> None:
    """What must hold after every operation: each block is in exactly one place -- held by
    requests (its reference count says by how many), in free_blocks (once), or evictable
    (cached, held by nobody) -- and the prefix cache maps each cached hash to its block."""
    holders = Counter(block for r in live for block in r.block_table)
    free = Counter(manager.free_blocks)
    twice = sorted(b for b, n in free.items() if n > 1)
    expect(not twice, case, f"block(s) {twice} are in free_blocks twice",
           "a block was freed twice: it goes back once, when its reference count reaches 0 (in free, release "
           "each block of the table once)")
    for block in range(manager.num_device_blocks):
        count, held = manager.ref_counts[block], holders[block]
        owners = [r.request_id for r in live if block in r.block_table]
        expect(count == held, case, f"block {block}: reference count {count}, but {held} requests hold it "
                                    f"(requests {owners})",
               "allocate and match_prefix add 1 for each request that takes a block; free takes 1 off")
        places = [name for name, here in (("free_blocks", block in free), ("evictable", block in manager.evictable))
                  if here]
        if held and places:
            expect(False, case, f"block {block} is held by requests {owners} and is in {places[0]} too",
                   "a block leaves free_blocks / evictable when a request takes it: in match_prefix, a matched "
                   "block whose count was 0 must be taken out of evictable, or a later allocation evicts "
                   "(overwrites) a block a request is still using")
        if not held and not places:
            expect(False, case, f"block {block} is held by no request but is neither in free_blocks nor in "
                                "evictable: it leaked",
                   "free must put each block whose reference count reaches 0 back: in evictable if it is cached "
                   "(has a hash), else in free_blocks")
        if len(places) == 2:
            expect(False, case, f"block {block} is in free_blocks and in evictable", "a block is in one place")
    for block in manager.evictable:
        expect(manager.block_hash[block] is not None, case, f"evictable block {block} has no hash",
               "only cached blocks (with a hash) wait in evictable; the others go to free_blocks")
    for h, block in manager.cached_blocks.items():
        expect(manager.block_hash[block] == h, case, f"cached_blocks maps a hash to block {block}, whose "
                                                     f"block_hash is {manager.block_hash[block]}",
               "when a block is evicted, delete its hash from cached_blocks and set block_hash[block] = None")
    for block, h in enumerate(manager.block_hash):
        if h is not None and manager.cached_blocks.get(h) != block:
            expect(False, case, f"block {block} has a hash, but cached_blocks maps that hash to "
                                f"{manager.cached_blocks.get(h)}",
                   "a block's hash is the key cached_blocks finds it under: in cache_full_blocks, a hash already "
                   "cached by another block is left alone (the new block gets no hash), or evicting one of the two "
                   "later deletes the other's entry")


def test_allocate_grows_the_table(ex):
    case = "allocate 5 tokens, then grow to 9 (blocks of 4)"
    manager = ex.BlockManager(8, 4, BLOCK, True)
    r = request(0, range(9))
    first = manager.allocate(r, 5)
    expect(len(first) == 2 and r.block_table == first, case, f"allocate(r, 5) returned {first}, the table is "
                                                             f"{r.block_table}",
           "n tokens need ceil(n / block_size) blocks: append the new ones to request.block_table and return them")
    more = manager.allocate(r, 9)
    expect(len(more) == 1 and r.block_table == first + more, case,
           f"growing to 9 tokens returned {more}, the table is {r.block_table}",
           "allocate only adds the blocks the table lacks (blocks_needed)")
    expect(manager.num_free_blocks == 5, case, f"{manager.num_free_blocks} of 8 blocks free, expected 5",
           "take each new block out of free_blocks")
    check_invariants(manager, [r], case)


def test_out_of_blocks_changes_nothing(ex):
    case = "allocate 3 blocks with 2 free"
    manager = ex.BlockManager(2, 0, BLOCK, True)
    r = request(0, range(9))
    try:
        manager.allocate(r, 9)
    except NotImplementedError:
        raise                       # (a subclass of RuntimeError) not written yet
    except RuntimeError:
        pass
    else:
        fail(case, ["no RuntimeError", "-> when there are not enough free blocks, raise RuntimeError"])
    expect(r.block_table == [] and manager.num_free_blocks == 2, case,
           f"after the refusal the table is {r.block_table}, {manager.num_free_blocks} blocks free",
           "check for free blocks before taking any")


def test_free(ex):
    case = "free a request of 9 tokens (3 blocks, prefix caching off)"
    manager = ex.BlockManager(8, 4, BLOCK, False)
    r, other = request(0, range(9)), request(1, range(100, 105))
    manager.allocate(r, 9)
    manager.allocate(other, 5)
    manager.free(r)
    expect(r.block_table == [], case, f"the table after free is {r.block_table}", "free empties the block table")
    check_invariants(manager, [other], case)
    manager.free(other)
    check_invariants(manager, [], case)
    expect(manager.num_free_blocks == 8, case, f"{manager.num_free_blocks} of 8 blocks free after freeing everything",
           "every block comes back when its last request is freed")


def test_hash_chain_covers_the_whole_prefix(ex):
    case = "two prompts whose second blocks are equal but whose first blocks differ"
    manager = ex.BlockManager(8, 0, BLOCK, True)
    a, b = request(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]), request(1, [9, 9, 9, 9, 5, 6, 7, 8, 9])
    hashes_a, hashes_b = manager.block_hashes(a, 2), manager.block_hashes(b, 2)
    expect(len(hashes_a) == 2 and a.block_hashes[:2] == hashes_a, case,
           f"block_hashes(a, 2) returned {hashes_a}, request.block_hashes is {a.block_hashes}",
           "return the first num_blocks hashes and keep them on request.block_hashes (each block is hashed once)")
    expect(hashes_a[1] != hashes_b[1], case, "block 1 of both prompts has the same hash",
           "the hash of block i must cover the previous block's hash too -- hash((hashes[i-1], tokens of "
           "block i)) -- or a request reuses K/V computed after a different prefix")
    same = request(2, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    expect(manager.block_hashes(same, 2) == hashes_a, "the same two blocks in another request",
           "equal prefixes got different hashes", "the hash depends only on the tokens (and the previous hash)")
    # the same mistake seen through the cache: b must not find a's second block
    manager.allocate(a, 9)
    computed(manager, a)
    found = manager.match_prefix(b)
    expect(found == 0, case, f"match_prefix found {found} cached tokens for b, whose first block is new",
           "a lookup stops at the first block not cached; block 1 is only the same if block 0 is")
    check_invariants(manager, [a, b], case)


def test_match_prefix_shares_cached_blocks(ex):
    case = "a second prompt sharing the first 8 of 10 tokens"
    manager = ex.BlockManager(8, 0, BLOCK, True)
    a = request(0, range(10))
    manager.allocate(a, 10)
    computed(manager, a)
    expect(len(manager.cached_blocks) == 2, "cache_full_blocks of 10 computed tokens",
           f"{len(manager.cached_blocks)} blocks cached, expected 2", "only full blocks are cached (10 // 4 = 2)")
    b = request(1, [*range(8), 50, 51])
    found = manager.match_prefix(b)
    hint = ("share each cached block of the prompt's prefix, in order; return the tokens they hold"
            if found != 8 or b.block_table else
            "the tokens were found but b's block_table is empty: the matched blocks become the request's "
            "block_table (request.block_table = the matched blocks, num_cached_blocks = how many), or the engine "
            "allocates fresh blocks over a prefix it never computes")
    expect(found == 8 and b.block_table == a.block_table[:2], case,
           f"match_prefix found {found} tokens, b's table {b.block_table} (a's: {a.block_table})", hint)
    expect(b.num_cached_blocks == 2, case, f"b.num_cached_blocks = {b.num_cached_blocks}",
           "the matched blocks are cached already: num_cached_blocks = blocks matched")
    check_invariants(manager, [a, b], case)
    whole = request(2, range(8))
    found = manager.match_prefix(whole)
    expect(found == 4, "a prompt of exactly 2 cached blocks", f"match_prefix found {found} tokens, expected 4",
           "leave at least one prompt token to compute (its logits give the first output token): look up at "
           "most (num_tokens - 1) // block_size blocks")
    check_invariants(manager, [a, b, whole], case)
    partial = request(4, [0, 1, 2, 3, 90, 91, 92, 93, 94, 95])    # its first block cached, its second not
    manager.match_prefix(partial)
    expect((manager.prefix_queries, manager.prefix_hits) == (2 + 1 + 2, 2 + 1 + 1), "three lookups' counts",
           f"prefix_queries {manager.prefix_queries}, prefix_hits {manager.prefix_hits}; expected 5 and 4 (b: 2 "
           "blocks looked up, 2 found; the 8-token prompt: 1 and 1; a prompt whose second block differs: 2 and 1)",
           "prefix_queries counts the blocks a lookup could find ((num_tokens - 1) // block_size), prefix_hits "
           "those it found: kv_stats()['prefix_hit_rate'] is their ratio")
    logprobs = Request("3", None, list(range(10)), llmlab.SamplingParams(prompt_logprobs=0))
    found = manager.match_prefix(logprobs)
    expect(found == 0 and not logprobs.block_table, "a cached prompt that asks for its prompt logprobs",
           f"match_prefix found {found} tokens", "a request with prompt_logprobs needs every prompt token's logits: "
           "it finds nothing, and computes its whole prompt")
    expect((manager.prefix_queries, manager.prefix_hits) == (5, 4), "a cached prompt that asks for its prompt logprobs",
           f"prefix_queries {manager.prefix_queries}, prefix_hits {manager.prefix_hits}, expected them unchanged (5, 4)",
           "a lookup that finds nothing by rule (prompt_logprobs, or a block table already) counts nothing")
    check_invariants(manager, [a, b, whole, partial], case)


def test_a_request_swapped_back_registers_nothing_twice(ex):
    case = "swap a cached request out and in, register its blocks again, free it, then allocate every block"
    manager = ex.BlockManager(4, 4, BLOCK, True)
    a = request(0, range(9))
    manager.allocate(a, 9)
    computed(manager, a)
    manager.swap_out(a)
    check_invariants(manager, [], case)
    manager.swap_in(a)
    check_invariants(manager, [a], case)
    computed(manager, a)             # the engine registers the swapped-in blocks as it does computed ones
    check_invariants(manager, [a], case)
    manager.free(a)
    check_invariants(manager, [], case)
    c = request(1, range(100, 116))
    manager.allocate(c, 16)
    check_invariants(manager, [c], case)
    manager.free(c)
    check_invariants(manager, [], case)


def test_a_freed_cached_block_is_found_again(ex):
    case = "free a cached request, then look its prompt up"
    manager = ex.BlockManager(6, 0, BLOCK, True)
    a = request(0, range(10))
    manager.allocate(a, 10)
    table = list(a.block_table)
    computed(manager, a)
    manager.free(a)
    check_invariants(manager, [], case)
    expect(set(manager.evictable) == set(table[:2]), case, f"evictable holds {list(manager.evictable)}, "
                                                           f"expected the 2 cached blocks {table[:2]}",
           "a block at 0 that has a hash waits in evictable (still cached); one without goes to free_blocks")
    expect(manager.num_free_blocks == 6, case, f"num_free_blocks is {manager.num_free_blocks}",
           "evictable blocks count as free")
    b = request(1, range(10))
    found = manager.match_prefix(b)
    expect(found == 8 and b.block_table == table[:2], case, f"found {found} tokens, table {b.block_table}",
           "a freed block stays in the prefix cache until it is evicted")
    check_invariants(manager, [b], case)
    # the cache is full of b's blocks: an allocation must not take one of them
    c = request(2, range(100, 116))
    manager.allocate(c, 16)
    taken = set(c.block_table) & set(b.block_table)
    expect(not taken, "allocate 4 blocks while a request holds 2 formerly evictable blocks",
           f"the new request got block(s) {sorted(taken)}, which request 1 holds",
           "a matched block must leave evictable (match_prefix), so that eviction never takes a block in use")
    check_invariants(manager, [b, c], case)


def test_eviction_is_least_recently_used(ex):
    case = "evict with two freed cached requests (a freed before b)"
    manager = ex.BlockManager(4, 0, BLOCK, True)
    a, b = request(0, range(9)), request(1, range(100, 109))
    for r in (a, b):
        manager.allocate(r, 8)
        computed(manager, r)
    table_a, table_b = list(a.block_table), list(b.block_table)
    manager.free(a)
    manager.free(b)
    check_invariants(manager, [], case)
    c = request(2, range(200, 205))
    manager.allocate(c, 1)
    if c.block_table == [table_a[0]]:
        hint = ("a's first block was evicted before its second: free releases a table's blocks last block first "
                "(reversed), so a prompt's later blocks, which fewer prompts share, are evicted before its earlier "
                "ones")
    elif c.block_table and c.block_table[0] in table_b:
        hint = ("one of b's blocks was evicted, though a's were freed first: evict the least recently used block: "
                "evictable is an OrderedDict, newest last: pop the oldest (popitem(last=False))")
    else:
        hint = ("evict the least recently used block first: a was freed first, and free releases a table's last block "
                "first (its later blocks are the less useful ones): evictable is an OrderedDict, pop the oldest")
    expect(c.block_table == [table_a[1]], case, f"the new block is {c.block_table}; a's blocks {table_a}, "
                                                f"b's {table_b}", hint)
    again = request(3, range(9))
    expect(manager.match_prefix(again) == 4, case,
           "after evicting a's second block, a's prompt should still find its first block",
           "evicting a block removes only that block's hash from cached_blocks")
    manager.allocate(c, 12)   # 2 more: only b's blocks are evictable now (a's first is held again)
    expect(c.block_table == [table_a[1], table_b[1], table_b[0]], "evict the rest",
           f"c holds {c.block_table}; b's blocks were {table_b}, a's {table_a}",
           "evict in LRU order, and never a block a request holds")
    expect(all(manager.block_hash[b] is None for b in table_b) and not set(manager.cached_blocks.values()) & set(table_b),
           "evict the rest", f"b's evicted blocks keep hashes {[manager.block_hash[b] for b in table_b]}",
           "an evicted block forgets its hash (block_hash[b] = None, deleted from cached_blocks)")
    check_invariants(manager, [c, again], "evict the rest")


def test_prefix_caching_off(ex):
    case = "enable_prefix_caching=False"
    manager = ex.BlockManager(6, 0, BLOCK, False)
    a = request(0, range(10))
    manager.allocate(a, 10)
    computed(manager, a)
    expect(not manager.cached_blocks, case, f"cached_blocks holds {len(manager.cached_blocks)} blocks",
           "without prefix caching, cache_full_blocks does nothing")
    expect(manager.match_prefix(request(1, range(10))) == 0, case, "match_prefix found tokens",
           "without prefix caching, match_prefix finds nothing")


def test_swap_round_trip(ex):
    case = "swap a request of 3 blocks out and back in"
    manager = ex.BlockManager(6, 4, BLOCK, True)
    r, other = request(0, range(10)), request(1, range(100, 105))
    manager.allocate(r, 10)
    manager.allocate(other, 5)
    device = list(r.block_table)
    out = manager.swap_out(r)
    expect([d for d, _ in out] == device and len({h for _, h in out}) == 3, case,
           f"swap_out returned {out}; the device blocks were {device}",
           "one (device block, host block) copy per block of the table, in order, each to its own host block")
    expect(r.block_table == [] and manager.num_free_host_blocks == 1, case,
           f"after swap_out: table {r.block_table}, {manager.num_free_host_blocks} of 4 host blocks free",
           "swap_out frees the device blocks and takes one host block each (host_tables[request_id])")
    check_invariants(manager, [other], case)
    back = manager.swap_in(r)
    expect([h for h, _ in back] == [h for _, h in out] and [d for _, d in back] == r.block_table, case,
           f"swap_in returned {back}, the table is {r.block_table}; swap_out's copies were {out}",
           "one (host block, fresh device block) copy per host block, in the order swap_out wrote them")
    expect(manager.num_free_host_blocks == 4 and r.request_id not in manager.host_tables, case,
           f"{manager.num_free_host_blocks} of 4 host blocks free after swap_in",
           "swap_in gives every host block back (and forgets host_tables[request_id])")
    check_invariants(manager, [r, other], case)


# ---- the real engine on your BlockManager ----------------------------------------------------
# Prompts of token ids built from 16-token pieces (one KV block each): P+Q, R+S, then P+S and
# R+Q. The last two find their first block in the cache, and a second block whose tokens are
# cached too -- but computed after another first block, so it must not be shared (a hash that
# ignores the previous block shares it, and the text changes). 7 KV blocks do not hold all four
# requests at once, so one is preempted and comes back.
FIRST = ("You are a helpful assistant who answers in one short sentence. The user asks about the geography "
         "of Europe and you reply with a single fact that a student could check in an atlas.")
SECOND = ("Once upon a time, in a small village by the sea, there lived an old fisherman and his cat, who "
          "went out every morning to catch fish for the market in the old town across the bay.")
ENDINGS = [" What is the capital of France?", " Which river flows through Vienna?",
           " What is the tallest mountain in the Alps?", " Where is the city of Porto?"]
E2E_PARAMS = llmlab.SamplingParams(max_tokens=8, temperature=0.0)


def e2e_prompts(tokenizer) -> list[list[int]]:
    first, second = tokenizer.encode(FIRST), tokenizer.encode(SECOND)
    p, q, r, s = first[:16], first[16:32], second[:16], second[16:32]
    return [head + tail + tokenizer.encode(end)
            for (head, tail), end in zip([(p, q), (r, s), (p, s), (r, q)], ENDINGS)]


def engine_run(llm, block_manager, preemption_mode):
    config = llmlab.EngineConfig(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=7,
                                 swap_space=0.01, preemption_mode=preemption_mode, enable_prefix_caching=True,
                                 async_scheduling=False)
    engine = llmlab.LLMEngine(config, model=llm.engine.model, tokenizer=llm.tokenizer, block_manager=block_manager)
    outputs = llmlab.LLM.from_engine(engine).generate(e2e_prompts(llm.tokenizer), E2E_PARAMS)
    return engine, [o.token_ids for o in outputs]


@pytest.mark.slow   # the 30-layer model, several engine runs
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_end_to_end(ex, llm, preemption_mode):
    from llmlab.cache.block_manager import BlockManager

    _, expected = engine_run(llm, BlockManager, preemption_mode)
    engine, actual = engine_run(llm, ex.BlockManager, preemption_mode)
    case = f"the engine on your BlockManager (prefix caching on, 7 blocks, preemption by {preemption_mode})"
    bm = engine.block_manager
    differ = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
    expect(not differ, case, f"prompts {differ} generate other tokens than with llmlab's BlockManager: "
                             f"{[llm.tokenizer.decode(actual[i]) for i in differ]!r} instead of "
                             f"{[llm.tokenizer.decode(expected[i]) for i in differ]!r}",
           "a request read K/V of another prefix: check the hash chain (block_hashes) and that match_prefix "
           "only shares blocks whose whole prefix matches; that eviction never takes a held block")
    expect(bm.prefix_hits > 0, case, "no prefix hit: the shared opening was never found in the cache",
           "cache_full_blocks registers each full computed block; match_prefix looks the prompt's blocks up")
    expect(bm.num_free_blocks == bm.num_device_blocks and bm.num_free_host_blocks == bm.num_host_blocks, case,
           f"after every request finished: {bm.num_free_blocks} of {bm.num_device_blocks} device blocks and "
           f"{bm.num_free_host_blocks} of {bm.num_host_blocks} host blocks free",
           "every block comes back: free releases each block once; swap_in returns the host blocks")
