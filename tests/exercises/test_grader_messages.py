"""The graders say what is wrong: each planted mistake (a solution with one bug put in) fails
the case that isolates it, with a message that names the mistake and what to check, not a
bare assert nor a hint about another mistake.

Grades the graders, not a student's work: not collected with --impl=exercises (conftest.py).
"""
from __future__ import annotations

import importlib.util
import inspect
import textwrap
import types

import pytest
import torch

import test_ex09_block_allocator as ex09
import test_ex11_top_p as ex11
import test_ex12_quantized_store_kv as ex12
import test_ex13_block_manager as ex13
import test_ex14_detokenizer as ex14
import test_ex15_decoder_layer as ex15
import test_ex16_sampler as ex16
import test_ex17_scheduler_step as ex17
import test_ex18_preemption as ex18
import test_ex19_chat_endpoint as ex19
import test_ex20_cuda_graphs as ex20
from grading import load
from llmlab import kernels
from llmlab.kernels import reference
from llmlab.plan import Plan
from llmlab.request import RequestStatus


def solution_function(exercise: str, name: str, old: str, new: str):
    """The function `name` of solutions/<exercise>.py ("Class.method" for a method) with the piece
    `old` of its source replaced by `new` (the planted mistake), run in the solution's globals."""
    solution = load("solutions", exercise)
    owner, _, attribute = name.rpartition(".")
    function = getattr(getattr(solution, owner) if owner else solution, attribute)
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(old) == 1, f"{name} of the solution no longer has {old!r}: update the planted mistake"
    namespace = dict(vars(solution))
    exec(compile(source.replace(old, new), f"planted {exercise}.{name}", "exec"), namespace)
    return namespace[attribute]


# ---- exercise 09: three allocators with one bug each -----------------------------------------------
def allocator_module(**methods):
    """exercise 09's API: the solution's BlockAllocator with `methods` replaced."""
    solution = load("solutions", "ex09_block_allocator")
    planted = type("Planted", (solution.BlockAllocator,), methods)
    return types.SimpleNamespace(BlockAllocator=planted, OutOfBlocksError=solution.OutOfBlocksError)


def free_twice(self, seq_id):
    table = self.block_tables.pop(seq_id)
    del self.seq_lens[seq_id]
    for block in table + table:                # the bug: every block released twice
        self.ref_counts[block] = max(0, self.ref_counts[block] - 1)
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)


def free_never(self, seq_id):
    for block in self.block_tables.pop(seq_id):
        self.ref_counts[block] -= 1            # the bug: a block at 0 never goes back to free_blocks
    del self.seq_lens[seq_id]


def fork_without_a_reference(self, parent_id, child_id):
    self.block_tables[child_id] = list(self.block_tables[parent_id])   # the bug: no ref_counts[b] += 1
    self.seq_lens[child_id] = self.seq_lens[parent_id]


@pytest.mark.parametrize("methods,test,message", [
    (dict(free=free_twice), ex09.test_free,
     r"case free a sequence of 9 tokens.*: block\(s\) \[0, 1, 2\] are in free_blocks twice\n  -> a block was freed twice"),
    (dict(free=free_never), ex09.test_free,
     r"case free a sequence of 9 tokens.*: block 0 is held by no sequence but is not in free_blocks: it leaked"),
    (dict(fork=fork_without_a_reference), ex09.test_fork_shares_every_block,
     r"case fork a sequence of 6 tokens.*reference counts are \[1, 1\], expected \[2, 2\]\n  -> fork adds 1 to the "
     r"count of every block the child shares"),
], ids=["a block freed twice", "a block never freed", "a fork that takes no reference"])
def test_exercise_09_names_the_planted_mistake(methods, test, message):
    with pytest.raises(pytest.fail.Exception, match=message):
        test(allocator_module(**methods))


def test_exercise_09_never_fails_with_a_bare_assert():
    """Every planted allocator fails each test it fails through a report (pytest.fail), never
    an AssertionError that prints `assert (2 == 2 and 2 == 1)`."""
    tests = [f for name, f in vars(ex09).items() if name.startswith("test_")]
    for methods in (dict(free=free_twice), dict(free=free_never), dict(fork=fork_without_a_reference)):
        for test in tests:
            try:
                test(allocator_module(**methods))
            except pytest.fail.Exception as report:
                assert str(report).startswith("case "), str(report)
            except AssertionError as error:
                pytest.fail(f"{test.__name__} with {sorted(methods)} planted: a bare assert ({error})")


# ---- exercise 11: two nuclei cut in the wrong place ---------------------------------------------------
def nucleus(logits, top_p, keep_rule, sort=True):
    """A top-p filter whose kept set is keep_rule(cumulative mass, probabilities) over the
    probabilities, sorted most likely first (or in the order the tokens come in)."""
    top_p = torch.as_tensor(top_p, dtype=torch.float32).reshape(-1, 1)
    probs = logits.softmax(-1)
    order = probs.argsort(dim=-1, descending=True) if sort else torch.arange(probs.shape[-1]).expand_as(probs)
    ranked = probs.gather(-1, order)
    keep = keep_rule(ranked.cumsum(-1), ranked, top_p)
    keep[:, 0] = True
    return logits.masked_fill(~torch.zeros_like(keep).scatter(-1, order, keep), float("-inf"))


PLANTED_11 = {
    # the bug: keeps a token while the mass up to and including it is < top_p
    "the crossing token dropped": (lambda x, p: nucleus(x, p, lambda cum, ranked, p: cum < p),
                                   r"(?s)kept \['0.5'\].*the token that crosses top_p \(0.3"),
    # the bug: the cumulative mass in the tokens' own order, never sorted
    "never sorted": (lambda x, p: nucleus(x, p, lambda cum, ranked, p: cum - ranked < p, sort=False),
                     r"the cut follows the order the tokens come in"),
}


@pytest.mark.parametrize("planted", sorted(PLANTED_11))
def test_exercise_11_names_the_planted_mistake(planted):
    top_p_filter, message = PLANTED_11[planted]
    with pytest.raises(pytest.fail.Exception, match=message):
        ex11.test_smallest_set_reaching_top_p(types.SimpleNamespace(top_p_filter=top_p_filter))
    with pytest.raises(pytest.fail.Exception, match=r"kept \[.*\] tokens per row, the Sampler keeps"):
        ex11.test_matches_the_sampler(types.SimpleNamespace(top_p_filter=top_p_filter), 0.9)


