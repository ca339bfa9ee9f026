"""Failure messages a student can act on: which case failed, which sequences, heads or
columns differ, and what that pattern points to in the kernel.

A raw `assert_close` says "Mismatched elements: 2302 / 2880 ... at index (0, 6, 63)".
These helpers say instead, e.g.:

    case 'partial last block' (seq_lens 1, 15, 17, 56, block_size 16): 4 of 5 sequences differ
      differ: seq 0 (length 1), seq 1 (length 15), seq 3 (length 17), seq 4 (length 56)
      match:  seq 2 (length 16)
      -> lengths that are multiples of 16 match: check the mask on the last, partial block ...

Every check raises through `pytest.fail(..., pytrace=False)`, so the message is the report.
"""
from __future__ import annotations

import pytest
import torch

MAX_LISTED = 6   # sequences / heads named in a message before "..."


def _listing(items, describe) -> str:
    shown = ", ".join(describe(i) for i in items[:MAX_LISTED])
    return shown + (f", ... ({len(items)} in all)" if len(items) > MAX_LISTED else "")


def _mismatch(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """Elementwise: True where the values differ beyond the tolerance (NaN in either counts)."""
    close = torch.isclose(actual.float(), expected.float(), atol=atol, rtol=rtol)
    return ~close


def _shape_problem(actual, expected) -> str | None:
    if not isinstance(actual, torch.Tensor):
        return f"expected a tensor, got {type(actual).__name__}"
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    if actual.device != expected.device:
        return f"on {actual.device}, expected on {expected.device}"
    return None


def _worst(actual, expected, bad, describe_index) -> str:
    diff = (actual.float() - expected.float()).abs().nan_to_num(float("inf")) * bad
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    got, want = actual[index].item(), expected[index].item()
    return f"largest difference at {describe_index(index)}: got {got:.6g}, expected {want:.6g}"


def fail(case: str, lines: list[str]) -> None:
    pytest.fail(f"case {case}: " + "\n  ".join(lines), pytrace=False)


# ---- kernels over rows of a hidden dimension (rms_norm, silu_mul, rope, softmax) ---------
def check_rows(actual, expected, *, case: str, tol: dict, tile: int | None = None, hint: str = "") -> None:
    """Compare [..., n] outputs; on a mismatch say which rows and which columns differ."""
    problem = _shape_problem(actual, expected)
    if problem:
        fail(case, [problem])
    bad = _mismatch(actual, expected, **tol)
    if not bad.any():
        return
    rows = bad.reshape(-1, bad.shape[-1]) if bad.dim() else bad.reshape(1, 1)
    bad_cols = rows.any(0).nonzero().flatten().tolist()
    bad_rows = rows.any(1).nonzero().flatten().tolist()
    n = rows.shape[1]
    lines = [f"{bad.sum().item()} of {bad.numel()} values differ, in rows {_listing(bad_rows, str)} "
             f"of {rows.shape[0]}; columns {bad_cols[0]}..{bad_cols[-1]} of {n}"]
    if actual.isnan().any() and not expected.isnan().any():
        lines.append("-> your output has NaN: the kernel read past the end of its data (the grader "
                     "puts NaN just past every input) -- mask the loads of the last, partial tile")
    elif len(bad_cols) == n and n > 1:
        lines.append("-> every column of those rows differs: a statistic of the whole row (a sum, a max, the "
                     "mean of the squares) is off -- did lanes past the end of the row get into it?")
    elif tile and bad_cols[0] >= (n // tile) * tile and n % tile:
        lines.append(f"-> only the last partial tile (columns {(n // tile) * tile}..{n - 1}, {n} is not a "
                     f"multiple of {tile}) differs: check its mask")
    lines.append(_worst(actual, expected, bad, lambda i: f"index {i}"))
    if hint:
        lines.append(f"hint: {hint}")
    fail(case, lines)


# ---- attention over a paged cache (decode: one row per sequence; prefill: many) ----------
def check_attention(actual, expected, *, case: str, tol: dict, seq_lens: list[int], block_size: int,
                    num_kv_heads: int, query_lens: list[int] | None = None, hint: str = "",
                    notes: list[str] = ()) -> None:
    """Compare [tokens, heads, head_dim] attention outputs. query_lens=None: decode (one query
    row per sequence); else prefill, rows grouped by sequence (query_lens[i] rows for seq i)."""
    problem = _shape_problem(actual, expected)
    if problem:
        fail(case, [problem])
    bad = _mismatch(actual, expected, **tol)            # [tokens, heads, head_dim]
    if not bad.any():
        return
    prefill = query_lens is not None
    query_lens = query_lens if prefill else [1] * len(seq_lens)
    row_seq = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens, dtype=torch.long))
    bad_rows = bad.any(-1).cpu()                          # [tokens, heads]
    nan_rows = (actual.isnan() & ~expected.isnan()).any(-1).any(-1).cpu()
    bad_seqs = sorted({int(row_seq[r]) for r in bad_rows.any(-1).nonzero().flatten()})
    good_seqs = [s for s in range(len(seq_lens)) if s not in bad_seqs and query_lens[s] > 0]
    nan_seqs = sorted({int(row_seq[r]) for r in nan_rows.nonzero().flatten()})

    def seq(s):
        new = f", {query_lens[s]} new" if prefill and query_lens[s] != seq_lens[s] else ""
        return f"seq {s} (length {seq_lens[s]}{new})"

    lines = [f"{len(bad_seqs)} of {len(seq_lens)} sequences differ",
             f"differ: {_listing(bad_seqs, seq)}"]
    if good_seqs:
        lines.append(f"match:  {_listing(good_seqs, seq)}")
    lines += _attention_patterns(bad_seqs, good_seqs, nan_seqs, bad_rows, seq_lens, query_lens,
                                 block_size, num_kv_heads, prefill)
    lines += notes
    lines.append(_worst(actual, expected, bad, lambda i: f"token row {i[0]} (seq {int(row_seq[i[0]])}), "
                                                         f"head {i[1]}, dim {i[2]}"))
    if hint:
        lines.append(f"hint: {hint}")
    fail(case, lines)


