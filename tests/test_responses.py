"""/v1/responses (OpenAI's Responses API) end to end: the real `jaxserve run` server with the real SmolLM2
GGUF, through the `openai` client (client.responses.create / .stream / .retrieve / .delete) and raw HTTP.
Every response and stream event is validated against the openai package's own pydantic types; replies are
compared with /v1/chat/completions given the same conversation."""

from __future__ import annotations

import json
import urllib.request

import pytest

from conftest import get_json, post_json

pytestmark = pytest.mark.timeout(900)

SYSTEM = "You are a helpful assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def url(server_factory):
    return server_factory("main").url


@pytest.fixture(scope="module")
def client(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def _valid(d: dict):
    from openai.types.responses import Response

    return Response.model_validate(d)


def _chat_text(url: str, messages: list[dict], **kw) -> tuple[str, dict]:
    status, r = post_json(f"{url}/v1/chat/completions", {"model": "smol", "messages": messages, "temperature": 0, **kw})
    assert status == 200, r
    return r["choices"][0]["message"]["content"], r


def test_text_reply_equals_chat(url, client):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    want, chat = _chat_text(url, msgs, max_tokens=24)
    status, raw = post_json(f"{url}/v1/responses", {"model": "smol", "instructions": SYSTEM, "temperature": 0,
                                                    "input": "What is the capital of France?",
                                                    "max_output_tokens": 24})
    assert status == 200, raw
    r = _valid(raw)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == want
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    fin = chat["choices"][0]["finish_reason"]
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == \
        (("incomplete", "max_output_tokens") if fin == "length" else ("completed", None))
    # the openai client, with message items and a developer message
    c = client.responses.create(model="smol", temperature=0, max_output_tokens=24, input=[
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}])
    assert c.output_text == want
    # a reply cut short is "incomplete"
    r = client.responses.create(model="smol", input="Count from one to fifty.", max_output_tokens=4, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 4


def _events(client, **kw) -> list:
    from pydantic import TypeAdapter

    from openai.types.responses import ResponseStreamEvent

    adapter = TypeAdapter(ResponseStreamEvent)
    events = list(client.responses.create(stream=True, **kw))
    for e in events:  # every event as the openai package types it, required fields and all
        adapter.validate_python(e.model_dump())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_streamed_text(url, client):
    kw = dict(model="smol", instructions=SYSTEM, input="Name a fruit that is yellow.", temperature=0,
              max_output_tokens=64)
    want = client.responses.create(**kw)
    assert want.status == "completed"  # (the client's stream helper below wants response.completed)
    events = _events(client, **kw)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if want.status == "completed" else "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == want.output_text
    assert events[-1].response.output_text == want.output_text
    assert events[-1].response.usage.output_tokens == want.usage.output_tokens
    # the client's stream helper puts the events together
    with client.responses.stream(**kw) as s:
        assert s.get_final_response().output_text == want.output_text


RESP_WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _weather_items(city: str) -> list[dict]:
    """tests/test_server.py's weather history as Responses input items (function_call and its output)."""
    items = []
    for i, (c, t) in enumerate([("Oslo", "12 C"), ("Rome", "25 C"), ("Lima", "18 C")]):
        items += [{"role": "user", "content": f"Weather in {c}?"},
                  {"type": "function_call", "call_id": f"call_{i}", "name": "get_weather",
                   "arguments": json.dumps({"city": c})},
                  {"type": "function_call_output", "call_id": f"call_{i}", "output": t},
                  {"role": "assistant", "content": f"It is {t} in {c}."}]
    return items + [{"role": "user", "content": f"Weather in {city}?"}]


def test_function_calls(client):
    kw = dict(model="smol", input=_weather_items("Paris"), tools=[RESP_WEATHER], temperature=0, max_output_tokens=40)
    r = client.responses.create(**kw)
    _valid(r.model_dump())
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_") and r.status == "completed"
    # streamed: the call's item, its arguments in pieces, then done
    events = _events(client, **kw)
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(added) == 1 and added[0].item.name == "get_weather" and len(pieces) > 1
    assert json.loads("".join(pieces)) == {"city": "Paris"} == json.loads(done[0].arguments)
    assert not [e for e in events if e.type == "response.output_text.delta"]
    # the result goes back with previous_response_id; the model answers in text
    follow = client.responses.create(model="smol", previous_response_id=r.id, tools=[RESP_WEATHER], temperature=0,
                                     max_output_tokens=16, input=[{"type": "function_call_output",
                                                                   "call_id": calls[0].call_id, "output": "21 C"}])
    assert follow.output_text and not [o for o in follow.output if o.type == "function_call"]
    # a forced call: always a function_call item
    forced = client.responses.create(model="smol", input="What is the weather in Oslo?", tools=[RESP_WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                     max_output_tokens=40)
    (call,) = [o for o in forced.output if o.type == "function_call"]
    assert isinstance(json.loads(call.arguments), dict)


def test_structured_output(client):
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model="smol", input="Invent a person.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_conversation_state(url, client):
    """previous_response_id continues the stored conversation: the same reply as chat given the whole
    history; GET returns a stored response, DELETE removes it, store=false keeps nothing."""
    first = client.responses.create(model="smol", instructions=SYSTEM, input="My name is Ada and I bake rye bread.",
                                    temperature=0, max_output_tokens=24)
    second = client.responses.create(model="smol", instructions=SYSTEM, previous_response_id=first.id,
                                     input="What is my name?", temperature=0, max_output_tokens=24)
    want, _ = _chat_text(url, [{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": "My name is Ada and I bake rye bread."},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "What is my name?"}], max_tokens=24)
    assert second.output_text == want and second.previous_response_id == first.id
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    client.responses.delete(second.id)
    status, err = get_json_status(f"{url}/v1/responses/{second.id}")
    assert status == 404 and err["error"]["code"] == "not_found"
    status, err = post_json(f"{url}/v1/responses", {"model": "smol", "input": "hi", "previous_response_id": second.id})
    assert status == 404 and err["error"]["param"] == "previous_response_id"
    gone = client.responses.create(model="smol", input="Hello", store=False, max_output_tokens=4)
    assert get_json_status(f"{url}/v1/responses/{gone.id}")[0] == 404


def get_json_status(u: str):
    try:
        return get_json(u)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": "hi", "background": True, "store": False}, "store"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": "hi", "text": {"format": "json"}}, "text.format"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    # an output part whose text is not a string (was a TypeError: 500)
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": 5}]}]},
     "input[0]"),
    # echoed by GET .../input_items, so typed as the API's items are (were stored and echoed as sent)
    ({"input": [{"role": "user", "content": "hi", "id": 7}]}, "input[0].id"),
    ({"input": [{"type": "reasoning", "summary": "thought"}, {"role": "user", "content": "hi"}]}, "input[0].summary"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 1}]}]}, "input[0].summary"),
    ({"input": [{"role": "user", "content": "a", "id": "m1"}, {"role": "user", "content": "b", "id": "m1"}]},
     "input[1].id"),  # ids page input_items: duplicates would make a client's paging loop
    ({"input": "hi", "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": "ten"}, "max_output_tokens"),
    ({}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input"),  # a text-only model takes no images
])
def test_errors(url, body, param):
    status, err = post_json(f"{url}/v1/responses", {"model": "smol", **body})
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param, err


