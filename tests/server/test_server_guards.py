"""Who may use the server (Host header, API key), what start-up refuses, where prompts are
tokenized, the preemption counter, and a scheduler that stalls, on a tiny random-weight engine
through real HTTP."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import openai
import pytest

import llmlab
from llmlab.plan import Plan
from llmlab.server.app import create_app
from helpers.server import metrics, running, tiny_engine


def test_only_allowed_hosts_are_served():
    """DNS rebinding: a page on evil.example that resolves to 127.0.0.1 sends Host: evil.example."""
    app = create_app(tiny_engine(), allowed_hosts=["localhost", "127.0.0.1", "*.example.com"])
    with running(app) as url:
        port = url.rsplit(":", 1)[1]
        for host in (f"evil.example:{port}", "evil.example", f"example.com.evil.example:{port}"):
            response = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                                  headers={"Host": host})
            assert response.status_code == 400
            assert response.json()["error"]["code"] == "invalid_host"
        assert httpx.get(f"{url}/health", headers={"Host": "evil.example"}).status_code == 400
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "api.example.com"):
            response = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                                  headers={"Host": host})
            assert response.status_code == 200, host


@pytest.mark.slow
def test_an_empty_api_key_is_refused_at_start():
    with pytest.raises(ValueError, match="API key is empty"):
        create_app(tiny_engine(), api_key="")
    # `llmlab serve` says so before it loads anything, and exits with an error status
    result = subprocess.run([sys.executable, "-m", "llmlab.cli", "serve"], capture_output=True, text=True,
                            env={**os.environ, "LLMLAB_API_KEY": ""}, timeout=120)
    assert result.returncode != 0
    assert "API key is empty" in result.stderr and "loading" not in result.stderr


def test_a_max_model_len_beyond_the_kv_cache_is_refused():
    # (the engine refuses it, so `llmlab serve` does: tests/engine/test_max_model_len.py)
    with pytest.raises(ValueError, match="max_model_len is 4096, more than the KV cache holds: 128 tokens"):
        tiny_engine(num_gpu_blocks=8, max_model_len=4096)    # 8 blocks x 16 tokens = 128
    assert tiny_engine(max_model_len=1000).max_model_len == 1000


def test_prompts_are_tokenized_off_the_engine_thread():
    engine = tiny_engine()
    with running(create_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        response = client.completions.create(model="tiny-random", prompt="hello there", max_tokens=2)
        assert response.usage.prompt_tokens == len("hello there")
        client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2)
    assert engine.tokenizer.threads and all(t.startswith("llmlab-tokenizer") for t in engine.tokenizer.threads)


def test_preemptions_are_counted():
    """8 requests need more KV blocks than there are: the scheduler preempts; /metrics
    counts exactly the preemptions the engine's own trace shows."""
    engine = tiny_engine(num_gpu_blocks=12, block_size=16)
    recorder = llmlab.Recorder()
    engine.hooks.attach(recorder)
    payloads = [{"prompt": [1 + i] * 20, "max_tokens": 60, "ignore_eos": True} for i in range(8)]

    async def send_all(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=p) for p in payloads))

    with running(create_app(engine)) as url:
        responses = asyncio.run(send_all(url))
        assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 60 for r in responses)
        counted = metrics(url)["llmlab_num_preemptions_total"]
    preempted = sum(len(step.preempted) + len(step.swapped_out) for step in recorder.trace.steps)
    assert preempted > 0
    assert counted == preempted


def test_a_scheduler_that_plans_nothing_fails_its_requests_and_the_server_goes_on():
    """A scheduler bug that plans nothing for a waiting request used to spin the engine
    thread with the client waiting forever. The engine raises on the second empty step;
    the server answers that request with a 500, gives back its blocks and serves the next."""
    engine = tiny_engine(num_gpu_blocks=64)
    real = engine.scheduler.schedule
    stalled = {"on": True}

    def schedule():
        if stalled["on"]:
            return Plan()
        return real()

    engine.scheduler.schedule = schedule
    with running(create_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError, match="the engine failed"):
            client.completions.create(model="tiny-random", prompt="hello", max_tokens=3)
        stalled["on"] = False
        response = client.completions.create(model="tiny-random", prompt="hello", max_tokens=3)
        assert response.usage.completion_tokens == 3
        assert engine.kv_stats()["free_device_blocks"] == 64
        assert not engine.has_unfinished_requests()
