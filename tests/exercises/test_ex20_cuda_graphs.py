"""Exercise 20, CUDA graphs for decode steps. Everywhere: the batch size a decode step
replays (padded_batch_size), one case per mistake. On a CUDA GPU only (marked `gpu`, skipped
elsewhere with "needs a CUDA device: graded on a GPU only"): the student's replayed logits
against the eager forward's for batches between the ladder's sizes, one step after another
and with a key captured mid-run; padding rows and mid-run captures that store nothing; then
the real engine with the student's CudaGraphDecoder plugged in
(LLMEngine(config, cuda_graphs=CudaGraphDecoder)) writes the default engine's greedy tokens."""
from __future__ import annotations

import functools

import pytest
import torch

from diagnose import fail
from llmlab.cuda_graphs.decode import batch_size_ladder

EXERCISE = "ex20_cuda_graphs"
GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: graded on a GPU only")


def expect(ok, case: str, what: str, hint: str) -> None:
    if not ok:
        fail(case, [what, f"-> {hint}"])


# ---- everywhere: the batch size a decode step replays ---------------------------------------------------

LADDER = batch_size_ladder(512)   # 1, 2, 4, 8, 16, ..., 248, 256, 272, ..., 512


def padded_case(ex, case: str, sizes: list[int], expected: dict, hint: str) -> None:
    got = {n: ex.padded_batch_size(n, sizes) for n in expected}
    wrong = [n for n in expected if got[n] != expected[n]]
    expect(not wrong, case, f"for num_seqs {wrong} it returned {[got[n] for n in wrong]}, expected "
                            f"{[expected[n] for n in wrong]}", hint)


def test_a_batch_between_sizes_replays_the_next_larger(ex):
    expected = {3: 4, 5: 8, 7: 8, 9: 16, 15: 16, 17: 24, 100: 104, 255: 256, 257: 272, 300: 304, 511: 512}
    padded_case(ex, f"batches between the sizes of the ladder {LADDER[:6]} ... {LADDER[-3:]}", LADDER, expected,
                "a graph replays exactly the rows it was captured with, so a batch of n sequences needs a graph of "
                "at least n rows: the smallest captured size >= n (its rows past n are padding), never a smaller one")


def test_a_batch_of_a_captured_size_replays_its_own(ex):
    expected = {n: n for n in (1, 2, 4, 8, 16, 24, 248, 256, 272, 512)}
    padded_case(ex, "batches of exactly a captured size", LADDER, expected,
                "a batch of exactly a captured size replays that size's graph, with no padding: size >= n, not > n")


def test_a_batch_past_the_largest_size_runs_eagerly(ex):
    sizes = batch_size_ladder(16)
    padded_case(ex, f"batches past the largest size of the ladder {sizes}", sizes, {17: None, 40: None, 16: 16},
                "no captured size holds a batch past the largest one: return None (the step then runs eagerly)")


# ---- on a CUDA GPU: capture and replay --------------------------------------------------------------------

DEVICE, BACKEND = "cuda", "triton"   # where the graphs are captured: the engine's graphs need both
BLOCK_SIZE = 16
NUM_BLOCKS = 320
MAX_NUM_SEQS = 16                 # the ladder 1, 2, 4, 8, 16
MAX_BLOCKS_PER_SEQ = 48           # contexts up to 768 tokens
# fp32 with the Triton kernels (ieee dots): a padded batch runs its matrix products over 8 rows
# where the eager forward has 5, which may sum in another order (~1e-6 of logits of order 1);
# inputs that are not this step's change the logits by their whole size
TOL = dict(atol=1e-3, rtol=1e-3)


@functools.cache
def small_model():
    """tests/engine/test_gpu.py's small random Llama-3 (4 layers, hidden 1024, GQA 8/2), in
    float32 on the GPU."""
    from helpers.engine import SMALL_LLAMA3
    from llmlab.config import ModelConfig
    from llmlab.model.llama import LlamaModel

    return LlamaModel.random(ModelConfig.from_hf(SMALL_LLAMA3), torch.float32, DEVICE, seed=1)


