"""The garbage collector during a run (engine/warm_up.py): LLM.generate freezes the heap it
starts with for the length of the run and gives it back after, without touching a heap that
someone else froze."""
from __future__ import annotations

import gc

import pytest

from llmlab import SamplingParams
from llmlab.engine.warm_up import heap_frozen


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_generate_runs_on_a_frozen_heap_and_gives_it_back(llm, unfrozen, monkeypatch):
    counts = []
    step = llm.engine.step

    def counting_step():
        counts.append(gc.get_freeze_count())
        return step()

    monkeypatch.setattr(llm.engine, "step", counting_step)
    llm.generate(["Hello"], SamplingParams(max_tokens=3))
    assert counts and min(counts) > 0      # every step saw the start-up heap frozen
    assert gc.get_freeze_count() == 0      # and the collector has it back


def test_a_failing_run_gives_the_heap_back(llm, unfrozen, monkeypatch):
    def failing_step():
        raise RuntimeError("boom")

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(["Hello"], SamplingParams(max_tokens=3))
    assert gc.get_freeze_count() == 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_device_blocks


def test_a_heap_frozen_by_someone_else_stays_frozen(unfrozen):
    gc.freeze()
    before = gc.get_freeze_count()
    with heap_frozen():
        pass
    assert before > 0 and gc.get_freeze_count() > before // 2   # not unfrozen (frozen objects may still be freed)
