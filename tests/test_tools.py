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
    assert text == "It is sunny <b>today</b>" and not calls and sent[0] == "It is "
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