# ---- exercise 12: the scale of every kv head written at head 0 ---------------------------------------
@pytest.fixture(scope="module")
def scale_without_head_offset(tmp_path_factory):
    """The solution with the head left out of the scale's offset: every kv head of a token
    writes its scale at head 0's place. A file of its own, as Triton reads a kernel's source."""
    solution = load("solutions", "ex12_quantized_store_kv")
    source = inspect.getsource(solution)
    line = "scale_dst = block * stride_scale_block + offset * stride_scale_slot + head"
    assert source.count(line) == 1, "the solution's scale offset moved: update this planted mistake"
    path = tmp_path_factory.mktemp("planted") / "ex12_scale_without_head.py"
    path.write_text(source.replace(line, "scale_dst = block * stride_scale_block + offset * stride_scale_slot"))
    spec = importlib.util.spec_from_file_location("ex12_scale_without_head", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_exercise_12_names_a_missing_per_head_scale_offset(scale_without_head_offset):
    planted = scale_without_head_offset
    with pytest.raises(pytest.fail.Exception, match=r"case one scale per kv head.*k_scales: only kv head 0's scales "
                                                    r"are written.*add the head to the scale's offset"):
        ex12.test_each_kv_head_has_its_own_scale(planted)
    # the other cases it fails name the scales too: not "v_cache" (the stacked case once named
    # the scales tensor so), not "don't truncate" (the round trip)
    for case in (lambda: ex12.test_one_layer_of_a_stacked_cache(planted),
                 lambda: ex12.test_matches_reference(planted, 16, 3, 64),
                 lambda: ex12.test_round_trip_is_within_half_a_step(planted)):
        with pytest.raises(pytest.fail.Exception) as report:
            case()
        message = str(report.value)
        assert "scales" in message and "v_cache" not in message and "truncate" not in message, message


# ---- exercise 13: four block managers with one bug each --------------------------------------------
def manager_module(**methods):
    """exercise 13's API: the solution's BlockManager with `methods` replaced."""
    solution = load("solutions", "ex13_block_manager")
    return types.SimpleNamespace(BlockManager=type("Planted", (solution.BlockManager,), methods))


def release_twice(self, request):
    for block in reversed(request.block_table * 2):      # the bug: every block released twice
        self.ref_counts[block] = max(0, self.ref_counts[block] - 1)
        if self.ref_counts[block] == 0:
            if self.block_hash[block] is not None:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)
    request.block_table, request.num_cached_blocks = [], 0


def release_never(self, request):
    for block in request.block_table:
        self.ref_counts[block] -= 1                      # the bug: a block at 0 goes nowhere
    request.block_table, request.num_cached_blocks = [], 0


def hash_of_the_block_alone(self, request, num_blocks):
    hashes, bs = request.block_hashes, self.block_size
    while len(hashes) < num_blocks:
        i = len(hashes)                                  # the bug: no previous hash in the chain
        hashes.append(hash(tuple(request.token_ids_between(i * bs, (i + 1) * bs))))
    return hashes[:num_blocks]


