"""Every notebook's "Check yourself": the right answers are accepted, and planted wrong ones (the
mistakes a student is likely to make) are refused with feedback that names the mistake and does
not give the right answer away. The right answers below are worked out by hand from the
notebooks; the checker computes its own from the library, so the two must agree."""
import math

import pytest

from llmlab import teach
from llmlab.experiments import CostModel


def short_prompts_first(request):        # notebook 12's task, done right
    num_tokens = len(request.prompt_token_ids)
    return (num_tokens > 512, num_tokens if num_tokens <= 512 else request.arrival_time)


# notebook 12's q6 wants a CPU calibration made by `llmlab bench calibrate --preset cpu` (minutes):
# stand-ins with the meta the command writes, and the H200's, which is not one
CPU_CALIBRATION = CostModel({"intercept": 0.02, "decode_tokens": 1e-3, "prefill_tokens": 2e-4, "num_prefills": 1e-3},
                            {"device": "cpu", "recorded_with": "llmlab bench calibrate --preset cpu"})
TINY_CALIBRATION = CostModel({"intercept": 1e-3},
                             {"device": "cpu", "recorded_with": "llmlab bench calibrate --preset tiny"})
H200_CALIBRATION = CostModel.load(teach.data_file("h200_cost_model_llama3_8b.json"))

INF_RATE_RESULT = {"rate": math.inf, "completed": 12, "failed": 0,
                   "ttft_ms": {"mean": 900.0, "p50": 850.0, "p90": 1500.0, "p99": 1600.0}}

RIGHT = {
    "00": {"q1": 3,             # robots: prefill + first token at step 0, 4 tokens -> its last at step 3
           "q2": 2,             # 6 prompt tokens + 2 fed back by steps 1 and 2, 4 to a block
           "q3": "d"},          # forward
    "01": {"q1": 11520,         # 2 (K, V) x 30 layers x 3 kv heads x 64
           "q2": 27, "q3": 0, "q4": " sky"},
    "02": {"q1": 10,            # 200 * 100000**(-2i/64) >= 2 pi for i = 0..9
           "q2": 1.0,           # RMSNorm ignores a row's scale
           "q3": (4, 7)},       # 4 rows x ceil(14336 / 2048)
    "03": {"q1": 28 / 256,      # last chunk: query tile i (0..7) skips 7 - i of 32 key tiles
           "q2": 0, "q3": math.exp(2.5 - 3.0)},
    "04": {"q1": 4,             # 12 blocks, 3 per 10-token request
           "q2": 2,             # the last token's block is recomputed
           "q3": 5},            # ceil(17 / 4)
    "05": {"q1": 15,            # one 32-key tile: split 0 only
           "q2": 2,             # 512 tiles, ceil(512 / 66) = 8 per split: 64 splits used
           "q3": 96},           # 3 sequences x 2 kv heads x 16
    "06": {"q1": 4, "q2": 31, "q3": "b",
           "q4": (1, 14)},      # held back a step while request 0 computes the shared 24 tokens, then 38 - 24
    "07": {"q1": 33,            # 226 prompt tokens in chunks of 8 - 3 decodes = 5
           "q2": 469,           # 466 prompt tokens + 3 decodes
           "q3": 3},            # the long prompt arrives at step 3
    "08": {"q1": 1, "q2": 57, "q3": 2, "q4": "1"},
    "09": {"q1": 32,            # 45 shared tokens -> 2 whole 16-token blocks
           "q2": 1, "q3": 16},
    "10": {"q1": 2,             # 0.5 < 0.75 <= 0.8
           "q2": 3,             # p >= 0.2 * 0.5
           "q3": 0.379,         # sqrt(0.5) / sum(sqrt(p))
           "q4": math.log(math.sqrt(0.5) / sum(math.sqrt(p) for p in (0.5, 0.3, 0.15, 0.05)))},  # drawn at T = 2
    "11": {"q1": 16.81 / 4,             # the seed's gaps at rate 1, four times closer
           "q2": 300,      # (1300 - 400) / (4 - 1)
           "q3": "b", "q4": INF_RATE_RESULT},
    "12": {"q1": short_prompts_first, "q2": 2048, "q3": "a",     # 4 GiB / 2 MiB
           "q4": "a",           # simulated: 21 against 275 preempted; the important half's TTFT p90 2.86 s -> 0.26 s
           "q5": 1,             # simulated: 95.1%, 91.6%, 81.2%, 67.5% of requests within the SLO
           "q6": CPU_CALIBRATION},
    "13": {"q1": 1081344,       # Llama-3-8B: 2 x 32 x 16 x 8 x (128 + 4)
           "q2": 50,            # round(0.5 / (1.27 / 127))
           "q3": "b",
           "q4": 0.938,         # measured: the mean KL with only the keys quantized over the int8 cache's, 256 tokens
           "q5": 0.0132},       # measured: 610 of 46,080 key rows
    "14": {"q1": 2, "q2": (16, 22),     # stages of 8, 8, 7, 7 layers
           "q3": 2 / 3,
           "q4": 5},            # layer 20: stage 1 (ranks 3-5); head 7: the third group of 3
}

