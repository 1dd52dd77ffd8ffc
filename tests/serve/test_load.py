"""Load (bounded, loopback only, stops by itself): 64 concurrent streaming clients, 1,000 requests
of mixed lengths and settings, some disconnecting midway. Every completed response is whole and
(greedy) equals what the same request gives alone; no 5xx; the server's memory after the run is
within a stated bound of before; /metrics agrees with the responses."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from serving import metric, start_server
from specdecode.api import SpeculativeGenerator
from specdecode.engine import EngineConfig

CLIENTS, REQUESTS = 64, 1000
# Growth allowed over the second half of the run: by then the allocator's pools have grown to
# the load (under xdist the first half once grew 306 MB), while a leak of 300 KB per request
# would add 150 MB in the second half alone.
RSS_BOUND_MB = 150
PROMPTS = [f"user {i}: " + "abc " * (i % 5) + "tell me" for i in range(12)]
LENGTHS = (4, 9, 16, 24)
SPECS = [False, {"method": "ngram", "k": 2}, {"method": "ngram", "k": "auto"}, {"method": "suffix", "k": 3}, None]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def plan(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    jobs = []
    for i in range(REQUESTS):
        sampled = rng.random() < 0.25
        jobs.append(
            {
                "prompt": rng.choice(PROMPTS),
                "max_tokens": rng.choice(LENGTHS),
                "spec": rng.choice(SPECS),
                "temperature": 0.8 if sampled else 0.0,
                "seed": i if sampled else None,
                "disconnect": rng.random() < 0.08,
            }
        )
    return jobs


async def drive(url: str, jobs: list[dict]) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(jobs)):
        queue.put_nowait(i)
    outcomes: list[dict] = [{} for _ in jobs]

    async def client_loop() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            job = jobs[i]
            try:
                stream = await client.completions.create(
                    model="tiny",
                    prompt=job["prompt"],
                    max_tokens=job["max_tokens"],
                    temperature=job["temperature"],
                    seed=job["seed"],
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"speculative": job["spec"]},
                )
                text, reason, usage, chunks = "", None, None, 0
                async for chunk in stream:
                    chunks += 1
                    if job["disconnect"] and chunks == 2:
                        break
                    for c in chunk.choices:
                        text += c.text
                        reason = c.finish_reason or reason
                    usage = chunk.usage or usage
                await stream.close()  # after a break: the client hangs up mid-stream
                outcomes[i] = {"text": text, "reason": reason, "usage": usage, "cut": job["disconnect"] and chunks == 2}
            except openai.APIStatusError as exc:
                outcomes[i] = {"status": exc.status_code}

    await asyncio.gather(*(client_loop() for _ in range(CLIENTS)))
    await client.close()
    return outcomes


@pytest.mark.slow
def test_64_streaming_clients_1000_requests(tiny_loaded):
    live = start_server(tiny_loaded, method="ngram", engine=EngineConfig(max_batch=32, max_queue=1024))
    try:
        jobs = plan()
        gen = SpeculativeGenerator(tiny_loaded, method="none")
        alone = {}
        for job in jobs:
            key = (job["prompt"], job["max_tokens"])
            if job["temperature"] == 0 and key not in alone:
                alone[key] = gen.generate(job["prompt"], max_new_tokens=job["max_tokens"], chat=False).text
        asyncio.run(drive(live.url, jobs[:64]))  # warm-up: allocator pools and caches settle first
        before = rss_mb()
        warm_requests = metric(live, "request_success_total")
        half = len(jobs) // 2
        outcomes = asyncio.run(drive(live.url, jobs[:half]))
        mid = rss_mb()
        outcomes += asyncio.run(drive(live.url, jobs[half:]))
        after = rss_mb()

        assert not [o for o in outcomes if "status" in o], "no request may fail (no 4xx, no 5xx)"
        completed = [(j, o) for j, o in zip(jobs, outcomes) if not o["cut"]]
        assert len(completed) > 800
        for job, out in completed:
            assert out["reason"] in ("length", "stop") and out["usage"] is not None, out  # whole: it ended
            if job["temperature"] == 0:
                assert out["text"] == alone[(job["prompt"], job["max_tokens"])]
            if out["reason"] == "length":
                assert out["usage"].completion_tokens == job["max_tokens"]
        grew = f"RSS grew {mid - before:.0f} MB over the first half, {after - mid:.0f} MB over the second"
        assert after - mid < RSS_BOUND_MB, grew

        assert metric(live, "request_success_total") - warm_requests == REQUESTS
        cancelled = metric(live, "request_success_total", finished_reason="cancelled")
        assert 0 < cancelled <= sum(o["cut"] for o in outcomes)
        assert metric(live, "num_requests_running") == 0 and metric(live, "num_requests_waiting") == 0
        assert live.state.worker.engine.reserved == 0 and not live.state.worker.engine.busy
    finally:
        live.stop()