def match_leaving_blocks_evictable(self, request):
    if not self.enable_prefix_caching or request.block_table:
        return 0
    matched = []
    for h in self.block_hashes(request, (request.num_tokens - 1) // self.block_size):
        if h not in self.cached_blocks:
            break
        matched.append(self.cached_blocks[h])
    for block in matched:
        self.ref_counts[block] += 1                      # the bug: a block at 0 stays in evictable
    request.block_table, request.num_cached_blocks = matched, len(matched)
    return len(matched) * self.block_size


def match_keeping_the_table_empty(self, request):
    if not self.enable_prefix_caching or request.block_table:
        return 0
    matched = []
    for h in self.block_hashes(request, (request.num_tokens - 1) // self.block_size):
        if h not in self.cached_blocks:
            break
        matched.append(self.cached_blocks[h])
    for block in matched:
        self.evictable.pop(block, None)
        self.ref_counts[block] += 1                      # the bug: the blocks never enter the block table
    return len(matched) * self.block_size


def release_first_block_first(self, request):
    released = []
    for block in request.block_table:                    # the bug: not reversed, a prompt's first block goes first
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            released.append(block)
            if self.block_hash[block] is not None:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)
    request.block_table, request.num_cached_blocks = [], 0
    return released


def take_the_newest_evictable(self):
    if self.free_blocks:
        block = self.free_blocks.pop()
    else:
        block, _ = self.evictable.popitem()              # the bug: last=True, the most recently used goes
        del self.cached_blocks[self.block_hash[block]]
        self.block_hash[block] = None
    self.ref_counts[block] = 1
    return block


PLANTED_13 = {
    "a block freed twice": (dict(free=release_twice), ex13.test_free,
                            r"case free a request of 9 tokens.*: block\(s\) \[.*\] are in free_blocks twice\n"
                            r"  -> a block was freed twice"),
    "a block never freed": (dict(free=release_never), ex13.test_free,
                            r"case free a request of 9 tokens.*: block \d+ is held by no request but is neither in "
                            r"free_blocks nor in evictable: it leaked"),
    "a hash that ignores the previous block": (
        dict(block_hashes=hash_of_the_block_alone), ex13.test_hash_chain_covers_the_whole_prefix,
        r"case two prompts whose second blocks are equal.*: block 1 of both prompts has the same hash\n"
        r"  -> the hash of block i must cover the previous block's hash"),
    "eviction of a block still referenced": (
        dict(match_prefix=match_leaving_blocks_evictable), ex13.test_a_freed_cached_block_is_found_again,
        r"case free a cached request, then look its prompt up: block \d+ is held by requests \['1'\] and is in "
        r"evictable too\n  -> .*match_prefix, a matched block whose count was 0 must be taken out of evictable"),
    "a table freed first block first": (
        dict(free=release_first_block_first), ex13.test_eviction_is_least_recently_used,
        r"case evict with two freed cached requests.*: the new block is \[0\]; a's blocks \[0, 1\].*\n"
        r"  -> a's first block was evicted before its second: free releases a table's blocks last block first"),
    "the most recently used block evicted": (
        dict(_take_block=take_the_newest_evictable), ex13.test_eviction_is_least_recently_used,
        r"case evict with two freed cached requests.*: the new block is \[2\].*b's \[2, 3\]\n"
        r"  -> one of b's blocks was evicted, though a's were freed first: .*popitem\(last=False\)"),
    "matched blocks left out of the block table": (
        dict(match_prefix=match_keeping_the_table_empty), ex13.test_match_prefix_shares_cached_blocks,
        r"case a second prompt sharing the first 8 of 10 tokens: match_prefix found 8 tokens, b's table \[\].*\n"
        r"  -> the tokens were found but b's block_table is empty: the matched blocks become the request's "
        r"block_table"),
}


@pytest.mark.parametrize("planted", sorted(PLANTED_13))
def test_exercise_13_names_the_planted_mistake(planted):
    methods, test, message = PLANTED_13[planted]
    with pytest.raises(pytest.fail.Exception, match=message):
        test(manager_module(**methods))


def test_exercise_13_never_fails_with_a_bare_assert():
    """Each planted block manager fails every unit test it fails through a report."""
    tests = [f for name, f in vars(ex13).items() if name.startswith("test_") and name != "test_end_to_end"]
    for planted, (methods, _, _) in PLANTED_13.items():
        for test in tests:
            try:
                test(manager_module(**methods))
            except pytest.fail.Exception as report:
                assert str(report).startswith("case "), str(report)
            except Exception as error:   # noqa: BLE001 -- a crash is no report either
                pytest.fail(f"{test.__name__} with {planted} planted: {type(error).__name__} ({error})")


@pytest.mark.slow
def test_exercise_13_end_to_end_catches_a_hash_without_its_prefix(llm):
    """The engine on a block manager whose hash ignores the previous block: a request shares
    a block computed after another prefix, and its text changes (or the run fails)."""
    with pytest.raises(pytest.fail.Exception, match=r"the engine on your BlockManager"):
        ex13.test_end_to_end(manager_module(block_hashes=hash_of_the_block_alone), llm, "recompute")


# ---- exercise 14: a stop string leaked across tokens, a UTF-8 character split -----------------------
def text_module(**classes):
    """exercise 14's API: the solution's classes, with `classes` replacing some."""
    solution = load("solutions", "ex14_detokenizer")
    return types.SimpleNamespace(**{"IncrementalDetokenizer": solution.IncrementalDetokenizer,
                                    "OutputText": solution.OutputText, **classes})


def search_the_new_piece_only(self, token_id):
    piece = self.detokenizer.add_token(token_id)
    found = [(at, stop) for stop in self.stop if (at := piece.find(stop)) != -1]
    if found:                                            # the bug: nothing held back, the new piece searched alone
        at, self.stopped_on = min(found)
        self._release(piece[:at])
        return True
    self._release(piece)
    return False


def decode_the_new_token_alone(self, token_id):
    self.token_ids.append(token_id)                      # the bug: a token decoded on its own
    return self.tokenizer.decode([token_id])


def release_through_the_stop(self, token_id):
    piece = self.detokenizer.add_token(token_id)
    if not piece:
        return False
    window = self.pending + piece
    found = [(at, stop) for stop in self.stop if (at := window.find(stop)) != -1]
    if found:
        at, self.stopped_on = min(found)
        self._release(window[:at + len(self.stopped_on)])   # the bug: the stop string shown with the text
        self.pending = ""
        return True
    keep = max(0, len(window) - self.hold_back)
    self._release(window[:keep])
    self.pending = window[keep:]
    return False


def search_the_new_piece_but_hold_back(self, token_id):
    piece = self.detokenizer.add_token(token_id)
    if not piece:
        return False
    window = self.pending + piece
    # the bug: the stop strings searched in the new piece only, though the tail is held back
    found = [(at + len(self.pending), stop) for stop in self.stop if (at := piece.find(stop)) != -1]
    if found:
        at, self.stopped_on = min(found)
        self._release(window[:at])
        self.pending = ""
        return True
    keep = max(0, len(window) - self.hold_back)
    self._release(window[:keep])
    self.pending = window[keep:]
    return False


def first_stop_of_the_list(self, token_id):
    piece = self.detokenizer.add_token(token_id)
    if not piece:
        return False
    window = self.pending + piece
    found = [(at, stop) for stop in self.stop if (at := window.find(stop)) != -1]
    if found:
        at, self.stopped_on = found[0]                   # the bug: the list's first, not the text's first
        self._release(window[:at])
        self.pending = ""
        return True
    keep = max(0, len(window) - self.hold_back)
    self._release(window[:keep])
    self.pending = window[keep:]
    return False


PLANTED_14 = {
    "a stop string leaked across tokens": (
        dict(OutputText="add_token", method=search_the_new_piece_only),
        ex14.test_a_stop_string_split_across_tokens_is_never_shown,
        r"case stop 'STOP' arriving as 'ST' \+ 'OP'.*'ST' was shown before the stop string was complete\n"
        r"  -> a stop string leaked across tokens: hold back"),
    "a UTF-8 character split": (
        dict(IncrementalDetokenizer="add_token", method=decode_the_new_token_alone),
        ex14.test_a_character_split_over_tokens_waits,
        r"case 'é' split over two tokens.*U\+FFFD \(a half character\) was shown\n  -> a UTF-8 character was split"),
    "a held-back stop string searched in the new piece only": (
        dict(OutputText="add_token", method=search_the_new_piece_but_hold_back),
        ex14.test_a_stop_string_split_across_tokens_is_never_shown,
        r"case stop 'STOP' arriving as 'ST' \+ 'OP': 'ST' was held back, but add_token returned False when 'OP' "
        r"completed the stop string.*\n  -> a stop string split across tokens was never found: search pending \+ "
        r"the new piece"),
    "the first stop string of the list wins": (
        dict(OutputText="add_token", method=first_stop_of_the_list), ex14.test_the_earliest_stop_string_wins,
        r"case stops \['OP', 'ST'\], both inside one token 'xSTOPy': .*stopped_on 'OP'.*\n  -> the first stop "
        r"string of the list won, not the earliest in the text"),
    "stop text shown": (
        dict(OutputText="add_token", method=release_through_the_stop),
        ex14.test_a_stop_string_split_across_tokens_is_never_shown,
        r"case stop 'STOP' arriving as 'ST' \+ 'OP': the text is 'abSTOP': the stop string is in it\n"
        r"  -> stop text shown"),
}


def planted_text_module(spec):
    spec = dict(spec)
    method = spec.pop("method")
    (cls, name), = spec.items()
    solution = load("solutions", "ex14_detokenizer")
    return text_module(**{cls: type("Planted", (getattr(solution, cls),), {name: method})})


@pytest.mark.parametrize("planted", sorted(PLANTED_14))
def test_exercise_14_names_the_planted_mistake(planted):
    spec, test, message = PLANTED_14[planted]
    with pytest.raises(pytest.fail.Exception, match=message):
        test(planted_text_module(spec))


def test_exercise_14_never_fails_with_a_bare_assert():
    tests = [f for name, f in vars(ex14).items() if name.startswith("test_") and name != "test_end_to_end"]
    for planted, (spec, _, _) in PLANTED_14.items():
        for test in tests:
            params = {"test_pieces_add_up_to_the_text": ([1, 9, 10, 11, 2, 3], "h🙂 oké")}.get(test.__name__, ())
            try:
                test(planted_text_module(spec), *params)
            except pytest.fail.Exception as report:
                assert str(report).startswith("case "), str(report)
            except Exception as error:   # noqa: BLE001 -- a crash is no report either
                pytest.fail(f"{test.__name__} with {planted} planted: {type(error).__name__} ({error})")


@pytest.mark.slow
def test_exercise_14_end_to_end_catches_a_leaked_stop_string(llm):
    with pytest.raises(pytest.fail.Exception, match=r"the engine with your classes"):
        ex14.test_end_to_end(planted_text_module(PLANTED_14["a stop string leaked across tokens"][0]), llm)


# ---- exercise 15: keys stored before rope, gate and up swapped, the residual dropped -----------------
def layer_module(**methods):
    """exercise 15's API: the solution's DecoderLayer with `methods` replaced."""
    solution = load("solutions", "ex15_decoder_layer")
    return types.SimpleNamespace(DecoderLayer=type("Planted", (solution.DecoderLayer,), methods))


def store_before_rope(self, x, positions, batch, k_cache, v_cache, k_scales=None, v_scales=None):
    cfg, w, b = self.config, self.weights, batch.backend
    T, H, Hkv, D = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = kernels.linear(x, w.qkv, w.qkv_bias, backend=b).split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
    kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping, backend=b)   # the bug: k stored unrotated
    q, k = kernels.rope(q, k, positions, cfg.rope_theta, cfg.rope_scaling, backend=b)
    out = kernels.prefill_attention(q, k_cache, v_cache, batch.prefill_block_tables, batch.prefill_cu_seqlens_q,
                                    batch.prefill_seq_lens, self.scale, backend=b)
    return kernels.linear(out.reshape(T, H * D), w.o_proj, backend=b)


def gate_and_up_swapped(self, x, backend=None):
    gate, up = kernels.linear(x, self.weights.gate_up, backend=backend).chunk(2, dim=-1)
    return kernels.linear(torch.nn.functional.silu(up) * gate, self.weights.down, backend=backend)   # the bug


def residual_dropped(self, hidden, residual, positions, batch, k_cache, v_cache, k_scales=None, v_scales=None):
    cfg, w, b = self.config, self.weights, batch.backend
    if residual is None:
        x, residual = kernels.rms_norm(hidden, w.input_norm, cfg.rms_norm_eps, backend=b), hidden
    else:
        x, residual = kernels.rms_norm(hidden, w.input_norm, cfg.rms_norm_eps, residual, backend=b)
    attn = self.attention(x, positions, batch, k_cache, v_cache)
    x = kernels.rms_norm(attn, w.post_norm, cfg.rms_norm_eps, backend=b)   # the bug: attn never joins the residual
    return self.mlp(x, b), residual


