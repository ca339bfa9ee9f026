"""`llmlab bench serving` against a server that caches prefixes (llmlab's and vLLM's do by
default): every rate of a sweep sends the same prompts, and each rate's must still be
computed in full, or later rates would measure the cache an earlier rate filled."""
import pytest

import llmlab
from llmlab.bench import serving


def test_each_rate_puts_its_own_first_word_before_the_same_prompts():
    prompts = serving.synthetic_prompts(5, seed=0, mean_input_len=20, mean_output_len=4, max_output_len=8)
    points = [serving.for_rate(prompts, i) for i in range(3)]
    firsts = [{p.text.split(" ", 1)[0] for p in point} for point in points]
    assert all(len(words) == 1 for words in firsts)                  # one word per point...
    assert len(set.union(*firsts)) == 3                              # ...a different one for each
    for point in points:
        assert [p.text.split(" ", 1)[1] for p in point] == [p.text for p in prompts]
        assert [p.output_len for p in point] == [p.output_len for p in prompts]
        assert [p.input_len for p in point] == [p.input_len + 1 for p in prompts]


@pytest.mark.slow
def test_a_prefix_caching_engine_finds_nothing_of_an_earlier_rate():
    llm = llmlab.LLM(block_size=4, num_gpu_blocks=256)
    assert llm.engine.config.enable_prefix_caching                   # the default
    prompts = serving.synthetic_prompts(3, seed=1, mean_input_len=24, max_input_len=40, mean_output_len=2,
                                        max_output_len=2)
    params = llmlab.SamplingParams(max_tokens=1, temperature=0.0)
    blocks = llm.engine.block_manager

    def hit_rate(point):
        blocks.prefix_queries = blocks.prefix_hits = 0
        llm.generate([p.text for p in point], params)
        return blocks.prefix_hit_rate

    hit_rate(serving.for_rate(prompts, 0))
    assert hit_rate(serving.for_rate(prompts, 1)) == 0.0
    assert hit_rate(serving.for_rate(prompts, 0)) > 0.5              # without a word of its own: cached


@pytest.mark.slow
def test_head_of_line_ends_when_the_long_prompt_fits_in_one_step(tmp_path):
    """A long prompt prefilled in one step finishes (and frees its blocks) before any poll
    of /metrics sees them: the benchmark used to wait for them forever. It now says the
    long prompt was done first."""
    import json
    import subprocess
    import sys

    out = tmp_path / "hol.json"
    subprocess.run([sys.executable, "-m", "llmlab.cli", "bench", "head-of-line", "--long-len", "64",
                    "--short-output-len", "2", "--max-num-batched-tokens", "512", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["long_done_before_short_sent"] is True
    assert result["long_ttft_s"] > 0 and result["short_ttft_behind_long_s"] > 0


def test_the_synthetic_prompts_are_a_lognormal_workload_in_words():
    """`Workload.lognormal`'s lengths for the seed, each token id drawn as one of WORDS; the
    arrivals of a rate are `Workload.poisson`'s."""
    from llmlab.experiments import Workload

    prompts = serving.synthetic_prompts(20, seed=3, mean_input_len=30, mean_output_len=8, max_output_len=16)
    workload = Workload.lognormal(20, 30, 8, max_output_len=16, seed=3)
    assert [(p.input_len, p.output_len) for p in prompts] == [(len(r.prompt_token_ids), r.output_len)
                                                              for r in workload]
    for p in prompts:
        words = p.text.split(" ")
        assert len(words) == p.input_len and set(words) <= set(serving.WORDS)
    assert serving.poisson_arrivals(20, 4.0, seed=3) == [r.arrival_time for r in Workload.poisson(20, 4.0, seed=3)]
    assert serving.poisson_arrivals(3, float("inf")) == [0.0] * 3