def _attention_patterns(bad_seqs, good_seqs, nan_seqs, bad_rows, seq_lens, query_lens, block_size,
                        num_kv_heads, prefill) -> list[str]:
    """What the set of failing sequences and heads points to (several may apply)."""
    out = []
    lens_bad = [seq_lens[s] for s in bad_seqs]
    lens_good = [seq_lens[s] for s in good_seqs]
    if nan_seqs:
        out.append(f"-> NaN in seqs {_listing(nan_seqs, str)}: the kernel read a cache slot no sequence owns "
                   "(the grader fills those with NaN): mask every load past seq_len -- the block-table "
                   "entry and the K/V rows -- and give those keys score -inf")
    if (lens_bad and all(n % block_size for n in lens_bad)
            and any(n % block_size == 0 for n in lens_good)):
        out.append(f"-> lengths that are multiples of {block_size} match, the others differ: check the "
                   "mask on the last, partial block (keys n >= seq_len)")
    chunk_pattern = False
    if prefill:
        chunks_bad = [s for s in bad_seqs if 0 < query_lens[s] < seq_lens[s]]
        whole_good = [s for s in good_seqs if query_lens[s] == seq_lens[s]]
        chunk_pattern = bool(chunks_bad) and len(chunks_bad) == len(bad_seqs) and bool(whole_good)
        if chunk_pattern:
            out.append("-> whole prompts match, later chunks (cached tokens before the new ones) differ: "
                       "query i of a chunk of q_len new tokens sits at position seq_len - q_len + i; the "
                       "causal mask and the keys it reads must use that position")
    if not chunk_pattern and lens_bad and lens_good and min(lens_bad) > block_size >= max(lens_good):
        out.append(f"-> sequences that fit in one block ({block_size} tokens) match, longer ones differ: "
                   "check the block index -- key n lives in block block_tables[seq, n // block_size], "
                   "row n % block_size")
    num_heads = bad_rows.shape[1]
    heads_bad = bad_rows.any(0).nonzero().flatten().tolist()
    if 0 < len(heads_bad) < num_heads:
        group = num_heads // num_kv_heads
        out.append(f"-> query heads {_listing(heads_bad, str)} of {num_heads} differ, the others match: check "
                   f"which kv head each query head reads (kv_head = head // {group}: "
                   f"{num_heads} query heads share {num_kv_heads} kv heads)")
    return out


# ---- end to end -------------------------------------------------------------------------
def check_same_text(actual: list[list[int]], expected: list[list[int]], *, tokenizer, prompts, kernel: str) -> None:
    """Greedy token ids of the model with the student's kernel vs llmlab's, shown as text."""
    if actual == expected:
        return
    lines = [f"the model's greedy output changed with your {kernel} plugged in"]
    for prompt, got, want in zip(prompts, actual, expected):
        if got == want:
            lines.append(f"same  {prompt!r} -> {tokenizer.decode(want)!r}")
            continue
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        lines.append(f"DIFF  {prompt!r}\n      yours:   {tokenizer.decode(got)!r}\n"
                     f"      llmlab:  {tokenizer.decode(want)!r}\n      (first different token: #{first})")
    lines.append("the kernel tests above isolate one mistake each: fix those first; if they all pass, "
                 "the engine hit a shape they do not cover -- tell us")
    fail(f"end to end ({kernel})", lines)
