"""Tool calling (server/tools.py): request validation, the prompt for templates with and without
`tools`, and parsing replies in the Hermes/Qwen, Llama 3.x and Mistral formats — streamed or not.
(End to end through a real server: tests/test_server.py::test_tool_calling_end_to_end.)"""

import json

import pytest

from jaxserve.loader.chat_template import ChatTemplate
from jaxserve.server import tools
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import ChatMessage
from jaxserve.server.sampling import messages_for_template

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
FUNCS = tools.check_tools([WEATHER], None)


def test_check_tools():
    assert FUNCS == [{"name": "get_weather", "description": "Weather in a city",
                      "parameters": WEATHER["function"]["parameters"]}]
    assert tools.check_tools([WEATHER], "none") is None and tools.check_tools(None, None) is None
    # forced calls: the functions stay declared; forced_call says which
    assert tools.check_tools([WEATHER], "required") == FUNCS and tools.forced_call("required") == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tools.check_tools([WEATHER], named) == FUNCS and tools.forced_call(named) == "get_weather"
    assert tools.forced_call("auto") is None and tools.forced_call(None) is None
    f = tools.check_tools([{"type": "function", "function": {"name": "ping"}}], "auto")
    assert f[0]["parameters"] == {"type": "object", "properties": {}}
    bad = [([{"type": "retrieval"}], None, "tools[0]"),
           ([WEATHER, WEATHER], None, "tools[1].function.name"),
           ([{"type": "function", "function": {"name": "x", "params": {}}}], None, "tools[0].function"),
           ([{"type": "function", "function": {"name": "x", "parameters": []}}], None, "tools[0].function.parameters"),
           ({"type": "function"}, None, "tools"),
           ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),  # not declared
           ([WEATHER], {"type": "function", "name": "get_weather"}, "tool_choice"),  # Responses API shape
           ([WEATHER], {"type": "function", "function": {"name": "get_weather", "x": 1}}, "tool_choice"),
           ([WEATHER], "sometimes", "tool_choice"),
           (None, "required", "tool_choice")]
    for t, choice, param in bad:
        with pytest.raises(APIError) as e:
            tools.check_tools(t, choice)
        assert e.value.status == 400 and e.value.param == param, (t, choice, e.value.param)


def _args(call):
    return json.loads(call["function"]["arguments"])


FORMATS = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [{"city": "Paris"}]),
    ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>', "Let me look.",
     [{"city": "Oslo"}, {"city": "Rome"}]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Bern"}}', None, [{"city": "Bern"}]),  # EOS before the tag
    ('{"name": "get_weather", "parameters": {"city": "Lima"}}', None, [{"city": "Lima"}]),  # Llama 3.x
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Kyiv"}}', None, [{"city": "Kyiv"}]),
    ('{"name": "get_weather", "parameters": {"city": "A"}}; {"name": "get_weather", "parameters": {"city": "B"}}',
     None, [{"city": "A"}, {"city": "B"}]),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}]', None, [{"city": "Nice"}]),  # Mistral
]


