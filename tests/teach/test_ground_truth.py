"""The checker's replays are what the notebooks' engines do. Every replay a question makes (while
grading the right answers and the planted wrong ones) is run again on a real LLMEngine with the
same settings and prompts, and the two must schedule, preempt and swap alike, step by step.

The engine runs a random model with the embedded model's vocabulary (the prompts are its real
token ids) and tiny layers: with ignore_eos, scheduling does not depend on the weights, only on
token counts, KV blocks and (for the prefix cache) the token ids."""
import pytest
import torch

from llmlab import EngineConfig, LLMEngine, SamplingParams, teach, viz
from llmlab.model.llama import LlamaModel
from llmlab.teach import ground_truth

from helpers.engine import tiny_config
from test_questions import RIGHT, WRONG

pytestmark = pytest.mark.slow        # an engine per replay: 10-20 s a notebook on a CPU

REPLAYED = ["00", "06", "07", "08", "09"]      # the notebooks whose questions replay a workload


@pytest.fixture(scope="module")
def model():
    vocab = ground_truth.embedded_config().vocab_size
    return LlamaModel.random(tiny_config(vocab_size=vocab, max_position_embeddings=8192), torch.float32, "cpu", seed=0)


def schedule(trace):
    return [(s.scheduled, s.preempted, s.swapped_out, s.swapped_in, sorted(s.finished)) for s in trace.steps]


@pytest.mark.parametrize("notebook", REPLAYED)
def test_every_replay_schedules_as_the_engine_does(notebook, model, monkeypatch):
    replayed = []

    def replay_and_run(arrivals, policy="fcfs", **config):
        simulated = original(arrivals, policy, **config)
        engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", backend="torch", **config), model=model,
                           policy=policy)
        workload = [viz.Arrival(list(ids), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), step)
                    for ids, n, step in arrivals]
        recorded = viz.record(engine, workload)
        assert schedule(simulated) == schedule(recorded), (config, policy)
        replayed.append(config)
        return simulated

    original = ground_truth.replay
    monkeypatch.setattr(ground_truth, "replay", replay_and_run)
    teach.grade(notebook, RIGHT[notebook])
    for wrong_notebook, key, answer, _ in WRONG:
        if wrong_notebook == notebook:
            teach.grade(notebook, {key: answer})
    assert replayed, "no question of this notebook replayed a workload"