def rope_on_v_too():
    """The solution's attention, with v rotated by rope as well as q and k."""
    line = "q, k = kernels.rope(q, k, positions, cfg.rope_theta, cfg.rope_scaling, backend=b)"
    bug = "; _, v = kernels.rope(q, v, positions, cfg.rope_theta, cfg.rope_scaling, backend=b)"
    return solution_function("ex15_decoder_layer", "DecoderLayer.attention", line, line + bug)


def decode_rows_first():
    """The solution's attention, with the decodes' output put before the prefill's."""
    return solution_function("ex15_decoder_layer", "DecoderLayer.attention",
                             "out = parts[0] if len(parts) == 1 else torch.cat(parts)",
                             "out = parts[0] if len(parts) == 1 else torch.cat(parts[::-1])")


PLANTED_15 = {
    "keys stored before rope": (dict(attention=store_before_rope), ex15.test_attention_of_one_prompt,
                                r"case attention over one prompt.*: the cache holds the keys before rope\n"
                                r"  -> store the keys after rope"),
    "rope applied to v": (dict(attention=rope_on_v_too()), ex15.test_attention_of_one_prompt,
                          r"case attention over one prompt.*: the cache holds the values rotated by rope\n"
                          r"  -> rope turns q and k only"),
    "decode rows before prefill rows": (
        dict(attention=decode_rows_first()), ex15.test_attention_chunks_and_decodes,
        r"case step prompt 0's second chunk \(8 tokens\) and a decode of prompt 1: differ from HF: .*\n"
        r"  -> the output rows are the decodes' then the prefill's"),
    "gate and up swapped": (dict(mlp=gate_and_up_swapped), ex15.test_mlp,
                            r"case mlp of 5 rows: your mlp computes silu\(up\) \* gate\n"
                            r"  -> weights.gate_up holds the gate rows first"),
    "the attention output left out of the residual": (
        dict(__call__=residual_dropped), ex15.test_layer_first,
        r"case the whole layer .*residual None.*: the residual returned differs from HF.*\n"
        r"  -> the residual after the layer is x \+ the attention block's output"),
}


@pytest.mark.parametrize("planted", sorted(PLANTED_15))
def test_exercise_15_names_the_planted_mistake(planted, llm):
    methods, test, message = PLANTED_15[planted]
    setup = ex15.layer_setup(llm)
    with pytest.raises(pytest.fail.Exception, match=message):
        test(layer_module(**methods), setup)


def test_exercise_15_never_fails_with_a_bare_assert(llm):
    setup = ex15.layer_setup(llm)
    tests = [ex15.test_mlp, ex15.test_attention_of_one_prompt, ex15.test_attention_chunks_and_decodes,
             ex15.test_layer_first, ex15.test_layer_after_another]
    for planted, (methods, _, _) in PLANTED_15.items():
        for test in tests:
            try:
                test(layer_module(**methods), setup)
            except pytest.fail.Exception as report:
                assert str(report).startswith("case "), str(report)
            except Exception as error:   # noqa: BLE001 -- a crash is no report either
                pytest.fail(f"{test.__name__} with {planted} planted: {type(error).__name__} ({error})")


# ---- exercise 16: a draw that depends on the batch, top-p before top-k, temperature on greedy rows ---
def sampler_module(filter_logits=None, call=None):
    """exercise 16's API: the solution's filter_logits and Sampler, one of them replaced."""
    solution = load("solutions", "ex16_sampler")
    sampler = solution.Sampler if call is None else type("Planted", (solution.Sampler,), {"__call__": call})
    return types.SimpleNamespace(filter_logits=filter_logits or solution.filter_logits, Sampler=sampler)


def noise_from_one_generator(self, logits, params, seeds, positions):
    solution = load("solutions", "ex16_sampler")
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
    x = solution.filter_logits(logits.float() * (1.0 / temperature)[:, None], torch.tensor([p.top_k for p in params]),
                               torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params]))
    generator = torch.Generator().manual_seed(seeds[0])   # the bug: one generator for the whole batch
    noise = -torch.log(-torch.log(torch.rand(x.shape, generator=generator).clamp(1e-9, 1 - 1e-9)))
    drawn = (x + noise).argmax(dim=-1)
    return torch.where(torch.tensor([p.greedy for p in params]), logits.argmax(dim=-1), drawn)


def top_p_before_top_k(x, top_k, top_p, min_p):
    V = x.shape[-1]
    sorted_x = x.sort(dim=-1, descending=True).values
    probs = sorted_x.softmax(dim=-1)                     # the bug: top-p over the whole row, then top-k
    mass_before = probs.cumsum(dim=-1) - probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    cut = sorted_x.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    k = torch.where((top_k <= 0) | (top_k > V), V, top_k).long()
    cut = torch.maximum(cut, sorted_x.gather(1, k[:, None] - 1))
    cut = torch.maximum(cut, sorted_x[:, :1] + torch.log(min_p[:, None]))
    return x.masked_fill(x < cut, float("-inf"))


def temperature_on_greedy_rows(self, logits, params, seeds, positions):
    solution = load("solutions", "ex16_sampler")
    temperature = torch.tensor([p.temperature for p in params])
    x = logits.float() / temperature[:, None]            # the bug: greedy rows divided by 0 too
    x = solution.filter_logits(x, torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]),
                               torch.tensor([p.min_p for p in params]))
    keys = reference.row_keys(torch.tensor(seeds), torch.tensor(positions))
    drawn = (x + reference.gumbel_noise(keys[:, None], torch.arange(x.shape[-1])[None, :])).argmax(dim=-1)
    return torch.where(torch.tensor([p.greedy for p in params]), x.argmax(dim=-1), drawn)


def temperature_after_the_filters(self, logits, params, seeds, positions):
    solution = load("solutions", "ex16_sampler")
    device = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=device)
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    # the bug: filtered on the raw logits, scaled afterwards
    x = solution.filter_logits(logits.float(), top_k, top_p, min_p) * (1.0 / temperature)[:, None]
    keys = reference.row_keys(torch.tensor(seeds, dtype=torch.int64, device=device),
                              torch.tensor(positions, dtype=torch.int64, device=device))
    token_ids = torch.arange(x.shape[-1], device=device)
    drawn = (x + reference.gumbel_noise(keys[:, None], token_ids[None, :])).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def keyed_on_the_row_index():
    """The solution's Sampler.__call__, with each row's draw keyed on its row index, not its position."""
    return solution_function("ex16_sampler", "Sampler.__call__",
                             "torch.tensor(positions, dtype=torch.int64, device=device))",
                             "torch.arange(len(seeds), dtype=torch.int64, device=device))")