def random_kv_cache(seed: int):
    """A KV cache of NUM_BLOCKS blocks whose every slot holds random K/V (earlier tokens' K/V)."""
    from llmlab.cache.kv_cache import KVCache

    cache = KVCache(small_model().config, NUM_BLOCKS, 0, BLOCK_SIZE, torch.float32, torch.device(DEVICE))
    cache.device.normal_(generator=torch.Generator(DEVICE).manual_seed(seed))
    return cache


def decode_batch(contexts: list[int], num_splits: int, seed: int):
    """input_ids (random tokens), positions and the ForwardBatch of one decode step whose
    sequences have these context lengths (the new token included), in fresh tensors."""
    from llmlab.engine.batch import dummy_plan, prepare

    plan = dummy_plan(BLOCK_SIZE, decodes=contexts)
    input_ids, positions, batch = prepare(plan, BLOCK_SIZE, torch.device(DEVICE), num_splits, BACKEND)
    tokens = torch.randint(16, small_model().config.vocab_size, (len(contexts),),
                           generator=torch.Generator().manual_seed(seed))
    return tokens.to(input_ids), positions, batch


def random_contexts(num_seqs: int, longest: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, longest + 1, (num_seqs,), generator=gen).tolist()


def graph_decoder(ex, cache):
    return ex.CudaGraphDecoder(small_model(), cache, MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ, BACKEND)


# (what the case checks, context lengths, splits): one decoder runs them in this order
REPLAY_CASES = [
    ("3 sequences: the graph of 4, one padding row", random_contexts(3, 200, 0), 1),
    ("13 sequences: the graph of 16, three padding rows", random_contexts(13, 200, 1), 1),
    ("5 sequences: the graph of 8", random_contexts(5, 200, 2), 1),
    ("3 sequences again, other tokens and contexts: the graph of 4 a second time", random_contexts(3, 600, 3), 1),
    ("5 sequences with 2 flash-decoding splits: the key (8, 2), not captured yet", random_contexts(5, 600, 4), 2),
]
REPLAY_HINTS = [
    "copy this step's inputs (input_ids, positions, slot_mapping, seq_lens, block tables) into the first num_seqs "
    "rows of the static buffers before the replay: the graph reads the buffers it was captured with, never the "
    "tensors run() is given",
    None, None,
    "the graph of 4 replayed an earlier step's inputs: copy into the buffers on every run (buffer[:n].copy_(x)); "
    "rebinding an attribute (self.input_ids = x) changes nothing the graph reads",
    "a key missing at start-up is captured when first asked for, under (size, batch.num_splits), and before "
    "this step's inputs are copied in (the capture resets the buffers)",
]


@pytest.mark.gpu
@GPU_ONLY
def test_replay_matches_eager(ex):
    cache = random_kv_cache(0)
    decoder = graph_decoder(ex, cache)
    model = small_model()
    for i, (what, contexts, num_splits) in enumerate(REPLAY_CASES):
        case = f"replay {i + 1} of {len(REPLAY_CASES)}, {what} (contexts {contexts})"
        input_ids, positions, batch = decode_batch(contexts, num_splits, seed=10 + i)
        expected = model.forward(input_ids, positions, batch, cache.device, cache.device_scales).clone()
        got = decoder.run(input_ids, positions, batch)
        expect(isinstance(got, torch.Tensor) and got.shape == expected.shape, case,
               f"run returned {getattr(got, 'shape', type(got).__name__)}, expected logits {tuple(expected.shape)}",
               "return the logits of the real rows only: the graph's output [:num_seqs], [num_seqs, vocab]")
        got = got.clone()   # the next replay writes the same memory
        rows = [r for r in range(len(contexts)) if not torch.allclose(got[r], expected[r], **TOL)]
        hint = next(h for h in REPLAY_HINTS[i::-1] if h)
        expect(not rows, case, f"the logits of rows {rows} differ from the eager forward's (largest difference "
                               f"{(got - expected).abs().max().item():.3g})", hint)


