"""The prompts of `llmlab bench serving`, in one place, so that `llmlab bench offline
--dataset serving-synthetic` runs exactly the prompts a serving run sends (the same text,
so the same token ids from the same tokenizer, and the same output lengths).

Synthetic prompts (the default) are `Workload.lognormal`'s lengths, drawn from lognormal
distributions with the means of ShareGPT conversations (161 prompt and 338 output tokens,
vLLM paper §6), made of random common words (about one token each), reproducible from
the seed; or lines of a JSONL file of {"prompt": ..., "output_len": ...}. Each point of a
serving sweep puts a first word of its own in front of them (`for_rate`); the offline run
takes the first point's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from llmlab.experiments.workload import (FIRST_TOKEN_ID, SHAREGPT_MEAN_OUTPUT_LEN, SHAREGPT_MEAN_PROMPT_LEN, Workload,
                                         lognormal_lengths)

# Short, common words: each is one token in LLaMA-family tokenizers when preceded by a space.
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have "
         "from or one had by word but not what all were we when your can said there use an each "
         "which she do how their if will up other about out many then them these so some her "
         "would make like him into time has look two more write go see number no way could people "
         "my than first water been call who oil its now find long down day did get come made may "
         "part over new sound take only little work know place year live me back give most very "
         "after thing our just name good sentence man think say great where help through much "
         "before line right too mean old any same tell boy follow came want show also around form "
         "three small set put end does another well large must big even such because turn here "
         "why ask went men read need land different home us move try kind hand picture again "
         "change off play spell air away animal house point page letter mother answer found study "
         "still learn should world high every near add food between own below country plant last "
         "school father keep tree never start city earth eye light thought head under story saw").split()


@dataclass
class Prompt:
    text: str
    output_len: int
    input_len: int | None = None     # requested (synthetic) length; the server's usage is exact


def synthetic_prompts(num_prompts: int, seed: int = 0, mean_input_len: float = SHAREGPT_MEAN_PROMPT_LEN,
                      mean_output_len: float = SHAREGPT_MEAN_OUTPUT_LEN, sigma: float = 1.0,
                      max_input_len: int = 1024, max_output_len: int = 1024) -> list[Prompt]:
    """`Workload.lognormal`'s requests as text: its ids are drawn from a vocabulary of WORDS,
    and each becomes its word."""
    workload = Workload.lognormal(num_prompts, mean_input_len, mean_output_len, sigma, max_input_len, max_output_len,
                                  seed=seed, vocab_size=FIRST_TOKEN_ID + len(WORDS))
    return [Prompt(" ".join(WORDS[i - FIRST_TOKEN_ID] for i in r.prompt_token_ids), r.output_len,
                   len(r.prompt_token_ids)) for r in workload]


def jsonl_prompts(path: str, num_prompts: int, seed: int = 0, mean_output_len: float = SHAREGPT_MEAN_OUTPUT_LEN,
                  max_output_len: int = 1024) -> list[Prompt]:
    """Lines of {"prompt": str, "output_len": int (optional: else drawn like the synthetic ones)}."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows or not all(isinstance(r.get("prompt"), str) for r in rows):
        raise ValueError(f"{path}: every line must be a JSON object with a string 'prompt'")
    order = rng.permutation(len(rows))[:num_prompts]
    sampled = lognormal_lengths(rng, len(order), mean_output_len, 1.0, 1, max_output_len)
    return [Prompt(rows[i]["prompt"], int(rows[i].get("output_len") or m)) for i, m in zip(order, sampled)]


def for_rate(prompts: list[Prompt], index: int) -> list[Prompt]:
    """The prompts for point `index` of a sweep: each behind the same first word, one word
    (about one token) per point, so no point's prompts share a first KV block with
    another's and a prefix-caching server computes every point's prompts in full."""
    word = WORDS[index % len(WORDS)]
    return [replace(p, text=f"{word} {p.text}", input_len=None if p.input_len is None else p.input_len + 1)
            for p in prompts]


def add_synthetic_arguments(parser) -> None:
    """The synthetic prompts' lengths: the same flags, with the same defaults, for bench
    serving and bench offline --dataset serving-synthetic."""
    parser.add_argument("--mean-input-len", type=float, default=SHAREGPT_MEAN_PROMPT_LEN)
    parser.add_argument("--mean-output-len", type=float, default=SHAREGPT_MEAN_OUTPUT_LEN)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)


def synthetic_prompts_of(args, num_prompts: int, seed: int) -> list[Prompt]:
    """`synthetic_prompts` with the lengths of `add_synthetic_arguments`' flags."""
    return synthetic_prompts(num_prompts, seed, args.mean_input_len, args.mean_output_len,
                             max_input_len=args.max_input_len, max_output_len=args.max_output_len)