PLANTED_16 = {
    "a seeded draw that depends on batch order": (
        dict(call=noise_from_one_generator), ex16.test_a_seeded_draw_does_not_depend_on_the_batch,
        r"case 6 seeded rows drawn in one batch.*\n  -> a seeded draw depends on the batch"),
    "top-k applied after top-p": (
        dict(filter_logits=top_p_before_top_k), ex16.test_top_k_then_top_p_over_the_survivors,
        r"case top_k 2 and top_p 0.5 .*: kept tokens \[\[1, 3\]\], expected \[\[1\]\]\n"
        r"  -> top-k first, then top-p over the top-k survivors"),
    "temperature applied to greedy rows": (
        dict(call=temperature_on_greedy_rows), ex16.test_greedy_rows,
        r"case a batch of greedy rows.*: greedy rows \[.*\] took tokens .*\n"
        r"  -> a greedy row .* takes the argmax of its raw logits: do not divide it by its temperature"),
    "a seeded draw keyed on the row index": (
        dict(call=keyed_on_the_row_index()), ex16.test_seeded_tokens_are_llmlabs,
        r"case 16 seeded rows of 1000 tokens, llmlab's reference Sampler: rows \[.*\] drew other tokens than "
        r"llmlab's\n  -> your draws are keyed on the row index, not the output position"),
    "temperature applied after filtering": (
        dict(call=temperature_after_the_filters), ex16.test_temperature_scales_before_the_filters,
        r"case 2000 seeded draws of logits \[2, 1, 0, -1\] at temperature 3, top_p 0.7: tokens drawn \[0, 1\], "
        r"expected \[0, 1, 2\].*\n  -> temperature applied after filtering"),
}


@pytest.mark.parametrize("planted", sorted(PLANTED_16))
def test_exercise_16_names_the_planted_mistake(planted):
    spec, test, message = PLANTED_16[planted]
    with pytest.raises(pytest.fail.Exception, match=message):
        test(sampler_module(**spec))


def test_exercise_16_seeded_tokens_name_the_temperature_after_the_filters():
    """The seeded-tokens case, which runs first, names that mistake too (it used to say only
    which rows differ, and the case that names it came after)."""
    with pytest.raises(pytest.fail.Exception, match=r"case 16 seeded rows .*: rows \[.*\] drew other tokens than "
                                                    r"llmlab's\n  -> temperature applied after filtering"):
        ex16.test_seeded_tokens_are_llmlabs(sampler_module(call=temperature_after_the_filters))


def test_exercise_16_never_fails_with_a_bare_assert():
    tests = [f for name, f in vars(ex16).items() if name.startswith("test_") and name not in
             ("test_end_to_end", "test_the_draws_follow_the_distribution")]
    for planted, (spec, _, _) in PLANTED_16.items():
        for test in tests:
            try:
                test(sampler_module(**spec))
            except pytest.fail.Exception as report:
                assert str(report).startswith("case "), str(report)
            except Exception as error:   # noqa: BLE001 -- a crash is no report either
                pytest.fail(f"{test.__name__} with {planted} planted: {type(error).__name__} ({error})")


def test_exercise_16_chi_square_catches_a_wrong_distribution():
    """A sampler that multiplies the logits by the temperature instead of dividing draws from
    another distribution: the chi-square case fails it; the solution passes the same case."""
    solution = load("solutions", "ex16_sampler")

    def times_the_temperature(self, logits, params, seeds, positions):
        temperature = torch.tensor([p.temperature for p in params])
        x = solution.filter_logits(logits.float() * temperature[:, None],   # the bug: x * T, not x / T
                                   torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]),
                                   torch.tensor([p.min_p for p in params]))
        keys = reference.row_keys(torch.tensor(seeds), torch.tensor(positions))
        return (x + reference.gumbel_noise(keys[:, None], torch.arange(x.shape[-1])[None, :])).argmax(dim=-1)

    params = ex16.SamplingParams(temperature=0.7)
    ex16.test_the_draws_follow_the_distribution(sampler_module(), params)
    with pytest.raises(pytest.fail.Exception, match=r"are not the distribution .*chi-square p-value"):
        ex16.test_the_draws_follow_the_distribution(sampler_module(call=times_the_temperature), params)


# ---- exercise 17: a decode starved, the budget exceeded by one, a chunk past the threshold ----------
def scheduler_module(**methods):
    """exercise 17's API: the solution's Scheduler with `methods` replaced."""
    solution = load("solutions", "ex17_scheduler_step")
    return types.SimpleNamespace(Scheduler=type("Planted", (solution.Scheduler,), methods))


def prefills_before_decodes(self, now=None):
    now = self.now() if now is None else now
    plan = Plan()
    self.running.sort(key=self.policy_key(now))
    budget = self._schedule_running_prefills(plan, self.token_budget, now)   # the bug: prompts first,
    if not (plan.preempted or plan.swapped_out):                            # decodes get what is left
        budget = self._schedule_swapped(plan, budget, now)
        budget = self._schedule_waiting(plan, budget, now)
    self._schedule_decodes(plan, budget, now)
    return plan


def chunk_one_over_the_budget(self, request, budget, plan):
    return load("solutions", "ex17_scheduler_step").Scheduler._schedule_prefill(self, request, budget + 1, plan)


def chunk_ignoring_the_threshold(self, request, budget, plan):
    chunk = min(request.num_uncomputed_tokens, budget)   # the bug: no long_prefill_token_threshold
    room = (len(request.block_table) + self.blocks.num_free_blocks) * self.blocks.block_size
    chunk = min(chunk, room - request.num_computed_tokens)
    if chunk <= 0:
        return 0
    self._allocate(request, request.num_computed_tokens + chunk, plan)
    from llmlab.plan import ScheduledItem
    plan.prefills.append(ScheduledItem(request, "prefill", chunk, request.num_computed_tokens))
    return chunk


def chunk_past_the_free_blocks(self, request, budget, plan):
    chunk = min(request.num_uncomputed_tokens, budget)   # the bug: no cap at what the blocks can hold
    if self.config.long_prefill_token_threshold:
        chunk = min(chunk, self.config.long_prefill_token_threshold)
    if chunk <= 0:
        return 0
    self._allocate(request, request.num_computed_tokens + chunk, plan)
    from llmlab.plan import ScheduledItem
    plan.prefills.append(ScheduledItem(request, "prefill", chunk, request.num_computed_tokens))
    return chunk


def _waiting_without_admit():
    """The solution's _schedule_waiting with the policy's admit never asked."""
    solution = load("solutions", "ex17_scheduler_step")
    source = textwrap.dedent(inspect.getsource(solution.Scheduler._schedule_waiting))
    line = "if self.running and not self.policy.admit(request, now):"
    assert source.count(line) == 1, "the solution's admit line moved: update this planted mistake"
    namespace = dict(vars(solution))
    exec(source.replace(line, "if False:   # the bug: the policy's admit is never asked"), namespace)
    return namespace["_schedule_waiting"]


def waiting_without_admit(self, plan, budget, now):
    return _waiting_without_admit()(self, plan, budget, now)


def swap_in_without_room_to_grow(self, plan, budget, now):
    """The solution's phase 3, with no block kept for the swapped request's next token."""
    planted = solution_function("ex17_scheduler_step", "Scheduler._schedule_swapped",
                                "len(self.blocks.host_tables[request.request_id]) + 1 >",
                                "len(self.blocks.host_tables[request.request_id]) >")   # the bug: no + 1
    return planted(self, plan, budget, now)


def waiting_keeping_its_prefix(self, plan, budget, now):
    """The solution's phase 4, where a request that fit no chunk keeps the prefix blocks it matched."""
    planted = solution_function("ex17_scheduler_step", "Scheduler._schedule_waiting",
                                "self.blocks.free(request)", "pass   # the bug: its matched blocks kept")
    return planted(self, plan, budget, now)