def slots_written(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """The cache slots (block * BLOCK_SIZE + row) whose K or V changed, in any layer or head."""
    changed = (before != after).any(dim=5).any(dim=4).any(dim=1).any(dim=0)   # [num_blocks, block_size]
    return set(changed.flatten().nonzero().flatten().tolist())


def stores_only_its_slots(ex, case: str, num_splits: int, hint: str) -> None:
    """A decode step of 7 sequences, then the cache refilled (its blocks changed hands), then a
    step of 5 other sequences with `num_splits`: the second stores into its own 5 slots only."""
    cache = random_kv_cache(1)
    decoder = graph_decoder(ex, cache)
    decoder.run(*decode_batch([30] * 7, 1, seed=20))
    cache.device.normal_(generator=torch.Generator(DEVICE).manual_seed(2))
    before = cache.device.clone()
    input_ids, positions, batch = decode_batch([50] * 5, num_splits, seed=21)
    decoder.run(input_ids, positions, batch)
    torch.cuda.synchronize()   # the replay is asynchronous: read the cache after it
    stray = sorted(slots_written(before, cache.device) - set(batch.slot_mapping.tolist()))
    expect(not stray, case, f"slots {stray} were written, though no sequence of this step stores there "
                            f"(its slots: {batch.slot_mapping.tolist()})", hint)


@pytest.mark.gpu
@GPU_ONLY
def test_padding_rows_store_nothing(ex):
    stores_only_its_slots(
        ex, "a step of 5 sequences after one of 7 (both replay the graph of 8)", 1,
        "set the padding rows' slot_mapping (rows num_seqs..size) to -1 before the replay: they still hold the "
        "previous step's slots, whose blocks may belong to other requests by now")


@pytest.mark.gpu
@GPU_ONLY
def test_a_capture_mid_run_stores_nothing(ex):
    stores_only_its_slots(
        ex, "a step of 5 sequences with 2 splits after one of 7: the key (8, 2) is captured mid-run", 2,
        "reset the buffers (slot_mapping -1, seq_lens 1, block_tables 0) before a capture's eager warm-up: that "
        "run really executes, with whatever the last step left in the buffers")


def engine_greedy(cuda_graphs=None):
    """Greedy tokens of the small model's engine (fp32, Triton kernels, graphs replayed) for
    prompts of 1 to 700 tokens whose max_tokens differ, so that the decode batch shrinks
    6, 5, 4, 3, 2, 1 (sizes between the ladder's: padding) and long contexts ask for splits > 1;
    and the engine."""
    from llmlab import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(device=DEVICE, dtype="float32", backend=BACKEND, num_gpu_blocks=512,
                          max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=1024)
    plugged = {} if cuda_graphs is None else dict(cuda_graphs=cuda_graphs)
    engine = LLMEngine(config, model=small_model(), **plugged)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(16, 32000, (n,), generator=gen).tolist() for n in (5, 17, 40, 33, 700, 1)]
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
           for prompt, max_tokens in zip(prompts, (24, 20, 16, 12, 8, 4))]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids], engine


@pytest.mark.gpu
@GPU_ONLY
def test_end_to_end(ex):
    case = "the engine with your CudaGraphDecoder: 6 greedy requests, decode batches of 6 down to 1"

    class Counted(ex.CudaGraphDecoder):
        """Yours, counting its replays: a run that never replays would prove nothing."""
        replays = 0

        def run(self, input_ids, positions, batch):
            Counted.replays += 1
            return super().run(input_ids, positions, batch)

    expected, _ = engine_greedy()
    got, engine = engine_greedy(Counted)
    expect(Counted.replays > 0 and isinstance(engine.runner.graphs, Counted), case,
           f"the engine replayed your graphs {Counted.replays} times", "the engine replays them when "
           "can_run(num_seqs) is True for a decode step: keep can_run and the constructor's captures as given")
    differ = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    firsts = [next((t for t, (a, b) in enumerate(zip(got[i], expected[i])) if a != b), None) for i in differ]
    expect(not differ, case, f"requests {differ} wrote other tokens than the default engine's (first different "
                             f"token: {firsts})",
           "the cases above isolate one mistake each: fix those first; if they all pass, compare what the engine "
           "passes run() (a ForwardBatch from engine/batch.py: its block tables are as wide as the longest "
           "sequence's) with what those cases pass")