def test_reasoning_item(client):
    """The main server runs with --reasoning-parser qwen3: a reply forced (vLLM's structured_outputs regex)
    to think first has a reasoning item before its message, streamed as reasoning_text deltas."""
    import re

    kw = dict(model="smol", input="Think, then answer: what is bread?", temperature=0, max_output_tokens=60,
              extra_body={"structured_outputs": {"regex": r"<think>[a-z ]{3,40}</think>[A-Z][a-z ]{3,40}"}})
    r = client.responses.create(**kw)
    _valid(r.model_dump())
    (thought, msg) = r.output
    assert thought.type == "reasoning" and re.fullmatch(r"[a-z ]{3,40}", thought.content[0].text)
    assert msg.type == "message" and re.fullmatch(r"[A-Z][a-z ]{3,40}", r.output_text)
    events = _events(client, **kw)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought.content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]


def test_input_items(url, client):
    """GET /v1/responses/{id}/input_items (client.responses.input_items.list): the request's input as item
    objects with ids, newest first by default, paged with limit/after (the client's auto-paging walks them)."""
    from openai.types.responses import ResponseItemList

    items = [{"role": "developer", "content": SYSTEM},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2 + 2?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{\"a\": 2, \"b\": 2}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "4"},
             {"role": "assistant", "content": "It is 4."},
             {"role": "user", "content": "And 3 + 3?"}]
    r = client.responses.create(model="smol", input=items, temperature=0, max_output_tokens=4)
    status, raw = get_json(f"{url}/v1/responses/{r.id}/input_items")
    assert status == 200
    page = ResponseItemList.model_validate(raw)
    assert not page.has_more and [it.type for it in page.data] == ["message", "message", "function_call_output",
                                                                   "function_call", "message", "message"]
    asc = page.data[::-1]
    assert [getattr(it, "role", None) for it in asc] == ["developer", "user", None, None, "assistant", "user"]
    assert asc[1].content[0].text == "What is 2 + 2?" and asc[4].content[0].type == "output_text"
    assert (asc[2].name, asc[2].arguments, asc[3].output) == ("add", "{\"a\": 2, \"b\": 2}", "4")
    assert page.first_id == asc[-1].id and page.last_id == asc[0].id and len({it.id for it in asc}) == 6
    walked = list(client.responses.input_items.list(r.id, limit=4, order="asc"))  # two pages
    assert [it.id for it in walked] == [it.id for it in asc]
    first = client.responses.input_items.list(r.id, limit=4, order="asc")
    assert first.has_more and len(first.data) == 4
    one = client.responses.create(model="smol", input="Hello", max_output_tokens=2)
    (msg,) = client.responses.input_items.list(one.id).data
    assert msg.role == "user" and msg.content[0].text == "Hello"
    for q, param in (("limit=0", "limit"), ("order=up", "order"), ("after=nope", "after")):
        status, err = get_json_status(f"{url}/v1/responses/{r.id}/input_items?{q}")
        assert status == 400 and err["error"]["param"] == param, err
    assert get_json_status(f"{url}/v1/responses/resp_missing/input_items")[0] == 404


def test_reasoning_input_item_is_echoed(url):
    """A reasoning item passed back (as clients replay a previous response's output) is accepted, not shown
    to the model, and listed by input_items with its id and summary."""
    summary = [{"type": "summary_text", "text": "adding"}]
    status, r = post_json(f"{url}/v1/responses", {"model": "smol", "max_output_tokens": 2, "input": [
        {"type": "reasoning", "id": "rs_given", "summary": summary}, {"role": "user", "content": "hi"}]})
    assert status == 200, r
    status, page = get_json(f"{url}/v1/responses/{r['id']}/input_items?order=asc")
    assert status == 200 and page["data"][0] == {"id": "rs_given", "type": "reasoning", "summary": summary}


def _poll(client, rid: str, until=("completed", "incomplete", "failed", "cancelled"), timeout: float = 120):
    import time

    end = time.monotonic() + timeout
    seen = []
    while True:
        r = client.responses.retrieve(rid)
        if not seen or seen[-1] != r.status:
            seen.append(r.status)
        if r.status in until or time.monotonic() > end:
            return r, seen
        time.sleep(0.05)


def _running(url: str) -> float:
    from test_server import metrics

    return metrics(url)["jaxserve_num_requests_running"]


def _idle_soon(url: str, timeout: float = 30) -> bool:
    """The engine's running batch empties within timeout (an abort reaches the engine thread a step later)."""
    import time

    end = time.monotonic() + timeout
    while _running(url) and time.monotonic() < end:
        time.sleep(0.05)
    return _running(url) == 0


def test_background_response_is_polled_to_the_same_reply(url, client):
    """background: true answers at once ("queued"); GET shows it "in_progress", then the finished response,
    which equals the same request answered in the foreground."""
    kw = dict(model="smol", instructions=SYSTEM, input="Name three colours.", temperature=0, max_output_tokens=40)
    want = client.responses.create(**kw)
    bg = client.responses.create(background=True, **kw)
    assert bg.background is True and bg.status in ("queued", "in_progress") and bg.output == []
    queued_ids = [i.id for i in client.responses.input_items.list(bg.id)]
    done, seen = _poll(client, bg.id)
    assert [i.id for i in client.responses.input_items.list(bg.id)] == queued_ids  # the same items when done
    assert done.status == want.status and done.output_text == want.output_text and done.background
    assert done.usage.output_tokens == want.usage.output_tokens
    assert set(seen) <= {"queued", "in_progress", done.status}
    _valid(done.model_dump())
    # it continues a conversation like any stored response
    nxt = client.responses.create(model="smol", previous_response_id=bg.id, input="And one more?", max_output_tokens=4)
    assert nxt.status in ("completed", "incomplete")
    # cancelling a finished one is a 400; a foreground response cannot be cancelled
    for rid in (bg.id, want.id):
        status, err = post_json(f"{url}/v1/responses/{rid}/cancel", {})
        assert status == 400 and err["error"]["param"] == "response_id", err
    assert post_json(f"{url}/v1/responses/resp_missing/cancel", {})[0] == 404


def test_background_stream_is_replayed(url, client):
    """background + stream: the events stream as in the foreground (created "queued", then in_progress ...
    completed) and stay replayable: GET ?stream=true&starting_after=N gives the ones after N, also after a
    client dropped its stream mid-way (the generation does not depend on it)."""
    import asyncio

    import aiohttp
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    kw = dict(model="smol", input="Name three fruits.", temperature=0, max_output_tokens=30)
    want = client.responses.create(**kw)
    events = list(client.responses.create(background=True, stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    assert events[1].type == "response.in_progress" and events[-1].type == f"response.{want.status}"
    assert events[-1].response.output_text == want.output_text and events[-1].response.background
    rid = events[0].response.id
    assert client.responses.retrieve(rid).output_text == want.output_text
    tail = list(client.responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.model_dump() for e in tail] == [e.model_dump() for e in events[4:]]

    async def drop_then_resume():
        seen = []
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/responses", json={**kw, "background": True, "stream": True}) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        seen.append(json.loads(line[6:]))
                    if len(seen) == 3:
                        break  # the connection is closed here, mid-stream
            rid = seen[0]["response"]["id"]
            async with s.get(f"{url}/v1/responses/{rid}?stream=true&starting_after={seen[-1]['sequence_number']}") as r:
                assert r.status == 200
                rest = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
        return seen + rest

    got = asyncio.run(drop_then_resume())
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in got:
        adapter.validate_python(e)
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert got[-1]["type"] == events[-1].type and got[-1]["response"]["output"][0]["content"][0]["text"] == \
        want.output_text
    # only a streamed background response streams again; starting_after must be a number
    status, err = get_json_status(f"{url}/v1/responses/{want.id}?stream=true")
    assert status == 400 and err["error"]["param"] == "stream"
    status, err = get_json_status(f"{url}/v1/responses/{rid}?stream=true&starting_after=x")
    assert status == 400 and err["error"]["param"] == "starting_after"


def test_background_response_cancelled_and_deleted(url, client):
    """A running background response is cancelled (its engine request aborted, nothing stored over it) and a
    second cancel returns it again; deleting one that runs stops it too."""
    import time

    long = dict(model="smol", input="Write a long story.", max_output_tokens=1500, temperature=0,
                extra_body={"structured_outputs": {"regex": "(a ){700}"}})
    bg = client.responses.create(background=True, **long)
    r, _ = _poll(client, bg.id, until=("in_progress",))
    assert r.status == "in_progress" and _running(url) == 1
    ids = [i.id for i in client.responses.input_items.list(bg.id)]
    status, err = post_json(f"{url}/v1/responses", {"model": "smol", "input": "x", "previous_response_id": bg.id})
    assert status == 400 and err["error"]["param"] == "previous_response_id", err  # not finished
    c = client.responses.cancel(bg.id)
    assert c.status == "cancelled" and c.id == bg.id
    assert _idle_soon(url)  # the engine request was aborted, not left to run 1,500 tokens
    time.sleep(0.3)
    again = client.responses.retrieve(bg.id)
    assert again.status == "cancelled" and again.output == []
    assert [i.id for i in client.responses.input_items.list(bg.id)] == ids
    status, err = post_json(f"{url}/v1/responses", {"model": "smol", "input": "x", "previous_response_id": bg.id})
    assert status == 400 and err["error"]["param"] == "previous_response_id", err
    assert client.responses.cancel(bg.id).status == "cancelled"
    # deleted while running: stopped, and not stored again when it would have finished
    bg2 = client.responses.create(background=True, **long)
    _poll(client, bg2.id, until=("in_progress",))
    client.responses.delete(bg2.id)
    assert _idle_soon(url)
    assert get_json_status(f"{url}/v1/responses/{bg2.id}")[0] == 404

    # a streamed one: cancelling it ends its stream
    async def cancel_streamed():
        import aiohttp

        n, rid = 0, None
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/responses", json={"model": "smol", "input": "Write a long story.",
                                                           "max_output_tokens": 1500, "background": True,
                                                           "stream": True, "structured_outputs": {"regex": "(a ){700}"}},
                              timeout=aiohttp.ClientTimeout(total=60)) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        ev = json.loads(line[6:])
                        n += 1
                        rid = rid or ev["response"]["id"]  # the first event: response.created
                        if n == 5:
                            async with s.post(f"{url}/v1/responses/{rid}/cancel", json={}) as c:
                                assert c.status == 200 and (await c.json())["status"] == "cancelled"
        return n

    import asyncio
    n = asyncio.run(cancel_streamed())
    assert 5 <= n < 700  # the stream ended soon after the cancel, far from the 700 forced words
    assert _idle_soon(url)


def test_store_is_bounded_in_bytes(monkeypatch):
    """The oldest stored responses go once the store holds more than MAX_STORED_BYTES of JSON (the newest
    always stays)."""
    import argparse

    from jaxserve.server import responses as mod
    from jaxserve.server.state import ServerState

    state = ServerState(argparse.Namespace(model="m"))
    monkeypatch.setattr(mod, "MAX_STORED_BYTES", 20_000)
    for i in range(6):
        req = mod.ResponsesRequest(input="x" * 3000)
        mod._remember(state, req, {"id": f"resp_{i}", "output": []}, [{"role": "user", "content": req.input}], "ok", [])
    size = state.responses["resp_5"]["bytes"]
    assert 6000 < size < 7000  # the input twice (conversation and input items)
    assert list(state.responses) == [f"resp_{i}" for i in range(6 - 20_000 // size, 6)]
    big = mod.ResponsesRequest(input="y" * 50_000)
    mod._remember(state, big, {"id": "resp_big", "output": []}, [], "ok", [])
    assert list(state.responses) == ["resp_big"]
    # a background response still running is never dropped (GET, cancel and DELETE must find it)
    monkeypatch.setattr(mod, "MAX_STORED", 2)
    state.responses.clear()
    state.responses["resp_bg"] = {"response": {"id": "resp_bg", "status": "in_progress"}, "bytes": 10,
                                  "task": object()}
    for i in range(4):
        mod._remember(state, mod.ResponsesRequest(input="z"), {"id": f"resp_n{i}", "output": []}, [], "ok", [])
    assert list(state.responses) == ["resp_bg", "resp_n3"]


def test_background_failures_are_stored_as_failed():
    """A background generation that fails (an error from the engine) or ends aborted (--request-timeout,
    shutdown) is stored "failed" with its error; a streamed one ends its events with response.failed. The
    engine side is a stand-in here: the paths are the task's own (the server tests cover the real runs)."""
    import argparse
    import asyncio
    from types import SimpleNamespace

    from jaxserve.server import responses as mod
    from jaxserve.server.chat import ChatRun
    from jaxserve.server.errors import APIError
    from jaxserve.server.state import ServerState

    class Gen:
        def __init__(self, how):
            self.how, self.id = how, "chatcmpl-x"
            self.params = SimpleNamespace(logprobs=None)
            self.choices = [SimpleNamespace(finish_reason=None)]

        async def run(self, on_updates=None):
            await asyncio.sleep(0)
            if self.how == "error":
                raise APIError(500, "generation failed: boom")
            self.choices[0].finish_reason = "abort"  # what Generation.run leaves when it aborts

    def start(how, stream):
        state = ServerState(argparse.Namespace(model="m"))
        req = mod.ResponsesRequest(input="hi", background=True, stream=stream)
        run = ChatRun(gen=Gen(how), model="m", funcs=None, one_call=False, forced=None, parser=None)
        resp = mod._envelope(req, "resp_x", 0, "m")

        async def go():
            mod._start_background(state, req, run, resp, [])
            await asyncio.gather(*state.background_tasks)
            return state.responses["resp_x"]
        return asyncio.run(go())

    for how, message in (("error", "generation failed: boom"), ("abort", "aborted")):
        entry = start(how, stream=False)
        r = entry["response"]
        assert r["status"] == "failed" and message in r["error"]["message"] and "task" not in entry, r
        _valid(r)  # the openai package's Response type: its error codes are a fixed set
        assert r["error"]["code"] == "server_error"
    entry = start("error", stream=True)
    types = [e["type"] for e in entry["events"]]
    assert types == ["response.created", "error", "response.failed"] and entry["events_done"]
    assert [e["sequence_number"] for e in entry["events"]] == [0, 1, 2]
    assert entry["response"]["status"] == "failed"
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    for e in entry["events"]:
        TypeAdapter(ResponseStreamEvent).validate_python(e)