# (notebook, question, a likely wrong answer, what its feedback must say)
WRONG = [
    ("00", "q1", 4, "counts steps from 1"), ("00", "q2", 3, "not in the cache yet"), ("00", "q2", 1, "16-token"),
    ("00", "q2", 8, "counts tokens"), ("00", "q3", "sample", "sample:"),
    ("01", "q1", 34560, "query heads"), ("01", "q1", 5760, "both the key and the value"), ("01", "q2", 3, "attention"),
    ("01", "q3", 6, "argmax"), ("01", "q4", "east", "textbook"),
    ("02", "q1", 3, "0-15"), ("02", "q2", 10, "rms(10 x)"), ("02", "q3", (4, 1), "2048"),
    ("02", "q3", (4, 14), "output"),
    ("03", "q1", 0.48, "whole prompt"), ("03", "q2", 1, "count only the changes after it"), ("03", "q2", 2, "tile 2"),
    ("03", "q3", math.exp(0.5), "other way round"),
    ("04", "q1", 4.8, "ceil"), ("04", "q2", 3, "always compute"), ("04", "q3", 3, "decoded tokens"),
    ("05", "q1", 16, "some split"), ("05", "q2", 0, "66 x"), ("05", "q3", 192, "kv head"), ("05", "q3", 108, "combine"),
    ("06", "q1", 2, "arrives"), ("06", "q4", (0, 38), "very step"), ("06", "q4", (1, 38), "shares them"),
    ("06", "q4", (1, 24), "found in the cache"), ("06", "q2", 12, "without chunking"), ("06", "q3", "a", "whole step"),
    ("07", "q1", 29, "chunk = budget - decodes"), ("07", "q2", 466, "three decodes"), ("07", "q3", 4, "from 0"),
    ("08", "q1", 0, "another way"), ("08", "q2", 29, "prefix caching on"), ("08", "q2", 24, "only the prompts"),
    ("08", "q3", 1, "20 blocks"), ("08", "q4", "3", "FCFS"),
    ("09", "q1", 40, "8-token blocks"), ("09", "q1", 45, "whole blocks"), ("09", "q2", 0, "does the scheduler"),
    ("09", "q3", 19, "whole blocks"), ("09", "q3", 24, "chain breaks"),
    ("10", "q1", 1, "reach 0.75"), ("10", "q1", 3, "third token"), ("10", "q2", 2, "relative"),
    ("10", "q3", 0.5, "divided by T"), ("10", "q3", 0.25, "not dividing probabilities"),
    ("10", "q4", math.log(0.5), "drawn from"), ("10", "q4", 0.379, "log"), ("10", "q4", math.log(0.5) / 2, "log of"),
    ("11", "q1", 16.81, "1 request per second"), ("11", "q1", 2.75, "on average"), ("11", "q2", 325, "E2E / tokens"),
    ("11", "q2", 225, "how many more"), ("11", "q3", "c", "poisson_arrivals"),
    ("11", "q4", {**INF_RATE_RESULT, "rate": 8.0}, "float('inf')"),
    ("12", "q1", lambda r: r.arrival_time, "admission number"),
    ("12", "q1", lambda r: (len(r.prompt_token_ids) > 1024, r.arrival_time), "admission number"),
    ("12", "q1", lambda r: None if len(r.prompt_token_ids) > 1024 else r.arrival_time, "compared"),
    ("12", "q1", lambda r: 1 / 0, "ZeroDivisionError"), ("12", "q2", 4096, "both K and V"),
    ("12", "q3", "b", "who waits"),
    ("12", "q4", "b", "at random"), ("12", "q4", "c", "least important"), ("12", "q4", "d", "admitted first"),
    ("12", "q5", 2, "fewer than 90%"), ("12", "q5", 0.5, "higher rate"), ("12", "q5", 1.5, "one of the multiples"),
    ("12", "q6", H200_CALIBRATION, "GPU"), ("12", "q6", CostModel.constant(1.0), "not made by"),
    ("12", "q6", TINY_CALIBRATION, "--preset tiny"), ("12", "q6", "calib/cost_model.json", "CostModel itself"),
    ("13", "q1", 2097152, "bfloat16"), ("13", "q1", 1048576, "codes alone"), ("13", "q2", 63, "absmax"),
    ("13", "q3", "a", "opposite"),
    ("13", "q4", 0.067, "they alone"), ("13", "q4", 0.5, "evenly"), ("13", "q5", 0.987, "twice"),
    ("13", "q5", 0, "does win"),
    ("14", "q1", 1, "in turn"), ("14", "q2", (15, 22), "extra layers"), ("14", "q2", 2, "expected a tuple"),
    ("14", "q2", (16, 19, 22), "two numbers"), ("14", "q3", 1.0, "who waits"), ("14", "q3", 0.5, "overlap"),
    ("14", "q4", 2, "which stage"), ("14", "q4", 4, "in turn"),
]