PLANTED_17 = {
    "a decode starved by prefills": (
        dict(schedule=prefills_before_decodes), ex17.test_decodes_are_never_starved,
        r"case two decoding requests, then a long prompt arrives.*: step 2: request\(s\) \['r0', 'r1'\] were "
        r"decoding but got no token.*\n  -> a decode was starved by prefills"),
    "the token budget exceeded by one": (
        dict(_schedule_prefill=chunk_one_over_the_budget), ex17.test_budget_edge,
        r"case two prompts one token over the budget.*: step 0: the plan has 17 tokens, 1 over the token budget "
        r"of 16.*\n  -> the token budget was exceeded"),
    "a chunk that ignores the threshold": (
        dict(_schedule_prefill=chunk_ignoring_the_threshold), ex17.test_long_prefill_token_threshold,
        r"case two long prompts under long_prefill_token_threshold.*: step 0: prompt chunk\(s\) \(id, tokens\) "
        r"\[\('r0', 10\).*longer than long_prefill_token_threshold = 4\n  -> a chunk ignored the threshold"),
    "a chunk past what the free blocks hold": (
        dict(_schedule_prefill=chunk_past_the_free_blocks),
        lambda ex: ex17.test_preemption_when_out_of_blocks(ex, "recompute"),
        r"case out of blocks .*: step \d+: the step allocated more blocks than are free \(out of KV blocks.*\)\n"
        r"  -> every allocation must fit the free blocks"),
    "a swap-in without a block for the next token": (
        dict(_schedule_swapped=swap_in_without_room_to_grow),
        lambda ex: ex17.test_preemption_when_out_of_blocks(ex, "swap"),
        r"case out of blocks .*: step \d+: swapped_in is \['r1', 'r2'\], llmlab's is \['r1'\]\n"
        r"  -> swapped in too soon: .*its host blocks \+ 1 fit in the free device blocks"),
    "a prefix kept by a request that fit no chunk": (
        dict(_schedule_waiting=waiting_keeping_its_prefix), lambda ex: ex17.test_random_workloads(ex, 1),
        r"case random workload 1 .*: step \d+: waiting request\(s\) \(id, blocks\) \[\('r\d', \[.*\]\)\] hold "
        r"blocks after the step\n  -> a waiting request holds no block"),
    "the policy's admit never asked": (
        dict(_schedule_waiting=waiting_without_admit), ex17.test_the_policy_admits,
        r"case a long prompt the policy admits only when nothing runs .*: step 0: request\(s\) \['r1'\] were "
        r"admitted, but the policy's admit\(request, now\) refuses them.*\n  -> ask self.policy.admit"),
}


@pytest.mark.parametrize("planted", sorted(PLANTED_17))
def test_exercise_17_names_the_planted_mistake(planted):
    methods, test, message = PLANTED_17[planted]
    with pytest.raises(pytest.fail.Exception, match=message):
        test(scheduler_module(**methods))


def unit_tests(module, params: dict) -> list:
    """Every test of a grader module but the engine's, each as a callable of the module under test."""
    return [(lambda ex, f=f, p=params.get(name, ()): f(ex, *p)) for name, f in vars(module).items()
            if name.startswith("test_") and name != "test_end_to_end"]


PARAMS_17 = {"test_preemption_when_out_of_blocks": ("swap",), "test_random_workloads": (0,)}


def schedule_on_after_a_preemption(self, now=None):
    now = self.now() if now is None else now
    plan = Plan()
    self.running.sort(key=self.policy_key(now))
    budget = self._schedule_decodes(plan, self.token_budget, now)
    budget = self._prefill_budget(plan, budget, now)
    budget = self._schedule_running_prefills(plan, budget, now)
    budget = self._schedule_swapped(plan, budget, now)   # the bug: no stop when the step preempted anyone
    self._schedule_waiting(plan, budget, now)
    return plan


def test_exercise_17_names_a_victim_readmitted_in_the_same_step():
    """Reported before as a block not freed on recompute (the re-admission's blocks): exercise
    17 uses llmlab's preempt, which frees them."""
    with pytest.raises(pytest.fail.Exception, match=r"case out of blocks .*: step \d+: request r\d was preempted and "
                       r"is scheduled again in the same step .*\n  -> a victim re-admitted at once"):
        ex17.test_preemption_when_out_of_blocks(scheduler_module(schedule=schedule_on_after_a_preemption), "recompute")


def test_exercise_17_never_fails_with_a_bare_assert():
    for planted, (methods, _, _) in PLANTED_17.items():
        for test in unit_tests(ex17, PARAMS_17):
            try:
                test(scheduler_module(**methods))
            except pytest.fail.Exception as report:
                assert str(report).startswith("case "), str(report)
            except Exception as error:   # noqa: BLE001 -- a crash is no report either
                pytest.fail(f"a test with {planted} planted: {type(error).__name__} ({error})")


# ---- exercise 18: a block not freed on recompute, swap-in without the CPU blocks, the wrong victim --
def preemption_module(**functions):
    """exercise 18's API: the solution's functions, `functions` replacing some; the solution's
    make_room and preempt_for call the module's preempt (as a student's own functions call each other)."""
    solution = load("solutions", "ex18_preemption")
    module = types.ModuleType("planted_ex18")
    module.__dict__.update({name: getattr(solution, name) for name in
                            ("choose_victim", "preempt_for", "make_room", "preempt", "swap_in")})
    module.__dict__.update(functions)
    for name in ("make_room", "preempt_for"):
        if name not in functions:   # rebind the solution's to the planted module's functions
            module.__dict__[name] = types.FunctionType(getattr(solution, name).__code__, module.__dict__, name)
    return module


def preempt_keeping_the_blocks(scheduler, request, plan):
    scheduler.running.remove(request)
    for items in (plan.prefills, plan.decodes):
        items[:] = [item for item in items if item.request is not request]
    request.num_preemptions += 1
    if scheduler.config.preemption_mode == "swap" and scheduler.blocks.can_swap_out(request):
        plan.swap_out_copies += scheduler.blocks.swap_out(request)
        plan.swapped_out.append(request.request_id)
        request.status = RequestStatus.SWAPPED
        scheduler.swapped.append(request)
    else:
        request.num_computed_tokens = 0                  # the bug: blocks.free(request) forgotten
        plan.preempted.append(request.request_id)
        request.status = RequestStatus.WAITING
        scheduler.waiting.append(request)


def swap_in_forgetting_the_host_blocks(scheduler, request, plan):
    scheduler.swapped.remove(request)
    request.num_computed_tokens = 0                      # the bug: fresh blocks, recomputed; the host
    scheduler.blocks.allocate(request, 1)                # blocks are never copied back nor freed
    plan.swapped_in.append(request.request_id)
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)


def make_room_from_the_front(scheduler, request, num_tokens, plan, now):
    blocks = scheduler.blocks
    while blocks.blocks_needed(request, num_tokens) > blocks.num_free_blocks:
        victim = scheduler.running[0]                    # the bug: the most important request goes
        preempt_of_the_solution(scheduler, victim, plan)
        if victim is request:
            return False
    return True


def preempt_of_the_solution(scheduler, request, plan):
    load("solutions", "ex18_preemption").preempt(scheduler, request, plan)


def make_room_from_the_end_by_hand(scheduler, request, num_tokens, plan, now):
    blocks = scheduler.blocks
    while blocks.blocks_needed(request, num_tokens) > blocks.num_free_blocks:
        victim = scheduler.running[-1]                   # the bug: the default policy's victim, the policy never asked
        preempt_of_the_solution(scheduler, victim, plan)
        if victim is request:
            return False
    return True


