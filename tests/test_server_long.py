"""Chunked prefill mixed with decode: a long prompt must not stall a running stream.

Heavy (a long prefill on CPU), so marked slow, but part of the default run. The prompt length is
JAXSERVE_TEST_LONG_PROMPT tokens (default 8000, the issue's figure; see conftest.py).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import aiohttp
import pytest

from conftest import LONG_PROMPT_TOKENS, post_json

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("long")


def test_long_prefill_does_not_stall_running_stream(server):
    url = server.url
    rng = random.Random(0)
    long_prompt = [rng.randrange(200, 40000) for _ in range(LONG_PROMPT_TOKENS)]

    async def go():
        arrivals: list[float] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=900)) as s:
            started = asyncio.Event()

            async def stream():
                body = {"prompt": "Once upon a time", "max_tokens": 180, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            arrivals.append(time.monotonic())
                            if len(arrivals) == 10:
                                started.set()

            task = asyncio.create_task(stream())
            await asyncio.wait_for(started.wait(), 300)
            t0 = time.monotonic()
            async with s.post(f"{url}/v1/completions",
                              json={"prompt": long_prompt, "max_tokens": 1, "temperature": 0}) as r:
                body = await r.json()
                assert r.status == 200, body
            t1 = time.monotonic()
            task.cancel()  # disconnect: the stream is aborted
            try:
                await task
            except asyncio.CancelledError:
                pass
        return arrivals, t0, t1, body

    def attempt():
        arrivals, t0, t1, body = asyncio.run(go())
        assert body["usage"]["prompt_tokens"] == LONG_PROMPT_TOKENS
        before = [t for t in arrivals if t < t0]
        during = [t for t in arrivals if t0 <= t <= t1]
        # the prompt goes in chunks of ~127 tokens beside the stream's decode: a token every step
        assert len(during) >= min(8, LONG_PROMPT_TOKENS // 128 - 2), (len(during), t1 - t0)
        times = before[-1:] + during
        gaps = [b - a for a, b in zip(times, times[1:])]
        return max(gaps), statistics.median(gaps), gaps

    # Without chunking the stream would wait for the whole prefill (~the sum of all gaps). On a shared
    # 2-core machine another process can stretch one step, so a failed measurement gets one retry.
    worst, med, gaps = attempt()
    if worst > 3 * med:
        worst, med, gaps = attempt()
    assert worst <= 3 * med, (worst, med, [round(g, 2) for g in gaps])


def test_chunking_does_not_change_the_result(server, server_factory):
    # the same long prompt prefilled in chunks of 128 here and 256 on the main server
    words = " ".join(f"entry{i}" for i in range(240))
    prompt = f"Inventory: {words}. End of inventory. The next entry would be"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    here = post_json(f"{server.url}/v1/completions", body)
    main = server_factory("main")
    there = post_json(f"{main.url}/v1/completions", body)
    assert here[0] == there[0] == 200
    assert here[1]["usage"]["prompt_tokens"] > 512
    assert here[1]["choices"][0]["text"] == there[1]["choices"][0]["text"]