# notebook 13's q4 and q5 load the embedded model and run it (10-40 s on a 2-core machine, once per
# process): `slow`, so make test-fast leaves them out
RUN_THE_MODEL = {("13", "q4"), ("13", "q5")}


def slow_if(params, runs_the_model: bool):
    return pytest.param(*params, marks=pytest.mark.slow) if runs_the_model else pytest.param(*params)


@pytest.mark.parametrize("notebook", [slow_if([n], any(k[0] == n for k in RUN_THE_MODEL)) for n in RIGHT])
def test_right_answers_are_accepted(notebook):
    assert set(RIGHT[notebook]) == set(teach.questions(notebook)), "a question without a right answer here"
    verdicts = teach.grade(notebook, RIGHT[notebook])
    assert {key: v.correct for key, v in verdicts.items()} == {key: True for key in RIGHT[notebook]}, verdicts


@pytest.mark.parametrize("notebook, key, answer, mistake", [slow_if(w, w[:2] in RUN_THE_MODEL) for w in WRONG],
                         ids=[f"{n}-{q}-{i}" for i, (n, q, _, _) in enumerate(WRONG)])   # (a function's repr has its address)
def test_planted_wrong_answers_are_refused_with_feedback(notebook, key, answer, mistake):
    verdict = teach.grade(notebook, {key: answer})[key]
    assert not verdict.correct
    assert mistake in verdict.feedback, verdict.feedback
    right = RIGHT[notebook][key]
    if isinstance(right, (int, float)) and not isinstance(right, bool) and abs(right) >= 10:
        assert f"{right:g}" not in verdict.feedback, "the feedback gives the answer away"


def test_every_question_has_a_planted_wrong_answer():
    planted = {(notebook, key) for notebook, key, _, _ in WRONG}
    assert planted == {(notebook, key) for notebook in RIGHT for key in RIGHT[notebook]}