PLANTED_18 = {
    "a block not freed on recompute": (
        dict(preempt=preempt_keeping_the_blocks), ex18.test_preempt_by_recompute_frees_every_block,
        r"case preempt a running request of 2 blocks by recompute.*: after preempt: its table \[\d+, \d+\], 0 of "
        r"6 blocks free\n  -> a block not freed on recompute"),
    "swap-in that forgets the CPU blocks": (
        dict(swap_in=swap_in_forgetting_the_host_blocks), ex18.test_swap_out_and_back_in,
        r"case preempt a running request of 2 blocks by swap, then swap it back in: plan.swap_in_copies \[\].*"
        r"6 of 8 host blocks free\n  -> swap_in forgot the CPU blocks"),
    "a victim chosen from the wrong end": (
        dict(make_room=make_room_from_the_front), ex18.test_make_room_preempts_from_the_right_end,
        r"case make room for one more block for the first of 3 running requests.*: preempted \['r0'.*\n  -> a "
        r"victim chosen from the wrong end"),
}


def test_exercise_18_names_a_victim_taken_without_the_policy():
    """running[-1] is every built-in policy's victim, so only a policy that chooses otherwise
    catches a make_room that never asks."""
    with pytest.raises(pytest.fail.Exception, match=r"case make room for the last of 3 running requests under a policy "
                       r"whose victim is the middle one: preempted \['r2'\], make_room returned False.*\n"
                       r"  -> the victim is the policy's"):
        ex18.test_make_room_asks_the_policy(preemption_module(make_room=make_room_from_the_end_by_hand))


@pytest.mark.parametrize("planted", sorted(PLANTED_18))
def test_exercise_18_names_the_planted_mistake(planted):
    functions, test, message = PLANTED_18[planted]
    with pytest.raises(pytest.fail.Exception, match=message):
        test(preemption_module(**functions))


PARAMS_18 = {"test_out_of_blocks": ("swap",), "test_random_workloads": (0,)}


@pytest.mark.parametrize("planted", sorted(PLANTED_18))
def test_exercise_18_lockstep_catches_the_planted_mistake(planted):
    """The scripted out-of-blocks runs catch each mistake too, with the same message."""
    functions, _, message = PLANTED_18[planted]
    hint = message.split("-> ")[-1]
    mode = "swap" if "swap" in planted else "recompute"
    with pytest.raises(pytest.fail.Exception, match=hint):
        ex18.test_out_of_blocks(preemption_module(**functions), mode)


def swap_in_recomputing(scheduler, request, plan):
    load("solutions", "ex18_preemption").swap_in(scheduler, request, plan)
    request.num_computed_tokens = 0                      # the bug: the K/V copied back is recomputed


def test_exercise_18_names_a_swap_in_that_recomputes():
    """Caught by the engine runs too, but there as a decode starved by prefills (a scheduler's
    mistake, not exercise 18's): the swap case names it."""
    with pytest.raises(pytest.fail.Exception, match=r"case preempt a running request of 2 blocks by swap, then swap it "
                       r"back in: num_computed_tokens is 0 after swap_in, [1-9]\d* before the swap\n  -> a swapped request "
                       r"keeps its K/V"):
        ex18.test_swap_out_and_back_in(preemption_module(swap_in=swap_in_recomputing))


def test_exercise_18_never_fails_with_a_bare_assert():
    mistakes = {**{planted: functions for planted, (functions, _, _) in PLANTED_18.items()},
                "a victim taken without the policy": dict(make_room=make_room_from_the_end_by_hand)}
    for planted, functions in mistakes.items():
        for test in unit_tests(ex18, PARAMS_18):
            try:
                test(preemption_module(**functions))
            except pytest.fail.Exception as report:
                assert str(report).startswith("case "), str(report)
            except Exception as error:   # noqa: BLE001 -- a crash is no report either
                pytest.fail(f"a test with {planted} planted: {type(error).__name__} ({error})")


@pytest.mark.slow
def test_exercise_18_end_to_end_catches_a_block_not_freed(llm):
    with pytest.raises(pytest.fail.Exception, match=r"the engine with your preemption functions"):
        ex18.test_end_to_end(preemption_module(preempt=preempt_keeping_the_blocks), llm, "recompute")


# ---- exercise 19: a stream without [DONE], the whole text in every chunk, a disconnect not aborted --
def endpoint_module(old: str, new: str, *more: tuple[str, str]):
    """exercise 19's API: the solution's module with one piece of its source replaced (or more:
    further (old, new) pairs)."""
    solution = load("solutions", "ex19_chat_endpoint")
    source = inspect.getsource(solution)
    for old, new in [(old, new), *more]:
        assert source.count(old) == 1, f"the solution no longer has {old!r}: update the planted mistake"
        source = source.replace(old, new)
    module = types.ModuleType("planted_ex19")
    exec(compile(source, "planted_ex19", "exec"), module.__dict__)
    return module


PLANTED_19 = {
    "an SSE stream without [DONE]": (
        ('            yield "data: [DONE]\\n\\n"\n', ""),                       # the bug: no [DONE] line
        lambda served, llm: ex19.test_stream_ends_with_done(served),
        r"case a streamed chat completion, read as raw server-sent events: the stream's last event is 'data: \{.*"
        r"\n  -> an SSE stream without \[DONE\]"),
    "a stream that repeats the whole text": (
        ('{"content": output.delta_text} if output.delta_text', '{"content": output.text} if output.delta_text'),
        lambda served, llm: ex19.test_streamed(served, ex19.greedy_answer(llm)),
        r"case a chat completion, streamed .*: the deltas add up to .*\n  -> a stream that repeats the whole text in "
        r"each chunk instead of the delta"),
}


@pytest.mark.parametrize("planted", sorted(PLANTED_19))
def test_exercise_19_names_the_planted_mistake(planted, llm):
    (old, new), test, message = PLANTED_19[planted]
    with ex19.serving(endpoint_module(old, new), llm) as served:
        with pytest.raises(pytest.fail.Exception, match=message):
            test(served, llm)


def test_exercise_19_names_a_prompt_too_long_answered_500(llm):
    old = ("            messages, params, stream = parse_chat_request(json.loads(await request.body()))\n"
           "            prompt_ids = await engine.tokenize(messages=messages)\n"
           "            group = await engine.add_requests([(request_id, prompt_ids, params)])\n"
           "        except ValueError as error:    # bad JSON, bad fields, a prompt too long: the client's fault\n"
           "            return bad_request(error)\n")
    new = ("            messages, params, stream = parse_chat_request(json.loads(await request.body()))\n"
           "        except ValueError as error:\n"
           "            return bad_request(error)\n"
           "        prompt_ids = await engine.tokenize(messages=messages)     # the bug: its ValueError is a 500\n"
           "        group = await engine.add_requests([(request_id, prompt_ids, params)])\n")
    with ex19.serving(endpoint_module(old, new), llm) as served:
        with pytest.raises(pytest.fail.Exception, match=r"case a chat request whose prompt is longer than the model's "
                           r"context: status 500, expected 400\n  -> tokenize raises ContextLengthError"):
            ex19.test_bad_request_is_a_400(served)


