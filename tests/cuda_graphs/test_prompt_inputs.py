"""A step staged into a prompt graph's buffers (cuda_graphs/prompt.py's PromptInputs), on
the CPU: the model's attention over the staged batch (both attentions over every row,
prefill sequences padded with empty ones, decode rows chosen by `decode_rows`) gives the
step's attention by the reference (its prefill chunks' prefill attention, then its decodes'
decode attention), whatever an earlier, larger step left in the buffers; padding tokens
store nothing."""
import pytest
import torch

from llmlab import kernels
from llmlab.cuda_graphs.prompt import MAX_PROMPTS, TOKEN_SIZES, PromptInputs, padded_token_count
from llmlab.model.llama import ForwardBatch

from helpers.engine import TINY, tiny_model
from helpers.kernels import BACKENDS, FP32_TOL, NAN, paged_kv

HEADS, KV_HEADS, DIM, BLOCK = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim, 16


def step(prefills, decodes, gen):
    """(q, caches, ForwardBatch) of a step: prefills as (chunk, context) pairs, decodes as
    contexts; the prefill chunks' block tables narrower than the decodes' when they can be."""
    seq_lens = [context for _, context in prefills] + list(decodes)
    k_cache, v_cache, tables = paged_kv(seq_lens, BLOCK, KV_HEADS, DIM, torch.float32, gen)
    p, chunks = len(prefills), [chunk for chunk, _ in prefills]
    width = 1 + max((-(-context // BLOCK) for _, context in prefills), default=0)
    cu = torch.tensor([0] + chunks, dtype=torch.int32).cumsum(0).to(torch.int32)
    n = sum(chunks) + len(decodes)
    ints = lambda values: torch.tensor(values, dtype=torch.int32)
    batch = ForwardBatch(
        num_prefill_tokens=sum(chunks), slot_mapping=torch.arange(n), prefill_cu_seqlens_q=cu,
        prefill_seq_lens=ints(seq_lens[:p]), prefill_block_tables=tables[:p, :width].contiguous(),
        decode_seq_lens=ints(seq_lens[p:]), decode_block_tables=tables[p:].contiguous(),
        logits_indices=torch.arange(0))
    q = torch.randn(n, HEADS, DIM, generator=gen)
    return q, k_cache, v_cache, batch


def steps_attention(q, k_cache, v_cache, batch: ForwardBatch):
    """The eager step's attention (LlamaModel.attend_stored), by the reference."""
    p, scale = batch.num_prefill_tokens, DIM ** -0.5
    prefill = kernels.prefill_attention(q[:p], k_cache, v_cache, batch.prefill_block_tables,
                                        batch.prefill_cu_seqlens_q, batch.prefill_seq_lens, scale,
                                        backend="reference")
    decode = kernels.decode_attention(q[p:], k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens,
                                      scale, backend="reference")
    return torch.cat([prefill, decode])


# mixed (chunks after a cached context, decodes around block edges), decodes alone, a
# prefill alone, one token each, a step that fills its graph size exactly, and the most
# prompt chunks a graph holds
STEPS = [([(7, 30), (20, 20)], [5, 90, 33]), ([], [3, 17, 40, 16]), ([(16, 16)], []), ([(1, 1)], [1]),
         ([(29, 29)], [2, 33, 64]), ([(3, 3 + i) for i in range(MAX_PROMPTS)], [4, 5])]


@BACKENDS
@pytest.mark.parametrize("prefills,decodes", STEPS)
def test_the_attention_over_the_staged_buffers_is_the_steps_attention(backend, prefills, decodes):
    gen = torch.Generator().manual_seed(0)
    inputs = PromptInputs(64, 8, "cpu")
    q, k_cache, v_cache, batch = step(prefills, decodes, gen)
    # an earlier, larger step leaves its sequences, slots and tables (of the same cache's
    # blocks, as every step's) in the buffers
    _, _, _, earlier = step([(40, 50)], [9] * 20, gen)
    for tables in (earlier.prefill_block_tables, earlier.decode_block_tables):
        tables.remainder_(k_cache.shape[0])
    inputs.stage(torch.zeros(60, dtype=torch.int64), torch.zeros(60, dtype=torch.int64), earlier, 64)
    n = q.shape[0]
    size = padded_token_count(n, TOKEN_SIZES)
    inputs.stage(torch.arange(n), torch.arange(n), batch, size)
    staged = inputs.batch(size, backend=backend)
    assert torch.equal(inputs.slot_mapping[:n], batch.slot_mapping)
    assert (inputs.slot_mapping[n:size] == -1).all()   # padding tokens store nothing
    q_padded = torch.full((size, HEADS, DIM), NAN)     # padding rows are never read
    q_padded[:n] = q
    out = tiny_model().attend_stored(q_padded, staged, k_cache, v_cache)
    expected = steps_attention(q, k_cache, v_cache, batch).reshape(n, HEADS * DIM)
    torch.testing.assert_close(out[:n], expected, **FP32_TOL)
