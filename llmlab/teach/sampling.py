"""Notebook 10, sampling: temperature, top-p and min-p on a four-token distribution, computed by
`Sampler.probabilities` (the exact distribution the engine draws from); the logprob the sampler
reports for a drawn token (`Sampler.logprobs`)."""
from __future__ import annotations

import math

import torch

from llmlab.sampling import Sampler, SamplingParams
from llmlab.teach.check import close, integer, number, right, wrong

PROBS = (0.5, 0.3, 0.15, 0.05)     # the next-token distribution at temperature 1 in every question


def distribution(**params) -> torch.Tensor:
    logits = torch.tensor(PROBS).log()[None, :]
    return Sampler.probabilities(logits, [SamplingParams(**params)])[0]


def q1(answer):
    """Next-token probabilities 0.5, 0.3, 0.15, 0.05 (at temperature 1). With top_p = 0.75, how many
    tokens can be drawn?"""
    n = integer(answer)
    expected = int((distribution(temperature=1.0, top_p=0.75) > 0).sum())
    if n == expected:
        return right("top-p keeps the smallest set of most likely tokens whose mass reaches p: the first "
                     "token alone has 0.5 < 0.75, the next one takes it past.")
    if n == expected - 1:
        return wrong("the set must reach 0.75; does the most likely token alone?")
    if n == expected + 1:
        return wrong("the smallest set that reaches 0.75: the third token is not needed.")
    return wrong("add up the probabilities from the most likely down, until the sum reaches 0.75.")


def q2(answer):
    """The same distribution with min_p = 0.2: how many tokens can be drawn?"""
    n = integer(answer)
    expected = int((distribution(temperature=1.0, min_p=0.2) > 0).sum())
    if n == expected:
        return right("min-p drops tokens below min_p x the top token's probability (0.2 x 0.5 = 0.1): it "
                     "cuts relative to how sure the model is.")
    if n == sum(p >= 0.2 for p in PROBS):
        return wrong("min_p is not a probability threshold by itself: it is relative to the most likely token.")
    return wrong("keep the tokens whose probability is at least min_p times the largest one.")


def q3(answer):
    """The same distribution at temperature 2: what is the probability of the most likely token now?"""
    value = number(answer)
    expected = distribution(temperature=2.0).max().item()
    if close(value, expected, 0.005):
        return right("dividing the logits by 2 takes the square root of every probability before "
                     "renormalizing: the top token loses mass to the tail (flatter).")
    if close(value, 0.5, 0.005):
        return wrong("temperature changes the distribution: the logits are divided by T before the softmax.")
    if close(value, 0.25, 0.005) or value > 0.5:
        return wrong("dividing logits by T = 2 is not dividing probabilities by 2; a higher temperature "
                     "flattens: the top token loses some mass, not all of it.")
    return wrong("logits = log(p); softmax(logits / 2), or Sampler.probabilities with temperature=2.0.")


def q4(answer):
    """The same distribution, `SamplingParams(temperature=2.0, logprobs=1)`: the most likely token is
    drawn. What logprob does the engine report for it?"""
    value = number(answer)
    params = SamplingParams(temperature=2.0, logprobs=1)
    logits = torch.tensor(PROBS).log()[None, :]
    expected = Sampler().logprobs(logits, [params], torch.tensor([0])).entries()[0].logprob
    if close(value, expected, 0.005):
        return right("a sampled token's logprob is under the distribution it was drawn from: after the "
                     "temperature (and any top-k / top-p / min-p cut), as vLLM reports it by default.")
    if close(value, math.log(PROBS[0]), 0.005):
        return wrong("that is the model's own logprob, at temperature 1; the engine reports it under the "
                     "distribution the token was drawn from.")
    if value > 0:
        return wrong("a log-probability is the log of a probability: never above 0.")
    if close(value, math.log(PROBS[0]) / 2, 0.005):
        return wrong("temperature divides the logits, not the logprobs: take the log of the probability "
                     "after softmax(logits / T).")
    return wrong("the probability of the top token at T = 2 (question 3), then its natural log.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3, "q4": q4}
