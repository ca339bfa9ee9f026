"""Notebook 14, tensor and pipeline parallelism: who holds what, from the placement code the
ranks themselves run, and the pipeline's bubble."""
from __future__ import annotations

from llmlab.engine.parallel.placement import RankLayout, stage_layers
from llmlab.model.tensor_parallel import shard_config
from llmlab.teach.check import close, fraction, integer, integers, right, wrong
from llmlab.teach.ground_truth import embedded_config


def q1(answer):
    """tensor_parallel_size=3: which rank (0, 1 or 2) computes query head 7 of every layer?"""
    rank = integer(answer)
    heads_per_rank = shard_config(embedded_config(), 3).num_heads
    if rank == 7 // heads_per_rank:
        return right("the 9 query heads are cut into 3 contiguous groups of 3, and each rank keeps the kv head "
                     "its group reads.")
    if rank == 7 % 3:
        return wrong("heads are not dealt out in turn: each rank takes a contiguous group, so that its group "
                     "shares one kv head.")
    return wrong("9 heads, 3 ranks, contiguous groups: look at the placement figure.")


def q2(answer):
    """pipeline_parallel_size=4 (and no tensor parallelism): which layers does rank 2 hold? Answer
    (first, last), e.g. (0, 7)."""
    first_last = integers(answer)
    stages = stage_layers(embedded_config().num_layers, 4)
    if first_last == (stages[2][0], stages[2][-1]):
        return right("30 layers over 4 stages: 8, 8, 7 and 7, the first stages taking the extra ones (rank 0's "
                     "memory then sizes a cache every stage can mirror).")
    if len(first_last) != 2:
        return wrong("answer two numbers: the first layer and the last layer of rank 2.")
    if first_last[0] == 15 or first_last[1] == 21:
        return wrong("30 layers do not split evenly over 4 stages; which stages get the extra layers?")
    return wrong("llmlab.engine.parallel.placement.stage_layers(30, 4) lists each stage's layers.")


def q3(answer):
    """A pipeline of P = 2 stages runs a step as M = 2 micro-batches of equal time. What fraction of the
    step is each stage busy?"""
    value = fraction(answer)
    stages, micro_batches = 2, 2
    if close(value, micro_batches / (micro_batches + stages - 1), 0.01):
        return right("the step lasts M + P - 1 micro-batch times and each stage works M of them: the rest is "
                     "the bubble. More micro-batches shrink it, at the price of smaller matrix products.")
    if close(value, 1.0, 0.01):
        return wrong("stage 1 cannot start before stage 0 has finished the first micro-batch: who waits?")
    if close(value, 0.5, 0.01):
        return wrong("the two stages overlap for one micro-batch time: draw the two rows of the timeline.")
    return wrong("a step lasts M + P - 1 micro-batch times; each stage is busy for M of them.")


def rank_of(head: int, layer: int, tp: int, pp: int) -> int:
    """The rank that computes query head `head` of layer `layer`, as the ranks place themselves."""
    config = embedded_config()
    heads_per_rank = shard_config(config, tp).num_heads
    return next(rank for rank in range(tp * pp)
                if layer in (layout := RankLayout(rank, tp, pp, config.num_layers)).layers
                and layout.tp_rank == head // heads_per_rank)


def q4(answer):
    """Both at once, tensor_parallel_size=3 and pipeline_parallel_size=2: six ranks (the second placement
    figure). Which rank computes query head 7 of layer 20?"""
    rank = integer(answer)
    expected = rank_of(7, 20, 3, 2)
    if rank == expected:
        return right("layer 20 is in stage 1 (layers 15-29), and a stage's layers are cut across its 3 ranks as "
                     "with tensor parallelism alone: rank r is tensor-parallel rank r % 3 of stage r // 3.")
    if rank == rank_of(7, 20, 3, 1):
        return wrong("that is the rank of head 7 with tensor parallelism alone; in which stage is layer 20, and "
                     "which ranks make up that stage?")
    if rank == 3 + 7 % 3:
        return wrong("heads are not dealt out in turn: each rank of a stage takes a contiguous group of 3.")
    return wrong("rank r is tensor-parallel rank r % 3 of stage r // 3; the placement figure shows each stage's "
                 "layers.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3, "q4": q4}