@pytest.mark.slow   # two engine runs of the 30-layer model, on a server of its own
def test_exercise_19_names_usage_that_counts_outputs(llm):
    module = endpoint_module(                            # the bug: one output counted as one token
        "            final = None\n            async for _, output in group.outputs():\n"
        "                final = output\n",
        "            final, num_outputs = None, 0\n            async for _, output in group.outputs():\n"
        "                final, num_outputs = output, num_outputs + 1\n",
        ('"completion_tokens": len(final.token_ids),\n                 "total_tokens": len(prompt_ids) + '
         'len(final.token_ids)}',
         '"completion_tokens": num_outputs,\n                 "total_tokens": len(prompt_ids) + num_outputs}'))
    with pytest.raises(pytest.fail.Exception, match=r"case a chat completion whose \d+ tokens were all generated "
                       r"before the handler read its outputs .*: usage .*\n  -> completion_tokens counted the outputs, "
                       r"not the tokens"):
        ex19.test_usage_counts_tokens_not_outputs(module, llm, ex19.greedy_answer(llm))


@pytest.mark.slow   # waits out the grader's 20 s for an abort that never comes
def test_exercise_19_catches_a_disconnect_that_does_not_abort(llm):
    old = ("        finally:\n            # also when the client hung up and Starlette cancelled this generator: abort "
           "the\n            # request, so that its KV blocks come back at once\n            group.close()\n")
    new = "        finally:\n            pass                   # the bug: the request runs on\n"
    with ex19.serving(endpoint_module(old, new), llm) as (url, async_engine):
        with pytest.raises(pytest.fail.Exception, match=r"case a client that hangs up .*\n  -> a disconnect that "
                                                        r"does not abort"):
            ex19.check_disconnect_aborts(url, async_engine, timeout=10.0)


# ---- exercise 20: a size smaller than the batch, > for >=, no eager past the ladder; on a GPU: a replay of
# ---- the buffers' old inputs, padding rows left with stale slots, a capture mid-run that stores stale slots
def padding_module(padded_batch_size):
    """exercise 20's API: the solution's module with its padded_batch_size replaced."""
    solution = load("solutions", "ex20_cuda_graphs")
    return types.SimpleNamespace(padded_batch_size=padded_batch_size, CudaGraphDecoder=solution.CudaGraphDecoder)


def largest_size_not_above(num_seqs, sizes):
    fitting = [size for size in sizes if size <= num_seqs]   # the bug: rounds down, and rows are dropped
    return fitting[-1] if fitting else sizes[0]


def strictly_larger_size(num_seqs, sizes):
    return next((size for size in sizes if size > num_seqs), None)   # the bug: > where >= is meant


def largest_size_past_the_ladder(num_seqs, sizes):
    return next((size for size in sizes if size >= num_seqs), sizes[-1])   # the bug: no None, so no eager step


PLANTED_20 = {
    "a size smaller than the batch": (
        largest_size_not_above, ex20.test_a_batch_between_sizes_replays_the_next_larger,
        r"case batches between the sizes of the ladder .*: for num_seqs \[3, 5, 7, .*\] it returned \[2, 4, 4, .*\n"
        r"  -> .*the smallest captured size >= n .*never a smaller one"),
    "> where >= is meant": (
        strictly_larger_size, ex20.test_a_batch_of_a_captured_size_replays_its_own,
        r"case batches of exactly a captured size: for num_seqs \[1, 2, 4, .*\] it returned \[2, 4, 8, .*\n"
        r"  -> .*size >= n, not > n"),
    "the largest size past the ladder": (
        largest_size_past_the_ladder, ex20.test_a_batch_past_the_largest_size_runs_eagerly,
        r"case batches past the largest size of the ladder \[1, 2, 4, 8, 16\]: for num_seqs \[17, 40\] it returned "
        r"\[16, 16\], expected \[None, None\]\n  -> .*return None"),
}


@pytest.mark.parametrize("planted", sorted(PLANTED_20))
def test_exercise_20_names_the_planted_mistake(planted):
    padded_batch_size, test, message = PLANTED_20[planted]
    with pytest.raises(pytest.fail.Exception, match=message):
        test(padding_module(padded_batch_size))


def test_exercise_20_never_fails_with_a_bare_assert():
    tests = [ex20.test_a_batch_between_sizes_replays_the_next_larger, ex20.test_a_batch_of_a_captured_size_replays_its_own,
             ex20.test_a_batch_past_the_largest_size_runs_eagerly]
    for planted, (padded_batch_size, _, _) in PLANTED_20.items():
        for test in tests:
            try:
                test(padding_module(padded_batch_size))
            except pytest.fail.Exception as report:
                assert str(report).startswith("case "), str(report)
            except Exception as error:   # noqa: BLE001 -- a crash is no report either
                pytest.fail(f"{test.__name__} with {planted} planted: {type(error).__name__} ({error})")


def cuda_graphs_module(old: str, new: str):
    """exercise 20's API: the solution's module with one piece of its source replaced."""
    solution = load("solutions", "ex20_cuda_graphs")
    source = inspect.getsource(solution)
    assert source.count(old) == 1, f"the solution no longer has {old!r}: update the planted mistake"
    module = types.ModuleType("planted_ex20")
    exec(compile(source.replace(old, new), "planted_ex20", "exec"), module.__dict__)
    return module


PLANTED_20_ON_A_GPU = {
    "a replay of the buffers' old inputs": (
        ("""        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(batch.slot_mapping)
        self.seq_lens[:num_seqs].copy_(batch.decode_seq_lens)
        self.block_tables[:num_seqs, :width].copy_(batch.decode_block_tables)
""", ""),                                  # the bug: this step's inputs never reach the static buffers
        ex20.test_replay_matches_eager,
        r"case replay 1 of 5, 3 sequences: the graph of 4.*: the logits of rows \[0, 1, 2\] differ from the eager "
        r"forward's .*\n  -> copy this step's inputs .* into the first num_seqs rows of the static buffers"),
    "padding rows left with the last step's slots": (
        ("        self.slot_mapping[num_seqs:size].fill_(-1)\n", ""),
        ex20.test_padding_rows_store_nothing,
        r"case a step of 5 sequences after one of 7 .*: slots \[.*\] were written, though no sequence of this step "
        r"stores there .*\n  -> set the padding rows' slot_mapping .* to -1"),
    "a capture mid-run over the last step's buffers": (
        ("""        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_tables.zero_()
""", ""),
        ex20.test_a_capture_mid_run_stores_nothing,
        r"case a step of 5 sequences with 2 splits after one of 7: the key \(8, 2\) is captured mid-run: slots "
        r"\[.*\] were written.*\n  -> reset the buffers .* before a capture's eager warm-up"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("planted", sorted(PLANTED_20_ON_A_GPU))
def test_exercise_20_names_the_planted_mistake_on_a_gpu(planted):
    (old, new), test, message = PLANTED_20_ON_A_GPU[planted]
    with pytest.raises(pytest.fail.Exception, match=message):
        test(cuda_graphs_module(old, new))


@pytest.mark.gpu
def test_exercise_20_never_fails_with_a_bare_assert_on_a_gpu():
    tests = [ex20.test_replay_matches_eager, ex20.test_padding_rows_store_nothing,
             ex20.test_a_capture_mid_run_stores_nothing]
    for planted, ((old, new), _, _) in PLANTED_20_ON_A_GPU.items():
        for test in tests:
            try:
                test(cuda_graphs_module(old, new))
            except pytest.fail.Exception as report:
                assert str(report).startswith("case "), str(report)
            except Exception as error:   # noqa: BLE001 -- a crash is no report either
                pytest.fail(f"{test.__name__} with {planted} planted: {type(error).__name__} ({error})")
