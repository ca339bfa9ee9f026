"""The graders say what is wrong: each planted mistake (a solution with one bug put in) fails
the case that isolates it, with a message that names the mistake and what to check, not a
bare assert nor a hint about another mistake.

Grades the graders, not a student's work: not collected with --impl=exercises (conftest.py).
"""
from __future__ import annotations

import importlib.util
import inspect
import types

import pytest
import torch

import test_ex09_block_allocator as ex09
import test_ex12_quantized_store_kv as ex12
import test_ex13_block_manager as ex13
import test_ex14_detokenizer as ex14
import test_ex15_decoder_layer as ex15
import test_ex16_sampler as ex16
from grading import load
from llmlab import kernels
from llmlab.kernels import reference


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


PLANTED_15 = {
    "keys stored before rope": (dict(attention=store_before_rope), ex15.test_attention_of_one_prompt,
                                r"case attention over one prompt.*: the cache holds the keys before rope\n"
                                r"  -> store the keys after rope"),
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
}


@pytest.mark.parametrize("planted", sorted(PLANTED_16))
def test_exercise_16_names_the_planted_mistake(planted):
    spec, test, message = PLANTED_16[planted]
    with pytest.raises(pytest.fail.Exception, match=message):
        test(sampler_module(**spec))


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
