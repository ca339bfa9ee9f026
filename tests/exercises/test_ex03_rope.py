"""Exercise 03, rotary position embedding: what `llmlab.kernels.reference.rope` computes."""
import pytest
import torch

from diagnose import check_rows
from grading import DEVICE, FP32_TOL, check_end_to_end, randn, randn_view
from llmlab.kernels import reference

EXERCISE = "ex03_rope"
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 128)],
                         ids=["smollm2-9-3-dim-64", "4-2-dim-128"])  # SmolLM2's; Llama's head_dim
@pytest.mark.parametrize("theta,scaling", [(10000.0, None), (500000.0, LLAMA3_SCALING)], ids=["plain", "llama3"])
def test_matches_reference(ex, num_heads, num_kv_heads, head_dim, theta, scaling):
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens = 6
    q = randn_view(num_tokens, num_heads, head_dim, gen=gen)
    k = randn_view(num_tokens, num_kv_heads, head_dim, gen=gen)
    # 0 (no rotation), 1, and positions far past LLaMA-3's original 8192, where the scaling matters
    positions = torch.tensor([0, 1, 7, 100, 9000, 131000], device=DEVICE)
    actual = ex.rope(q, k, positions, theta, scaling)
    expected = reference.rope(q, k, positions, theta, scaling)
    assert isinstance(actual, tuple) and len(actual) == 2, "return (q_rotated, k_rotated)"
    for name, got, want in (("q", actual[0], expected[0]), ("k", actual[1], expected[1])):
        check_rows(got, want, case=f"rotated {name}, {num_heads}/{num_kv_heads} heads, head_dim {head_dim}, "
                   f"{'llama3 scaling' if scaling else 'plain'}, positions {positions.tolist()}", tol=FP32_TOL,
                   hint="rotate-half layout: pair dim i with dim i + head_dim/2; frequency theta^(-2i/head_dim)"
                   + (", scaled by LLaMA-3's rule for long wavelengths" if scaling else ""))


def test_strided_views_and_empty(ex):
    """q and k as the engine passes them: views into one fused projection's output."""
    qkv = randn(4, 6 + 2 + 2, 64, gen=torch.Generator().manual_seed(3))
    q, k = qkv[:, :6], qkv[:, 6:8]
    before = qkv.clone()
    positions = torch.arange(4, device=DEVICE)
    actual, expected = ex.rope(q, k, positions, 10000.0), reference.rope(q, k, positions, 10000.0)
    for name, got, want in (("q", actual[0], expected[0]), ("k", actual[1], expected[1])):
        check_rows(got, want, case=f"rotated {name} from views into one [4, 10, 64] projection", tol=FP32_TOL,
                   hint="q and k are not contiguous here: use their strides (q.stride(0) is 10 * 64)")
    assert torch.equal(qkv, before), "rope must return new tensors, not rotate its inputs in place"
    empty_q, empty_k = ex.rope(q[:0], k[:0], positions[:0], 10000.0)
    assert empty_q.shape == (0, 6, 64) and empty_k.shape == (0, 2, 64)


def test_end_to_end(ex, engine_llm, reference_token_ids):
    """The embedded model, every rotary embedding on your kernel: the same greedy text."""
    check_end_to_end(engine_llm, reference_token_ids, "rope", ex.rope)