@pytest.mark.parametrize("text,content,args", FORMATS)
def test_parse_formats(text, content, args):
    got_content, calls = tools.parse(text, FUNCS)
    assert got_content == content
    assert [_args(c) for c in calls] == args
    assert all(c["type"] == "function" and c["function"]["name"] == "get_weather" and c["id"].startswith("call_")
               for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("text", [
    "It is sunny in Paris.",
    '{"name": "delete_everything", "parameters": {}}',  # not a declared function
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
    '{"name": "get_weather", "arguments": [1, 2]}',  # arguments not an object
    '{"answer": 42}',
])
def test_non_calls_stay_text(text):
    assert tools.parse(text, FUNCS) == (text, [])


def _stream(pieces):
    h = tools.StreamHolder()
    sent = [h.feed(p) for p in pieces]
    rest, calls = h.finish(FUNCS)
    return "".join(sent) + rest, sent, calls


def test_stream_holder():
    # plain text streams as it comes (except a possible start of "<tool_call>")
    text, sent, calls = _stream(["It is ", "sunny <", "b>today</b>"])
    assert text == "It is sunny <b>today</b>" and not calls and sent[0] == "It is"  # the space waits for what follows
    # text, then a call: the text streams, the markup never does
    text, sent, calls = _stream(["Checking.", " <tool", '_call>{"name": "get_weather", ',
                                 '"arguments": {"city": "Oslo"}}</tool_call>'])
    assert text.strip() == "Checking." and [_args(c) for c in calls] == [{"city": "Oslo"}]
    # a whole-reply call: nothing streams
    text, sent, calls = _stream(['{"name": "get_weather",', ' "parameters": {"city": "Lima"}}'])
    assert text == "" and [_args(c) for c in calls] == [{"city": "Lima"}]
    # held because it looked like a call, but it was not: all of it comes out at the end
    text, sent, calls = _stream(['{"answer"', ": 42}"])
    assert text == '{"answer": 42}' and not calls and sent == ["", ""]


HISTORY = [ChatMessage(role="user", content="Weather in Oslo?"),
           ChatMessage(role="assistant", content=None, tool_calls=[
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]),
           ChatMessage(role="tool", content="12 C, rain", tool_call_id="call_1")]


def test_history_for_templates_with_and_without_tools():
    native = messages_for_template(HISTORY, native_tools=True)
    assert native[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert native[2] == {"role": "tool", "content": "12 C, rain", "tool_call_id": "call_1"}
    plain = messages_for_template(HISTORY, native_tools=False)
    assert "tool_calls" not in plain[1]
    assert tools.parse(plain[1]["content"], FUNCS)[1][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert plain[2]["content"] == "<tool_response>\n12 C, rain\n</tool_response>"
    with pytest.raises(APIError, match="tool_call_id"):
        messages_for_template([ChatMessage(role="tool", content="x")])
    with pytest.raises(APIError, match="only assistant"):
        messages_for_template([ChatMessage(role="user", content="x", tool_calls=[{}])])
    with pytest.raises(APIError, match="a tool call must be"):
        messages_for_template([ChatMessage(role="assistant", content="", tool_calls=[{"function": "f"}])])


def test_templates_render_tools():
    """A template with `tools` gets them as OpenAI-shaped objects; the Hermes prompt for the others
    names every function with its schema."""
    t = ChatTemplate("{% for t in tools or [] %}[{{ t.function.name }}:{{ t.function.parameters | tojson }}]"
                     "{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert tools.uses_tools(t.source)
    text = t.render(messages_for_template(HISTORY[:1]), tools=tools.template_tools(FUNCS))
    assert text.startswith('[get_weather:{"type": "object"') and text.endswith("<user>Weather in Oslo?")
    prompt = tools.system_prompt(FUNCS)
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt and '"required": ["city"]' in prompt


def test_parse_forced_calls():
    # a named function: the reply is its arguments object (compacted when it is valid JSON)
    [c] = tools.parse_forced('{\n  "city": "Paris"\n}', "get_weather")
    assert c["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and c["type"] == "function"
    [c] = tools.parse_forced('{"city": "Par', "get_weather")  # cut by max_tokens: the text as it is
    assert c["function"]["arguments"] == '{"city": "Par'
    # "required": a list of {"name", "arguments"}; complete calls before a cut are kept
    calls = tools.parse_forced('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                               '{"name": "get_weather", "arguments": {"city": "Rome"}}]', "required")
    assert [_args(c) for c in calls] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert len({c["id"] for c in calls}) == 2
    calls = tools.parse_forced('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_w', "required")
    assert [_args(c) for c in calls] == [{"city": "Oslo"}]
    assert tools.parse_forced('[{"name": "get', "required") == []
    # the stream holder sends no content and gives the calls at the end
    h = tools.ForcedCallHolder("get_weather")
    assert h.feed('{"city": ') == "" and h.feed('"Lima"}') == ""
    rest, [c] = h.finish(FUNCS)
    assert rest == "" and _args(c) == {"city": "Lima"}


def _merge(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas joined as OpenAI clients join them; each call's first delta carries its id, type and
    name, the later ones only argument pieces."""
    calls = {}
    for d in deltas:
        k = d["index"]
        if k not in calls:
            assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["name"], d
            calls[k] = {"id": d["id"], "name": d["function"]["name"], "arguments": d["function"]["arguments"]}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
            calls[k]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [calls[k] for k in sorted(calls)]


def _stream_deltas(holder, text, size, funcs=FUNCS):
    """(content, tool-call deltas sent while generating, deltas sent at the end) for text fed in pieces."""
    content, during = "", []
    for i in range(0, len(text), size):
        content += holder.feed(text[i:i + size])
        during += holder.call_deltas(funcs)
    rest, end = holder.finish(funcs)
    return content + rest, during, end


@pytest.mark.parametrize("text,content,args", FORMATS)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_call_deltas(text, content, args, size):
    """Streamed, a call begins (id, type, name) as soon as its name is complete and its arguments stream
    piece by piece as written: joined, the pieces are the arguments `parse` finds; the markup never
    streams; content is parse's content."""
    got, during, end = _stream_deltas(tools.StreamHolder(), text, size)
    assert got.strip() == (content or "")
    calls = _merge(during + end)
    assert [json.loads(c["arguments"]) for c in calls] == args and {c["name"] for c in calls} == {"get_weather"}
    for d in during + end:
        piece = d["function"]["arguments"]
        assert not any(m in piece for m in ("<tool", "</", "[TOOL", "python_tag")), piece
    if size < len(text) and any(c["arguments"].startswith("{") for c in calls):
        # an object's arguments began streaming before the reply ended
        assert any(d["function"]["arguments"] for d in during)


def test_streamed_calls_edge_cases():
    # arguments written as a JSON string come whole once the call is complete
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    _, during, end = _stream_deltas(tools.StreamHolder(), text, 2)
    assert during == [] and [json.loads(c["arguments"]) for c in _merge(end)] == [{"city": "Rome"}]
    # an undeclared function never begins: the reply is text, as parse says
    text = '<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>'
    got, during, end = _stream_deltas(tools.StreamHolder(), text, 2)
    assert got == text and during == end == []
    # parallel_tool_calls false: only the first call
    two = FORMATS[5][0]
    _, during, end = _stream_deltas(tools.StreamHolder(max_calls=1), two, 4)
    assert [json.loads(c["arguments"]) for c in _merge(during + end)] == [{"city": "A"}]
    # a block whose JSON breaks after its call began: the arguments sent are what was written, no markup
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    got, during, end = _stream_deltas(tools.StreamHolder(), text, 2)
    (call,) = _merge(during + end)
    assert got == "" and call["arguments"].strip() == '{"city":'
    # cut by max_tokens inside the arguments: the pieces so far
    _, during, end = _stream_deltas(tools.StreamHolder(), '{"name": "get_weather", "parameters": {"city": "Li', 5)
    assert _merge(during + end)[0]["arguments"] == '{"city": "Li'


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_streamed_forced_calls(size):
    """Forced calls stream the same way: a named function's whole reply is its arguments; "required"
    replies are a JSON list of calls."""
    _, during, end = _stream_deltas(tools.ForcedCallHolder("get_weather"), ' {"city": "Lima"}', size)
    (call,) = _merge(during + end)
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Lima"}
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    got, during, end = _stream_deltas(tools.ForcedCallHolder("required"), text, size)
    assert got == "" and [json.loads(c["arguments"]) for c in _merge(during + end)] == [{"city": "Oslo"}, {"city": "Rome"}]
    _, during, end = _stream_deltas(tools.ForcedCallHolder("required", max_calls=1), text, size)
    assert [json.loads(c["arguments"]) for c in _merge(during + end)] == [{"city": "Oslo"}]


@pytest.mark.parametrize("size", [1, 4])
def test_long_streamed_arguments(size):
    """A long argument (escaped quotes and backslashes, brackets inside strings) streams whole and exactly;
    its scanner is kept between updates (it resumes where the last update stopped) and ends with the value."""
    args = json.dumps({"path": "a.py", "content": 'x = "a\\\\b" {[}] \\n' * 300, "n": [1, {"k": None}]})
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + args + '}\n</tool_call>'
    h = tools.StreamHolder()
    _, during, end = _stream_deltas(h, text, size)
    (call,) = _merge(during + end)
    assert call["arguments"] == args and len(during) > 100
    a = text.index(args)
    assert h.calls.ends[a].end == a + len(args)


# ----------------------------------------------------------------------------- streamed = unstreamed

def _pretty(args: dict) -> str:
    return json.dumps(args, indent=2)  # a model's own spacing, which re-serialising would change


REPLIES = [(None, t) for t, _, _ in FORMATS] + [
    (None, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": ' + _pretty({"city": "Oslo"}) + '}\n</tool_call>'),
    (None, '<tool_call>{"name": "get_weather", "arguments": {"city":"A"}}</tool_call>\n<tool_call>{"name": '
           '"get_weather", "arguments": {"city": "B" }}</tool_call>'),
    ("get_weather", ' ' + _pretty({"city": "Lima"})),
    ("required", '[\n  {"name": "get_weather", "arguments": ' + _pretty({"city": "Oslo"}) + '},\n  {"name": '
                 '"get_weather", "arguments": {"city" : "Rome"}}\n]'),
]


def _joined_stream(forced, text, size, reason, max_calls=None):
    """(content, [(name, arguments)], finish_reason) of a reply as chat.ReplyStream streams it, joined; every
    chunk's tool_calls carry one entry per call, a call's first entry its id, type and name."""
    from jaxserve.server.chat import ReplyStream

    rs = ReplyStream(FUNCS, max_calls == 1, forced, None)
    content, calls, fin = "", {}, None
    for i in range(0, max(len(text), 1), size):
        last = i + size >= len(text)
        piece, _, deltas, f = rs.feed(text[i:i + size], last, reason if last else None)
        content, fin = content + piece, f or fin
        chunks = tools.delta_chunks(deltas)  # the `tool_calls` of the chunks chat's stream sends
        assert sorted(map(id, (d for c in chunks for d in c))) == sorted(map(id, deltas))
        assert all(len({d["index"] for d in c}) == len(c) for c in chunks), chunks
        deltas = [d for c in chunks for d in c]
        for d in deltas:
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["type"] == "function", d
                calls[d["index"]] = [d["function"]["name"], ""]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
            calls[d["index"]][1] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[k]) for k in sorted(calls)], fin


def _unstreamed(forced, text, reason, max_calls=None):
    """(content, [(name, arguments)], finish_reason) of a finished reply as chat (and Responses) return it."""
    from types import SimpleNamespace

    from jaxserve.server.chat import ChatRun

    run = ChatRun(None, "m", FUNCS, max_calls == 1, forced, None)
    _, content, calls, fin = run.reply(SimpleNamespace(full_text=text, finish_reason=reason))
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], fin


@pytest.mark.parametrize("forced,text", REPLIES)
def test_streamed_reply_equals_unstreamed(forced, text):
    """A reply streamed in pieces (chat.ReplyStream) and the same reply unstreamed agree: content, the calls'
    names and argument strings (the model's own JSON text, spacing kept), finish_reason — whole, and cut by
    max_tokens ("length") or by a stop string ("stop") at every character. "tool_calls" only when every
    call is whole; a cut call keeps the arguments written so far."""
    for cut in range(len(text), 0, -1):
        for reason in (["stop"] if cut == len(text) else ["length", "stop"]):
            want = _unstreamed(forced, text[:cut], reason)
            for size in (1, 5, 10_000):  # 10_000: the whole reply in one update (two calls begin in it)
                got = _joined_stream(forced, text[:cut], size, reason)
                assert (got[0].strip() or None, got[1], got[2]) == \
                    ((want[0] or "").strip() or None, want[1], want[2]), (text[:cut], size, reason)
            content, calls, fin = want
            if fin == "tool_calls":
                assert calls and all(isinstance(json.loads(a), dict) for _, a in calls)
            elif calls:  # begun, not whole: the engine's reason, never "tool_calls"
                assert fin == reason
    content, calls, fin = _unstreamed(forced, text, "stop")
    assert fin == "tool_calls" and calls
    for _, a in calls:  # the arguments as written (a string argument is decoded: JSON text of its own)
        assert a in text or json.loads(a) == {"city": "Rome"}


def test_unstreamed_cut_call():
    """max_tokens inside a call's arguments: the call as begun, its arguments incomplete, "length" (the
    reply is not text holding markup, and the call is not presented as whole)."""
    content, calls, fin = _unstreamed(None, '<tool_call>\n{"name": "get_weather", "arguments": {"city":', "length")
    assert (content, calls, fin) == (None, [("get_weather", '{"city":')], "length")
    # a stop string inside the arguments: the same call, "stop" (not "tool_calls")
    assert _unstreamed(None, '{"name": "get_weather", "parameters": {"city": "Paris"', "stop")[1:] == \
        ([("get_weather", '{"city": "Paris"')], "stop")
    # "required" cut inside its second call: both calls, the second incomplete
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"ci'
    assert _unstreamed("required", text, "length")[1:] == \
        ([("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"ci')], "length")


def test_responses_call_status_when_cut():
    """/v1/responses: a function_call item whose arguments max_output_tokens cut is "incomplete", streamed
    (the output_item.done event and the final response) or not."""
    from jaxserve.server import responses

    es = responses._EventStream({"id": "resp_x", "output": []})
    es.call({"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}})
    evs, resp = es.finish("length", {})
    (item,) = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert item["status"] == resp["output"][0]["status"] == "incomplete" and resp["status"] == "incomplete"
    # whole arguments before the cut: completed
    es = responses._EventStream({"id": "resp_x", "output": []})
    es.call({"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}})
    assert es.finish("length", {})[1]["output"][0]["status"] == "completed"


# ----------------------------------------------------------------------------- through the real server

@pytest.fixture(scope="module")
def url(server_factory):
    return server_factory("main").url  # tests/conftest.py: the real SmolLM2 GGUF


def _weather_history(city: str) -> list[dict]:
    """Earlier turns in which the assistant called get_weather (as tests/test_server.py's): with them the
    real SmolLM2-135M answers with a call of its own."""
    msgs = []
    for i, (c, t) in enumerate([("Oslo", "12 C"), ("Rome", "25 C"), ("Lima", "18 C")]):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
        msgs += [{"role": "user", "content": f"Weather in {c}?"},
                 {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": f"call_{i}", "content": t},
                 {"role": "assistant", "content": f"It is {t} in {c}."}]
    return msgs + [{"role": "user", "content": f"Weather in {city}?"}]


def _post_stream(url: str, body: dict) -> list[dict]:
    import urllib.request

    from conftest import validate_schema

    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        lines = [ln[6:] for ln in r.read().decode().split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln) for ln in lines[:-1]]
    for c in chunks:
        validate_schema(c, "CreateChatCompletionStreamResponse")
    return chunks


def _joined_chunks(chunks: list[dict], n: int) -> dict[int, tuple]:
    """choice index -> (content, [(name, arguments)], finish_reason) of a stream, checked as OpenAI clients
    read it: one finish_reason per choice, one tool_calls entry per call in a chunk, a call's first entry
    with its id, type and name and the later ones only argument pieces."""
    out = {i: ["", {}, None] for i in range(n)}
    for chunk in chunks:
        for ch in chunk["choices"]:
            o, d = out[ch["index"]], ch["delta"]
            o[0] += d.get("content") or ""
            tcs = d.get("tool_calls") or []
            assert len({tc["index"] for tc in tcs}) == len(tcs), tcs
            for tc in tcs:
                if tc["index"] not in o[1]:
                    assert tc["id"].startswith("call_") and tc["type"] == "function", tc
                    o[1][tc["index"]] = [tc["function"]["name"], ""]
                else:
                    assert set(tc) == {"index", "function"} and "name" not in tc["function"], tc
                o[1][tc["index"]][1] += tc["function"].get("arguments") or ""
            if ch["finish_reason"]:
                assert o[2] is None, chunk
                o[2] = ch["finish_reason"]
    return {i: (c, [tuple(v) for _, v in sorted(calls.items())], f) for i, (c, calls, f) in out.items()}


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.timeout(900)
def test_server_stream_equals_unstreamed(url):
    """The real server and model, n > 1, sampled with a seed, tool_choice auto / named / "required", whole
    and cut by max_tokens or a stop string: a streamed reply's joined content, tool calls (argument strings
    as the model wrote them) and finish_reason equal the unstreamed reply's; "tool_calls" only for whole
    calls, "length" for one cut by max_tokens; bodies valid against OpenAI's schemas."""
    from conftest import post_json, validate_schema

    oslo = [{"role": "user", "content": "What is the weather in Oslo and in Rome?"}]
    cases = [dict(messages=_weather_history("Paris"), max_tokens=mt) for mt in (20, 40)]
    cases += [dict(messages=oslo, tool_choice=NAMED, max_tokens=mt) for mt in (9, 40)]
    cases += [dict(messages=oslo, tool_choice="required", max_tokens=mt) for mt in (14, 60)]
    cases += [dict(messages=_weather_history("Paris"), max_tokens=40, stop=["}"])]
    seen = set()
    for case in cases:
        body = {"model": "smol", "tools": [WEATHER], "temperature": 1.0, "seed": 5, "n": 3, **case}
        status, r = post_json(f"{url}/v1/chat/completions", body)
        assert status == 200, r
        validate_schema(r, "CreateChatCompletionResponse")
        streamed = _joined_chunks(_post_stream(url, body), 3)
        for ch in r["choices"]:
            msg, fin = ch["message"], ch["finish_reason"]
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
            assert streamed[ch["index"]] == (msg["content"] or "", calls, fin), (case, ch)
            whole = bool(calls) and all(isinstance(tools._json(a), dict) for _, a in calls)
            assert (fin == "tool_calls") == (whole and fin not in ("length", "stop")), ch
            if calls and not whole:
                assert fin in ("length", "stop") and msg["content"] is None, ch
            seen.add((case.get("tool_choice", "auto") if isinstance(case.get("tool_choice"), str) else
                      "named" if "tool_choice" in case else "auto", fin, whole))
    # the model did make whole calls and calls cut by max_tokens, in each mode
    for mode in ("auto", "named", "required"):
        assert (mode, "tool_calls", True) in seen and (mode, "length", False) in seen, seen
    assert ("auto", "stop", False) in seen, seen  # the stop string "}" inside the arguments
