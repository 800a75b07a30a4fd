"""The OpenAI-compatible server, end to end: a real `jaxserve run` process with the real SmolLM2 GGUF.

Talks to it with the `openai` client and raw HTTP (urllib / aiohttp); validates bodies against
OpenAI's own OpenAPI schemas (/work/shared/openai-openapi-subset.json).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest

from conftest import get_json, post_json, post_raw, validate_schema

pytestmark = pytest.mark.timeout(900)

SYSTEM = ("You are a meticulous assistant for a small bakery. You answer questions about bread, pastry, opening "
          "hours and prices. Be brief, friendly and precise. Never invent products that are not on the menu: "
          "sourdough, baguette, croissant, pain au chocolat, rye loaf, cinnamon roll and a seasonal fruit tart.")


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("main")


@pytest.fixture(scope="module")
def url(server):
    return server.url


@pytest.fixture(scope="module")
def client(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat_body(content: str, **kw) -> dict:
    return {"model": "smol", "messages": [{"role": "user", "content": content}], **kw}


async def _sse(session: aiohttp.ClientSession, url: str, body: dict, stop_after: int | None = None):
    """[(arrival time, parsed event or '[DONE]')]; stop_after: drop the connection after that many events."""
    events = []
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        buf = b""
        async for line in r.content:
            buf += line
            if not buf.endswith(b"\n"):
                continue
            s = buf.decode().rstrip("\n")
            buf = b""
            if not s:
                continue
            assert s.startswith("data: "), s
            data = s[len("data: "):]
            events.append((time.monotonic(), "[DONE]" if data == "[DONE]" else json.loads(data)))
            if stop_after is not None and len(events) >= stop_after:
                return events
    return events


def sse(url: str, body: dict, **kw):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await _sse(s, url, body, **kw)

    return asyncio.run(go())


def metrics(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def tokenize_count(url: str, **body) -> int:
    status, r = post_json(f"{url}/tokenize", {"model": "smol", **body})
    assert status == 200, r
    return r["count"]


# ----------------------------------------------------------------------------- basics

def test_startup_banner_and_health(server, url):
    out = server.output()
    assert re.search(r"listening on http://127\.0\.0\.1:\d+", out), out
    m = re.search(r"KV cache (\d+) tokens", out)
    assert m and int(m.group(1)) > 0, out
    assert out.index("listening on") < out.index("KV cache")  # bound before the model was loaded
    assert get_json(f"{url}/health")[0] == 200
    assert metrics(url)["jaxserve_ready"] == 1.0


def test_models(url, server):
    for path in ("/v1/models", "/models"):
        status, body = get_json(url + path)
        assert status == 200
        validate_schema(body, "ListModelsResponse")
        assert [m["id"] for m in body["data"]] == ["smol"]
    status, card = get_json(f"{url}/v1/models/smol")
    validate_schema(card, "Model")
    # llama.cpp's /props, which the chat page reads: a text model takes no images
    assert get_json(f"{url}/props") == (200, {"model": "smol", "max_model_len": 2048,
                                              "modalities": {"vision": False, "audio": False}})
    status, err = post_raw(f"{url}/v1/chat/completions", json.dumps(chat_body("hi", model="gpt-4")).encode())
    assert status == 404
    validate_schema(err, "ErrorResponse")
    assert err["error"]["param"] == "model" and err["error"]["code"] == "model_not_found"
    # the model path given on the command line is accepted too; the served name is reported
    path = server.proc.args[server.proc.args.index("--model") + 1] if "--model" in server.proc.args else None
    if path:
        status, r = post_json(f"{url}/v1/completions", {"model": path, "prompt": "Hi", "max_tokens": 1})
        assert status == 200 and r["model"] == "smol", r


def test_cors_off_by_default(url):
    import urllib.request

    req = urllib.request.Request(f"{url}/v1/models", headers={"Origin": "http://evil.example"})
    with urllib.request.urlopen(req) as r:
        assert "Access-Control-Allow-Origin" not in r.headers


# ----------------------------------------------------------------------------- chat

def test_chat_non_stream_schema_and_usage(client, url):
    r = client.chat.completions.with_raw_response.create(
        model="smol", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}],
        max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    raw = json.loads(r.text)
    validate_schema(raw, "CreateChatCompletionResponse")
    c = r.parse()
    assert c.id.startswith("chatcmpl-") and c.object == "chat.completion" and c.model == "smol"
    ch = c.choices[0]
    assert ch.finish_reason in ("stop", "length") and ch.message.role == "assistant" and ch.message.content
    n_prompt = tokenize_count(url, messages=[{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Name a fruit."}])
    assert c.usage.prompt_tokens == n_prompt
    assert c.usage.completion_tokens == len(ch.logprobs.content) <= 12
    assert c.usage.total_tokens == n_prompt + c.usage.completion_tokens
    assert c.usage.prompt_tokens_details.cached_tokens >= 0
    for e in ch.logprobs.content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4
    joined = "".join(e.token for e in ch.logprobs.content)
    # the EOS token counts as a completion token (as in vLLM) but is not part of the text
    assert joined == ch.message.content or (ch.finish_reason == "stop" and joined.startswith(ch.message.content)
                                            and joined[len(ch.message.content):] == "<|im_end|>")


def test_chat_stream_format(url, client):
    body = chat_body("Write one sentence about the sea.", max_tokens=16, temperature=0, stream=True,
                     stream_options={"include_usage": True})
    events = sse(f"{url}/v1/chat/completions", body)
    assert events[-1][1] == "[DONE]"
    chunks = [e for _, e in events[:-1]]
    for ch in chunks:
        validate_schema(ch, "CreateChatCompletionStreamResponse")
        assert ch["object"] == "chat.completion.chunk" and "usage" in ch
    assert len({ch["id"] for ch in chunks}) == 1
    deltas = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert deltas[0]["delta"].get("role") == "assistant"
    assert all("role" not in d["delta"] for d in deltas[1:])
    assert sum(d["finish_reason"] is not None for d in deltas) == 1
    assert deltas[-1]["finish_reason"] in ("stop", "length")
    # the usage chunk comes last, with no choices; all others have usage null
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(ch["usage"] is None for ch in chunks[:-1])
    text = "".join(d["delta"].get("content") or "" for d in deltas)
    full = client.chat.completions.create(model="smol", messages=body["messages"], max_tokens=16, temperature=0)
    assert text == full.choices[0].message.content
    assert chunks[-1]["usage"]["completion_tokens"] == full.usage.completion_tokens
    # without include_usage there is no usage field at all
    events = sse(f"{url}/chat/completions", dict(body, stream_options=None))
    assert all("usage" not in e for _, e in events[:-1])


def test_openai_client_stream(client):
    stream = client.chat.completions.create(model="smol", max_tokens=8, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "Count to five."}])
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(parts) and [r for r in reasons if r] in (["length"], ["stop"])


def test_stop_strings_multi_token(client, url):
    msgs = [{"role": "user", "content": "Describe the moon in three sentences."}]
    full = client.chat.completions.create(model="smol", messages=msgs, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    ids = post_json(f"{url}/tokenize", {"prompt": text})[1]["tokens"]
    assert len(ids) > 12
    # a stop string spanning several tokens, starting mid-token, from the middle of the reply
    start = len(post_json(f"{url}/detokenize", {"tokens": ids[:6]})[1]["prompt"]) + 1
    stop = text[start:start + 9]
    cut = text[:text.index(stop)]
    r = client.chat.completions.create(model="smol", messages=msgs, max_tokens=40, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    events = sse(f"{url}/v1/chat/completions", {"messages": msgs, "max_tokens": 40, "temperature": 0,
                                                "stop": stop, "stream": True})
    pieces = [e["choices"][0]["delta"].get("content") or "" for _, e in events[:-1] if e["choices"]]
    assert "".join(pieces) == cut  # nothing of the stop string leaked, not even partially
    # completions too, including include_stop_str_in_output
    prompt = "The days of the week are Monday, Tuesday,"
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=30, temperature=0)
    t = r.choices[0].text
    if " Thursday" in t:
        r2 = client.completions.create(model="smol", prompt=prompt, max_tokens=30, temperature=0, stop=" Thursday")
        assert r2.choices[0].text == t[:t.index(" Thursday")] and r2.choices[0].finish_reason == "stop"


def test_n_choices(client, url):
    r = client.chat.completions.create(model="smol", n=3, max_tokens=8, temperature=1.0, seed=7,
                                       messages=[{"role": "user", "content": "Say a random word."}])
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.usage.completion_tokens <= 24
    events = sse(f"{url}/v1/completions", {"prompt": ["Once upon a time", "In a galaxy"], "n": 2, "max_tokens": 6,
                                           "temperature": 1.0, "stream": True})
    fins = {}
    for _, e in events[:-1]:
        if all(c["finish_reason"] for c in e["choices"]):  # the spec has no null finish_reason here
            validate_schema(e, "CreateCompletionResponse")
        for c in e["choices"]:
            if c["finish_reason"]:
                fins[c["index"]] = fins.get(c["index"], 0) + 1
    assert fins == {0: 1, 1: 1, 2: 1, 3: 1}


# ----------------------------------------------------------------------------- completions

def test_completions_prompts_and_schema(client, url):
    raw = client.completions.with_raw_response.create(model="smol", prompt="The sky is", max_tokens=5, temperature=0)
    body = json.loads(raw.text)
    validate_schema(body, "CreateCompletionResponse")
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    text = body["choices"][0]["text"]
    ids = post_json(f"{url}/tokenize", {"prompt": "The sky is"})[1]["tokens"]
    assert body["usage"]["prompt_tokens"] == len(ids)
    by_ids = client.completions.create(model="smol", prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == text
    many = client.completions.create(model="smol", prompt=["The sky is", "Water is"], max_tokens=5, temperature=0)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == text
    batch = client.completions.create(model="smol", prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert len(batch.choices) == 2
    # streaming gives the same text
    events = sse(f"{url}/v1/completions", {"prompt": "The sky is", "max_tokens": 5, "temperature": 0, "stream": True,
                                           "stream_options": {"include_usage": True}})
    assert events[-1][1] == "[DONE]"
    assert "".join(c["text"] for _, e in events[:-1] for c in e["choices"]) == text
    assert events[-2][1]["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]


def test_completions_logprobs_and_echo(client, url):
    prompt = "The capital of France is Paris"
    ids = post_json(f"{url}/tokenize", {"prompt": prompt})[1]["tokens"]
    # what lm-evaluation-harness's local-completions sends for loglikelihood
    for max_tokens in (0, 1):
        status, r = post_json(f"{url}/v1/completions", {"model": "smol", "prompt": ids, "max_tokens": max_tokens,
                                                        "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234})
        assert status == 200, r
        c = r["choices"][0]
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert c["text"].startswith(prompt)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
        for tok, x, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert top[tok] == pytest.approx(x, abs=1e-5) and 1 <= len(top) <= 2
        assert r["usage"]["completion_tokens"] == max_tokens
        if max_tokens == 0:
            assert c["text"] == prompt
            first = lp
    # the model finds " Paris" likely after "The capital of France is"
    assert first["token_logprobs"][-1] > -3
    # plain echo with max_tokens=0 needs no model step at all
    status, r = post_json(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True})
    assert status == 200 and r["choices"][0]["text"] == prompt and r["usage"]["completion_tokens"] == 0
    # generated-token logprobs without echo
    r = client.completions.create(model="smol", prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4 == r.usage.completion_tokens
    assert lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == r.choices[0].text
    validate_schema(json.loads(client.completions.with_raw_response.create(
        model="smol", prompt="1, 2, 3,", max_tokens=2, temperature=0, logprobs=2).text), "CreateCompletionResponse")


def test_logprobs_of_tokens_that_split_characters(client, url):
    """Tokens holding part of a UTF-8 character (emoji, CJK) carry their own bytes: chat's `bytes`
    rebuild the reply, such tokens are named "bytes:\\x.." (OpenAI's form) so top-logprob keys stay
    distinct, and text offsets count characters of the returned text."""
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Reply with only emojis: 😀😃😄"}],
                                       max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].message.content
    entries = r.choices[0].logprobs.content
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace") == content
    assert all(len(e.top_logprobs) == 2 for e in entries)
    prompt = "Emoji list: 🍎🍌🍇 and 東京 too"
    status, body = post_json(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True,
                                                       "logprobs": 5, "temperature": 0})
    assert status == 200, body
    lp, text = body["choices"][0]["logprobs"], body["choices"][0]["text"]
    assert text == prompt and any(t.startswith("bytes:\\x") for t in lp["tokens"])
    assert all(len(top) >= 5 for top in lp["top_logprobs"][1:])
    for tok, x, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[tok] == pytest.approx(x, abs=1e-5)
    offs = lp["text_offset"]
    assert offs == sorted(offs) and offs[-1] < len(text) and offs[0] == 0
    assert text[offs[-1]:] == " too"


# ----------------------------------------------------------------------------- concurrency

async def _post(session, url, body):
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


def test_seed_determinism_under_concurrency(url):
    seeded = {"model": "smol", "prompt": "My favourite animal is", "max_tokens": 24, "temperature": 1.0, "seed": 4242}
    alone = post_json(f"{url}/v1/completions", seeded)[1]["choices"][0]["text"]
    others = [{"prompt": f"Story number {i}: once", "max_tokens": 24 + i, "temperature": 1.0} for i in range(8)]

    async def go():
        async with aiohttp.ClientSession() as s:
            tasks = [_post(s, f"{url}/v1/completions", b) for b in others[:4]]
            tasks += [_post(s, f"{url}/v1/completions", seeded) for _ in range(4)]
            tasks += [_post(s, f"{url}/v1/completions", b) for b in others[4:]]
            return await asyncio.gather(*tasks)

    res = asyncio.run(go())
    assert all(st == 200 for st, _ in res), res
    texts = [r["choices"][0]["text"] for _, r in res[4:8]]
    assert texts == [alone] * 4


def test_16_concurrent_streams(url):
    prompts = [f"Fact {i}: the number {i} is" for i in range(16)]
    # the reference: each prompt alone, greedy
    ref = [post_json(f"{url}/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0})[1]["choices"][0]["text"]
           for p in prompts[:4]]

    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*[
                _sse(s, f"{url}/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0, "stream": True,
                                                  "stream_options": {"include_usage": True}}) for p in prompts])

    t0 = time.monotonic()
    results = asyncio.run(go())
    assert time.monotonic() - t0 < 240
    texts = []
    for events in results:
        assert events[-1][1] == "[DONE]"
        chunks = [e for _, e in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        assert sum(1 for c in chunks for ch in c["choices"] if ch["finish_reason"]) == 1
        texts.append("".join(ch["text"] for c in chunks for ch in c["choices"]))
        assert chunks[-1]["usage"]["completion_tokens"] == 12 or chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert texts[:4] == ref


def test_prefix_cache_hit_on_repeated_system_prompt(client, url):
    before = metrics(url)["jaxserve_prefix_cache_hit_tokens_total"]
    first = client.chat.completions.create(model="smol", max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell rye bread?"}])
    second = client.chat.completions.create(model="smol", max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open on Sunday?"}])
    n_sys = tokenize_count(url, prompt=SYSTEM)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= n_sys - 16 and cached % 16 == 0, (cached, n_sys)
    assert cached < second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens <= cached
    assert metrics(url)["jaxserve_prefix_cache_hit_tokens_total"] >= before + cached


def test_chunked_prefill_long_prompt(url):
    # 256-token chunks on CPU: this prompt takes several steps to prefill
    words = " ".join(f"item{i}" for i in range(260))
    prompt = f"Here is a list: {words}. The list ends here. Summary:"
    n = tokenize_count(url, prompt=prompt)
    assert n > 600
    status, r = post_json(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 0,
                                                   "temperature": 0})
    assert status == 200, r
    lps = r["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == n + 1 and lps[0] is None and all(x is not None and x <= 0 for x in lps[1:])
    # the list's regular pattern is easy to predict once seen: late tokens are confident
    tail = lps[n // 2:n - 10]
    assert sum(tail) / len(tail) > -2.0
    # the same prompt again comes mostly from the prefix cache and continues identically
    again = post_json(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})[1]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= n - 32
    assert again["choices"][0]["text"].startswith(r["choices"][0]["text"][len(prompt):])


# ----------------------------------------------------------------------------- failure modes

def test_disconnect_frees_blocks(url):
    async def go():
        async with aiohttp.ClientSession() as s:
            # streaming: read a few chunks, then drop the connection
            ev = await _sse(s, f"{url}/v1/completions", {"prompt": "Tell me a long story.", "max_tokens": 400,
                                                          "temperature": 1.0, "ignore_eos": True, "stream": True},
                            stop_after=3)
            assert len(ev) == 3
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.5)) as s:
            # non-streaming: give up while it is still generating
            with pytest.raises(asyncio.TimeoutError):
                await _post(s, f"{url}/v1/chat/completions", chat_body("Tell me a long story.", max_tokens=400,
                                                                       ignore_eos=True))

    asyncio.run(go())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(url)
        if m["jaxserve_kv_blocks_used"] == 0 and m["jaxserve_num_requests_running"] == 0:
            break
        time.sleep(0.2)
    m = metrics(url)
    assert m["jaxserve_kv_blocks_used"] == 0 and m["jaxserve_num_requests_running"] == 0, m
    assert m['jaxserve_request_finished_total{finish_reason="abort"}'] >= 2
    assert m["jaxserve_kv_blocks_free"] == m["jaxserve_kv_blocks_total"]


BAD_CHAT = [
    (b"this is not json", None),
    (b"[1, 2, 3]", None),
    (b"null", None),
    (b"", None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),
    (json.dumps({"messages": "hello"}).encode(), "messages"),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({"model": "smol"}).encode(), "messages"),
    (json.dumps(chat_body("hi", max_tokens="ten")).encode(), "max_tokens"),
    (json.dumps(chat_body("hi", temperature=-1)).encode(), "temperature"),
    (json.dumps(chat_body("hi", n=True)).encode(), "n"),
    (json.dumps(chat_body("hi", stream="yes")).encode(), "stream"),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), "messages[0].role"),
    (json.dumps({"messages": [{"content": "hi"}]}).encode(), "messages[0].role"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "messages[0].content"),
    (json.dumps(chat_body("hi", logprobs=True, top_logprobs=21)).encode(), "top_logprobs"),
    (json.dumps(chat_body("hi", top_logprobs=2)).encode(), "top_logprobs"),
    (json.dumps(chat_body("hi", tools=[{"type": "code_interpreter"}])).encode(), "tools[0]"),
    (json.dumps(chat_body("hi", tools=[{"type": "function", "function": {"name": "a b"}}])).encode(),
     "tools[0].function.name"),
    (json.dumps(chat_body("hi", tool_choice="required")).encode(), "tool_choice"),
    (json.dumps(chat_body("hi", tools=[{"type": "function", "function": {"name": "f"}}],
                          tool_choice={"type": "function", "function": {"name": "g"}})).encode(), "tool_choice"),
    (json.dumps(chat_body("hi", tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
                          response_format={"type": "json_object"})).encode(), "tool_choice"),
    (json.dumps(chat_body("hi", functions=[{"name": "f"}])).encode(), "functions"),
    (json.dumps({"messages": [{"role": "tool", "content": "42"}]}).encode(), "messages[0].tool_call_id"),
    (json.dumps(chat_body("hi", response_format={"type": "xml"})).encode(), "response_format.type"),
    (json.dumps(chat_body("hi", response_format={"type": "json_schema"})).encode(), "response_format.json_schema"),
    (json.dumps(chat_body("hi", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frob"}}})).encode(), "response_format"),
    (json.dumps(chat_body("hi", structured_outputs={"regex": "(("})).encode(), "structured_outputs"),
    (json.dumps(chat_body("hi", structured_outputs={"choice": []})).encode(), "structured_outputs"),
    (json.dumps(chat_body("hi", structured_outputs={"regex": "a", "choice": ["b"]})).encode(), "structured_outputs"),
    (json.dumps(chat_body("hi", structured_outputs={"json": {}, "whitespace_pattern": " "})).encode(),
     "structured_outputs"),
    (json.dumps(chat_body("hi", modalities=["text", "audio"])).encode(), "modalities"),
    (json.dumps(chat_body("hi", logit_bias={str(i): 1 for i in range(65)})).encode(), "logit_bias"),
    (json.dumps(chat_body("hi", logit_bias={"99999999": 5})).encode(), "logit_bias"),
    (json.dumps(chat_body("hi", logit_bias={"1_0": 5})).encode(), "logit_bias"),  # int() would take these
    (json.dumps(chat_body("hi", logit_bias={" 7": 5})).encode(), "logit_bias"),
    (json.dumps(chat_body("hi", logit_bias={"-1": 5})).encode(), "logit_bias"),
    (json.dumps(chat_body("hi", logit_bias={"9" * 5000: 5})).encode(), "logit_bias"),  # past int()'s digit limit
    (json.dumps(chat_body("hi", frobnicate=1)).encode(), "frobnicate"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(),
     "messages[0].content[0].type"),
    (json.dumps(chat_body("hi " * 3000)).encode(), "messages"),
]

BAD_COMPLETIONS = [
    (json.dumps({"prompt": [49152]}).encode(), "prompt"),
    (json.dumps({"prompt": [-1]}).encode(), "prompt"),
    (json.dumps({"prompt": [[1, 2], []]}).encode(), "prompt"),
    (json.dumps({"prompt": [1, "a"]}).encode(), "prompt"),
    (json.dumps({"prompt": "hi", "logprobs": 21}).encode(), "logprobs"),
    (json.dumps({"prompt": "hi", "max_tokens": -1}).encode(), "max_tokens"),
    (json.dumps({"prompt": "hi", "best_of": 3}).encode(), "best_of"),
    (json.dumps({"prompt": "hi", "suffix": "x"}).encode(), "suffix"),
    (json.dumps({"prompt": "word " * 2100}).encode(), "prompt"),
    (json.dumps({"prompt": "hi", "stream_options": {"include_usage": True}}).encode(), "stream_options"),
    (json.dumps({"prompt": "hi", "structured_outputs": {"grammar": "start: foo"}}).encode(), "structured_outputs"),
    # compiles, but no output can satisfy it (was a 200 with an empty reply)
    (json.dumps({"prompt": "hi", "structured_outputs": {"regex": "[^\\s\\S]"}}).encode(), "structured_outputs"),
]


def test_bad_bodies_are_4xx_and_server_survives(url):
    for body, param in BAD_CHAT:
        status, err = post_raw(f"{url}/v1/chat/completions", body)
        assert status == 400, (body[:80], status, err)
        validate_schema(err, "ErrorResponse")
        if param is not None:
            assert err["error"]["param"] == param, (body[:80], err)
    for body, param in BAD_COMPLETIONS:
        status, err = post_raw(f"{url}/v1/completions", body)
        assert status == 400, (body[:80], status, err)
        validate_schema(err, "ErrorResponse")
        assert err["error"]["param"] == param, (body[:80], err)
    # the too-long prompt names both numbers
    status, err = post_raw(f"{url}/v1/completions", json.dumps({"prompt": "word " * 2100}).encode())
    assert re.search(r"\d+ tokens.*2048", err["error"]["message"]), err
    status, err = post_raw(f"{url}/detokenize", json.dumps({"tokens": [10 ** 9]}).encode())
    assert status == 400 and err["error"]["param"] == "tokens"
    # unknown routes keep the error shape
    status, err = post_raw(f"{url}/v1/nothing", b"{}")
    assert status == 404
    validate_schema(err, "ErrorResponse")
    # a body over the limit (16 MiB) is refused from its Content-Length, before it is read
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(17 << 20))
    conn.endheaders()
    conn.send(b'{"prompt": "aaaa')
    resp = conn.getresponse()
    assert resp.status == 413
    validate_schema(json.loads(resp.read()), "ErrorResponse")
    conn.close()
    # accepted and ignored fields
    status, r = post_json(f"{url}/v1/chat/completions", chat_body("hi", max_tokens=2, user="u1", metadata={"a": "b"},
                                                                  store=False, service_tier="auto",
                                                                  parallel_tool_calls=False, tool_choice="none",
                                                                  response_format={"type": "text"}))
    assert status == 200, r
    # ... and the server still answers normally
    status, r = post_json(f"{url}/v1/chat/completions", chat_body("Hello!", max_tokens=4))
    assert status == 200 and r["choices"][0]["message"]["content"] is not None
    assert get_json(f"{url}/health")[0] == 200
    assert metrics(url)["jaxserve_engine_step_failures_total"] == 0


def test_extreme_values_never_break_the_engine(url):
    big = 2 ** 40
    cases = [dict(top_k=big), dict(min_tokens=big), dict(seed=2 ** 70), dict(seed=-5),
             dict(max_tokens=big, logit_bias={"0": 100, "2": 100}), dict(stop_token_ids=[big]),
             dict(repetition_penalty=1e30), dict(top_p=1e-30), dict(min_p=1.0),
             dict(logit_bias={"0": 100, "1": -100}), dict(stop=["x" * 600]), dict(stop=[""] * 3),
             dict(n=129), dict(temperature=2.5), dict(top_k=-1), dict(top_k=-2), dict(min_tokens=3, max_tokens=2)]
    for extra in cases:
        status, r = post_json(f"{url}/v1/completions", {"prompt": "Hi", "max_tokens": 3, "temperature": 1.0,
                                                        **{"max_tokens": 3, **extra}})
        assert status in (200, 400), (extra, status, r)
        if status == 400:
            validate_schema(r, "ErrorResponse")
    m = metrics(url)
    assert m["jaxserve_engine_step_failures_total"] == 0 and get_json(f"{url}/health")[0] == 200


def test_max_tokens_past_the_context_ends_with_length(url):
    """README: a max_tokens the prompt leaves no room for is not refused: the reply stops at
    max_model_len (2,048 here) with "length"; min_tokens above max_tokens is a 400."""
    status, r = post_json(f"{url}/v1/completions", {"prompt": [19556] * 2040, "max_tokens": 100, "temperature": 0})
    assert status == 200, r
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 8
    status, r = post_json(f"{url}/v1/completions", {"prompt": "Hi", "max_tokens": 2, "min_tokens": 3})
    assert status == 400 and r["error"]["param"] == "min_tokens", r


def test_queue_full_is_429(url):
    # 16 rows, at most 64 waiting: a burst of 120 requests overflows the queue
    async def go():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            return await asyncio.gather(*[
                _post(s, f"{url}/v1/completions", {"prompt": f"Burst {i}", "max_tokens": 2, "temperature": 0})
                for i in range(120)])

    res = asyncio.run(go())
    codes = [st for st, _ in res]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
    err = next(b for st, b in res if st == 429)
    validate_schema(err, "ErrorResponse")
    assert post_json(f"{url}/v1/completions", {"prompt": "after", "max_tokens": 1})[0] == 200


def test_metrics_exposition(url):
    m = metrics(url)
    for name in ("jaxserve_num_requests_waiting", "jaxserve_num_requests_running", "jaxserve_kv_blocks_used",
                 "jaxserve_kv_blocks_free", "jaxserve_prefix_cache_hit_tokens_total", "jaxserve_prompt_tokens_total",
                 "jaxserve_generation_tokens_total", "jaxserve_time_to_first_token_seconds_count",
                 "jaxserve_time_per_output_token_seconds_count", "jaxserve_batch_size_count"):
        assert name in m, name
    assert m["jaxserve_generation_tokens_total"] > 0 and m["jaxserve_time_to_first_token_seconds_count"] > 0
    assert any(k.startswith("jaxserve_http_requests_total{") for k in m)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _weather_history(city: str) -> list[dict]:
    """Three earlier turns in which the assistant called get_weather (OpenAI's message shapes): with
    them the real SmolLM2-135M answers a fourth question with a call of its own."""
    msgs = []
    for i, (c, t) in enumerate([("Oslo", "12 C"), ("Rome", "25 C"), ("Lima", "18 C")]):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
        msgs += [{"role": "user", "content": f"Weather in {c}?"},
                 {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": f"call_{i}", "content": t},
                 {"role": "assistant", "content": f"It is {t} in {c}."}]
    return msgs + [{"role": "user", "content": f"Weather in {city}?"}]


def _stream_chunks(url: str, body: dict) -> list[dict]:
    """A chat stream's chunks, each valid against OpenAI's schema, ended by [DONE]."""
    events = sse(f"{url}/v1/chat/completions", body)
    assert events[-1][1] == "[DONE]"
    chunks = [e for _, e in events[:-1]]
    for c in chunks:
        validate_schema(c, "CreateChatCompletionStreamResponse")
    return chunks


def _streamed_calls(url: str, body: dict) -> tuple[list[dict], list[dict]]:
    """(choice deltas, tool-call deltas) of a stream that must carry no content."""
    deltas = [c["choices"][0] for c in _stream_chunks(url, body)]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
    return deltas, [tc for d in deltas for tc in d["delta"].get("tool_calls", [])]


def _merge_calls(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas joined by index as OpenAI clients join them ({"name", "arguments"} per call)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
        c["arguments"] += d["function"].get("arguments") or ""
    return [calls[k] for k in sorted(calls)]


def test_tool_calling_end_to_end(url, client):
    """Tools through the real server and model: the reply's Hermes-format call becomes OpenAI
    tool_calls (finish_reason 'tool_calls'), streamed as tool-call deltas without the markup, and the
    openai client reads it; bodies valid against OpenAI's schemas."""
    body = {"model": "smol", "messages": _weather_history("Paris"), "tools": [WEATHER_TOOL], "temperature": 0,
            "max_tokens": 40}
    status, r = post_json(f"{url}/v1/chat/completions", body)
    assert status == 200, r
    validate_schema(r, "CreateChatCompletionResponse")
    ch = r["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
    (call,) = ch["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # streamed: the call begins (id, name) before the reply ends and its arguments come in pieces that join
    # into the same call; no content (the markup is held back)
    deltas, calls = _streamed_calls(url, dict(body, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in _merge_calls(calls)] == [("get_weather", {"city": "Paris"})]
    assert len(calls) > 2 and deltas[-1]["finish_reason"] == "tool_calls" and "tool_calls" not in deltas[-1]["delta"]
    # the openai client's stream helper joins the pieces and parses the arguments
    with client.chat.completions.stream(model="smol", messages=_weather_history("Paris"), tools=[WEATHER_TOOL],
                                        temperature=0, max_tokens=40) as stream:
        final = stream.get_final_completion()
    (tc,) = final.choices[0].message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
    # the openai client parses it; the call and its result appended, the model answers in text
    c = client.chat.completions.create(model="smol", messages=_weather_history("Paris"), tools=[WEATHER_TOOL],
                                       temperature=0, max_tokens=40)
    tc = c.choices[0].message.tool_calls[0]
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
    follow = _weather_history("Paris") + [
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": "21 C"}]
    status, r = post_json(f"{url}/v1/chat/completions", {"messages": follow, "tools": [WEATHER_TOOL], "temperature": 0,
                                                         "max_tokens": 16})
    assert status == 200, r
    validate_schema(r, "CreateChatCompletionResponse")
    assert r["choices"][0]["message"]["content"]
    # tool_choice "none": the tools are not shown and nothing is parsed
    status, r = post_json(f"{url}/v1/chat/completions", dict(body, tool_choice="none"))
    assert status == 200 and "tool_calls" not in r["choices"][0]["message"]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}


def test_structured_outputs_end_to_end(url, client):
    """response_format / structured_outputs / forced tool calls through the real server and model: every
    reply parses and satisfies its schema, regex or choice; bodies valid against OpenAI's schemas; a
    constrained request beside unconstrained ones leaves their greedy text unchanged."""
    import jsonschema

    msgs = [{"role": "user", "content": "Invent a person and describe them as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    status, r = post_json(f"{url}/v1/chat/completions", {"messages": msgs, "response_format": rf, "temperature": 0,
                                                         "max_tokens": 80})
    assert status == 200, r
    validate_schema(r, "CreateChatCompletionResponse")
    ch = r["choices"][0]
    assert ch["finish_reason"] == "stop", ch
    greedy = json.loads(ch["message"]["content"])
    jsonschema.validate(greedy, PERSON)
    assert set(greedy) <= {"name", "age"}  # objects are closed unless the schema opens them
    # sampled, three choices, through the openai client (its `response_format` as a dict)
    c = client.chat.completions.create(model="smol", messages=msgs, response_format=rf, temperature=1.0, seed=7,
                                       n=3, max_tokens=80)
    for choice in c.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # streamed: the deltas join into the same greedy object
    chunks = _stream_chunks(url, {"messages": msgs, "response_format": rf, "temperature": 0, "max_tokens": 80,
                                  "stream": True})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    assert json.loads(text) == greedy and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # any JSON object
    status, r = post_json(f"{url}/v1/chat/completions", {"messages": msgs, "temperature": 0, "max_tokens": 200,
                                                         "response_format": {"type": "json_object"}})
    assert status == 200 and r["choices"][0]["finish_reason"] == "stop", r
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    # vLLM's structured_outputs on completions: a choice and a regex
    status, r = post_json(f"{url}/v1/completions", {"prompt": "Is the sea salty? Answer:", "temperature": 0,
                                                    "structured_outputs": {"choice": [" yes", " no"]}})
    assert status == 200 and r["choices"][0]["text"] in (" yes", " no") and r["choices"][0]["finish_reason"] == "stop"
    validate_schema(r, "CreateCompletionResponse")
    status, r = post_json(f"{url}/v1/completions", {"prompt": "The date today is", "temperature": 0.7, "seed": 3,
                                                    "structured_outputs": {"regex": r" 20\d\d-[01]\d-[0-3]\d"}})
    assert status == 200 and re.fullmatch(r" 20\d\d-[01]\d-[0-3]\d", r["choices"][0]["text"]), r
    # forced tool calls: a named function and "required", plain and streamed
    body = {"model": "smol", "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 60}
    params = WEATHER_TOOL["function"]["parameters"]
    for tool_choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        status, r = post_json(f"{url}/v1/chat/completions", dict(body, tool_choice=tool_choice))
        assert status == 200, r
        validate_schema(r, "CreateChatCompletionResponse")
        ch = r["choices"][0]
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None, ch
        assert ch["message"]["tool_calls"], ch
        for call in ch["message"]["tool_calls"]:
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), params)
        deltas, calls = _streamed_calls(url, dict(body, tool_choice=tool_choice, stream=True))
        assert [json.loads(c["arguments"]) for c in _merge_calls(calls)] == \
            [json.loads(tc["function"]["arguments"]) for tc in ch["message"]["tool_calls"]]
        assert deltas[-1]["finish_reason"] == "tool_calls"
    # a forced call cut by max_tokens says "length" (its arguments are incomplete), plain and streamed
    named = dict(body, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=3)
    status, r = post_json(f"{url}/v1/chat/completions", named)
    assert status == 200 and r["choices"][0]["finish_reason"] == "length", r
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["function"]["arguments"].startswith("{")
    deltas, calls = _streamed_calls(url, dict(named, stream=True))
    (merged,) = _merge_calls(calls)
    assert deltas[-1]["finish_reason"] == "length" and merged["arguments"] == call["function"]["arguments"]
    # beside constrained requests, an unconstrained greedy reply is the one it gets alone
    plain = chat_body("Write one sentence about bread.", temperature=0, max_tokens=24)
    status, alone = post_json(f"{url}/v1/chat/completions", plain)
    assert status == 200

    async def together():
        async with aiohttp.ClientSession() as s:
            async def post(b):
                async with s.post(f"{url}/v1/chat/completions", json=b) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()
            return await asyncio.gather(post(plain), *[post({"messages": msgs, "response_format": rf,
                                                             "temperature": 0.8, "seed": i, "max_tokens": 80})
                                                       for i in range(3)])

    mixed, *constrained = asyncio.run(together())
    assert mixed["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    for r in constrained:
        jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), PERSON)
    assert metrics(url)["jaxserve_engine_step_failures_total"] == 0


def test_embeddings_on_a_generative_model_is_400(url):
    status, err = post_json(f"{url}/v1/embeddings", {"input": "hello"})
    assert status == 400 and err["error"]["code"] == "model_not_supported" and err["error"]["param"] == "model"
    validate_schema(err, "ErrorResponse")


def test_lone_surrogates_and_undecodable_bodies_are_400(url):
    """A \\ud800-\\udfff escape without its pair is valid JSON syntax but not Unicode text: json.loads
    made it a lone surrogate that the tokenizer refused with a TypeError (a 500 on every endpoint that
    tokenizes). A body that does not match its Content-Encoding was a 500 too."""
    cases = [("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}',
              "messages[0].content"),
             ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": '
                                      b'"\\udfff"}]}]}', "messages[0].content[0].text"),
             ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
             ("/v1/completions", b'{"prompt": ["ok", "\\udc00x"], "max_tokens": 2}', "prompt[1]"),
             ("/v1/responses", b'{"input": "hi", "instructions": "\\ud800", "max_output_tokens": 2}', "instructions"),
             ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
             ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}', None),
             # the same surrogate UTF-8-encoded (json.loads(bytes) lets it through with 'surrogatepass')
             ("/tokenize", b'{"prompt": "a\xed\xa0\x80"}', None)]
    for path, body, param in cases:
        status, err = post_raw(f"{url}{path}", body)
        assert status == 400, (path, body, status, err)
        validate_schema(err, "ErrorResponse")
        assert err["error"]["param"] == param, (body, err)
    # a surrogate pair is one character, not an error
    status, r = post_raw(f"{url}/tokenize", b'{"prompt": "a\\ud83d\\ude00"}')
    assert status == 200 and r["count"] > 1, r
    status, err = post_raw(f"{url}/v1/chat/completions", json.dumps(chat_body("hi", max_tokens=2)).encode(),
                           headers={"Content-Encoding": "gzip"})
    assert status == 400 and "content-encoding" in err["error"]["message"], (status, err)
    validate_schema(err, "ErrorResponse")
    status, r = post_json(f"{url}/v1/chat/completions", chat_body("Hello!", max_tokens=4))
    assert status == 200 and r["choices"][0]["message"]["content"] is not None
