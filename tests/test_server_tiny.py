"""A server with a KV cache far too small for its batch, bound to a unix socket, behind an API key.

Preemption by recompute must not change greedy output; the unix socket and the API key must work
with the openai client; SIGTERM must finish in-flight requests and exit cleanly.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest

from conftest import validate_schema

pytestmark = pytest.mark.timeout(900)

KEY = "sekrit"
PROMPTS = ["The history of the bicycle begins", "A recipe for pancakes:", "Rules of chess, short version:",
           "Why the sky is blue, explained simply:"]


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("tiny")


@pytest.fixture(scope="module")
def sock(server):
    return server.host[len("unix://"):]


def _session(sock: str, key: str | None = KEY) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock), headers=headers)


async def _req(sock, method, path, body=None, key: str | None = KEY):
    async with _session(sock, key) as s:
        async with s.request(method, f"http://localhost{path}", json=body) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


def req(sock, method, path, body=None, key: str | None = KEY):
    return asyncio.run(_req(sock, method, path, body, key))


def _metrics(sock) -> dict[str, float]:
    status, text = req(sock, "GET", "/metrics", key=None)
    assert status == 200
    return {ln.rpartition(" ")[0]: float(ln.rpartition(" ")[2]) for ln in text.splitlines()
            if ln and not ln.startswith("#")}


def test_unix_socket_and_openai_client(sock, server):
    import httpx2
    import openai

    assert os.path.exists(sock)
    assert f"serving on unix://{sock}" in server.output()
    client = openai.OpenAI(base_url="http://localhost/v1", api_key=KEY, max_retries=0, timeout=300,
                           http_client=httpx2.Client(transport=httpx2.HTTPTransport(uds=sock)))
    models = client.models.list()
    assert len(models.data) == 1
    r = client.chat.completions.create(model=models.data[0].id, max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url="http://localhost/v1", api_key="wrong", max_retries=0,
                      http_client=httpx2.Client(transport=httpx2.HTTPTransport(uds=sock))).models.list()


def test_api_key(sock):
    for key in (None, "wrong", KEY + "x"):
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                                   ("POST", "/tokenize", {"prompt": "hi"})):
            status, err = req(sock, method, path, body, key=key)
            assert status == 401, (key, path, status, err)
            validate_schema(err, "ErrorResponse")
            assert err["error"]["code"] == "invalid_api_key"
    # health and metrics stay open for probes and scrapers
    assert req(sock, "GET", "/health", key=None)[0] == 200
    assert req(sock, "GET", "/metrics", key=None)[0] == 200
    assert req(sock, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})[0] == 200


def test_cors_when_enabled(sock):
    async def go():
        async with _session(sock, key=None) as s:
            pre = await s.options("http://localhost/v1/chat/completions", headers={
                "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})
            bad = await s.options("http://localhost/v1/chat/completions", headers={
                "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
            get = await s.get("http://localhost/v1/models", headers={"Origin": "http://app.example",
                                                                     "Authorization": f"Bearer {KEY}"})
            other = await s.get("http://localhost/health", headers={"Origin": "http://evil.example"})
            return pre, bad, get, other

    pre, bad, get, other = asyncio.run(go())
    assert pre.status == 204 and pre.headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert "authorization" in pre.headers["Access-Control-Allow-Headers"].lower()
    assert bad.status == 403 and "Access-Control-Allow-Origin" not in bad.headers
    assert get.status == 200 and get.headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert other.status == 200 and "Access-Control-Allow-Origin" not in other.headers


def test_preemption_keeps_greedy_output(sock):
    body = lambda p: {"prompt": p, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    alone = []
    for p in PROMPTS:
        status, r = req(sock, "POST", "/v1/completions", body(p))
        assert status == 200, r
        alone.append(r["choices"][0]["text"])
    before = _metrics(sock)["jaxserve_preemptions_total"]

    async def together():
        async with _session(sock) as s:
            async def one(p):
                async with s.post("http://localhost/v1/completions", json=body(p)) as r:
                    return r.status, await r.json()
            return await asyncio.gather(*[one(p) for p in PROMPTS])

    res = asyncio.run(together())
    assert all(st == 200 for st, _ in res), res
    m = _metrics(sock)
    # 4 x ~58 tokens do not fit in 13 blocks of 16: someone had to be preempted and recomputed
    assert m["jaxserve_preemptions_total"] > before
    assert [r["choices"][0]["text"] for _, r in res] == alone
    assert all(r["usage"]["completion_tokens"] == 48 for _, r in res)
    assert m["jaxserve_kv_blocks_used"] == 0


def test_prompt_that_can_never_fit(sock):
    status, err = req(sock, "POST", "/v1/completions", {"prompt": "word " * 300, "max_tokens": 1})
    assert status == 400 and err["error"]["param"] == "prompt"
    assert "208" in err["error"]["message"]  # the cache's size in tokens is in the message


def test_stalled_body_is_408_and_others_go_on(sock):
    """A client that sends its headers and half its body, then stalls, gets a 408 after
    JAXSERVE_BODY_TIMEOUT (2 s for this server) instead of holding the connection; a request beside it
    is served."""
    async def stalled():
        reader, writer = await asyncio.open_unix_connection(sock)
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body[:5])
        await writer.drain()
        t0 = time.monotonic()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        waited = time.monotonic() - t0
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        err = json.loads(await reader.readexactly(length))
        writer.close()
        return head.split(b"\r\n")[0], waited, err

    async def both():
        async with _session(sock) as s:
            other = asyncio.create_task(s.post("http://x/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
            status_line, waited, err = await stalled()
            resp = await other
            return status_line, waited, err, resp.status

    status_line, waited, err, other_status = asyncio.run(both())
    assert b" 408 " in status_line, status_line
    assert 1.5 < waited < 20, waited
    assert err["error"]["code"] == "request_timeout" and "JAXSERVE_BODY_TIMEOUT" in err["error"]["message"]
    validate_schema(err, "ErrorResponse")
    assert other_status == 200


def test_webui_page_and_stream(sock):
    """The chat page is served without the key; the request its script builds, streamed by this server
    and split by its SSE parser (tests/test_webui.py) in 7- and 4096-character pieces, gives the same
    text as the request answered whole."""
    from test_webui import node, sse_content

    status, page = req(sock, "GET", "/", key=None)
    assert status == 200 and "<title>jaxserve chat</title>" in page
    status, models = req(sock, "GET", "/v1/models")
    model = models["data"][0]["id"]
    body = json.loads(node(f"console.log(JSON.stringify(w.chatBody({json.dumps(model)}, "
                           "[{role: 'user', content: 'Tell me about bicycles.'}], 'Be brief.', '0', '24')))"))

    async def raw_stream():
        async with _session(sock) as s:
            async with s.post("http://localhost/v1/chat/completions", json=body) as r:
                assert r.status == 200
                return await r.text()

    raw = asyncio.run(raw_stream())
    status, whole = req(sock, "POST", "/v1/chat/completions",
                        {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    text = whole["choices"][0]["message"]["content"]
    assert status == 200 and text
    assert sse_content(raw, 7) == text and sse_content(raw, 4096) == text


def test_sigterm_finishes_in_flight_then_exits(server, sock):
    async def go():
        async with _session(sock) as s:
            async with s.post("http://localhost/v1/completions",
                              json={"prompt": "Count: 1, 2, 3,", "max_tokens": 30, "temperature": 0,
                                    "ignore_eos": True, "stream": True}) as r:
                assert r.status == 200
                lines = []
                async for line in r.content:
                    if line.strip():
                        lines.append(line.decode().strip())
                        if len(lines) == 2:
                            server.proc.terminate()  # SIGTERM while the stream is running
                return lines

    lines = asyncio.run(go())
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    fin = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert fin == ["length"]  # it was finished, not cut off
    assert server.proc.wait(60) == 0
    assert not os.path.exists(sock)
    out = server.output()
    assert "shutting down" in out and "stopped" in out

