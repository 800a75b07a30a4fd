"""Tool (function) calling for /v1/chat/completions: request validation, the prompt, and parsing the
model's reply into OpenAI `tool_calls`.

With tool_choice "auto" the model decides on its own; with "required" or a named function the reply is
constrained (structured output) to the JSON of the call(s) — `[{"name", "arguments"}, ...]` or the named
function's arguments object — and always comes back as `tool_calls` (`parse_forced`). Declared tools reach the chat
template as `tools` (the Hugging Face convention that Llama 3.1, Qwen 2.5/3, Mistral, Hermes templates
use); a template that never mentions `tools` gets them in a system message in the Hermes format
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), which SmolLM2 and most open models were
tuned on. Replies are parsed in the three formats open models emit:

* Hermes / Qwen: `<tool_call>{json}</tool_call>` blocks (text before them is the message content);
* Llama 3.x: the whole reply is a JSON object `{"name": ..., "parameters" | "arguments": {...}}`
  (optionally after `<|python_tag|>`), or several separated by ';';
* Mistral: `[TOOL_CALLS]` followed by a JSON list of such objects.

A call counts only if its name is one of the declared functions and its arguments are a JSON object;
anything else stays text. In a stream, text that may begin a call is held back (`StreamHolder`), so a
client sees content deltas and tool-call deltas, never the raw markup; a call's arguments stream piece
by piece as they are written (`_CallStream`).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from jaxserve.server.errors import bad_request

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"


def check_tools(tools: Any, tool_choice: Any) -> list[dict] | None:
    """The declared functions ([{"name", "description", "parameters"}]) a reply may call, or None when
    tools are absent or tool_choice is "none". Errors are 400s naming the field."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be an array of {\"type\": \"function\", \"function\": {...}}", "tools")
    funcs, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}} (only function "
                              "tools are supported)", where)
        extra = set(t) - {"type", "function"}
        if extra:
            raise bad_request(f"{where} has unknown fields {sorted(extra)}", where)
        f = t["function"]
        unknown = set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise bad_request(f"{where}.function has unknown fields {sorted(unknown)}", f"{where}.function")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'",
                              f"{where}.function.name")
        if name in seen:
            raise bad_request(f"{where}.function.name {name!r} is declared twice", f"{where}.function.name")
        seen.add(name)
        if "description" in f and not isinstance(f["description"], str):
            raise bad_request(f"{where}.function.description must be a string", f"{where}.function.description")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                              f"{where}.function.parameters")
        if "strict" in f and not isinstance(f["strict"], bool):
            raise bad_request(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
        funcs.append({"name": name, "description": f.get("description", ""), "parameters": params})
    if tool_choice in (None, "auto"):
        return funcs
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return funcs
    if isinstance(tool_choice, dict):
        f = tool_choice.get("function")
        if (set(tool_choice) != {"type", "function"} or tool_choice["type"] != "function"
                or not isinstance(f, dict) or set(f) != {"name"} or not isinstance(f["name"], str)):
            raise bad_request("a named tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tool_choice")
        if f["name"] not in seen:
            raise bad_request(f"tool_choice names {f['name']!r}, which is not among the tools", "tool_choice")
        return funcs
    raise bad_request("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", ...}",
                      "tool_choice")


def forced_call(tool_choice: Any) -> str | None:
    """"required", the name of the function a call must be made to, or None (the model decides).
    tool_choice has passed check_tools."""
    if tool_choice == "required":
        return "required"
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    return None


def _new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_forced(text: str, forced: str) -> list[dict]:
    """The tool calls of a reply constrained by structured.forced_tool_spec. A reply cut short by
    max_tokens is not valid JSON: for a named function its text is still the (partial) arguments, for
    "required" the complete calls before the cut are kept."""
    if forced != "required":
        args = _json(text)
        return [_new_call(forced, json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else text.strip())]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        items = _complete_prefix(text)
    return [_new_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
            for c in items if isinstance(c, dict) and isinstance(c.get("name"), str)]


def _complete_prefix(text: str) -> list:
    """The whole objects at the start of a JSON array that was cut off."""
    dec, out = json.JSONDecoder(), []
    i = text.find("[") + 1
    while 0 < i < len(text):
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        out.append(obj)
    return out


def template_tools(funcs: list[dict]) -> list[dict]:
    """The tools as chat templates receive them (OpenAI's shape)."""
    return [{"type": "function", "function": f} for f in funcs]


def uses_tools(template_source: str) -> bool:
    return "tools" in template_source


def system_prompt(funcs: list[dict]) -> str:
    """The Hermes-format tool instructions for templates that do not render `tools` themselves."""
    lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in funcs)
    return ("You can call functions to help with the user's request. The available functions are listed in "
            f"<tools></tools> tags:\n<tools>\n{lines}\n</tools>\nTo call a function, reply with a JSON object "
            "with the function's name and its arguments inside <tool_call></tool_call> tags, one per call:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <arguments-object>}\n</tool_call>")


def call_as_text(call: dict) -> str:
    """An assistant message's earlier tool call (as sampling._tool_calls_for_template made it: arguments
    already an object when they were JSON), in the Hermes format, for templates without tools."""
    f = call["function"]
    return f"{HERMES_OPEN}\n{json.dumps({'name': f['name'], 'arguments': f['arguments']}, ensure_ascii=False)}\n{HERMES_CLOSE}"


def _call(obj: Any, names: set[str]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return _new_call(obj["name"], json.dumps(args, ensure_ascii=False))


def _json(s: str) -> Any:
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return None


def whole_arguments(arguments: str) -> bool:
    """Whether a call's arguments are whole: a JSON object (not cut short by max_tokens or a stop string)."""
    return isinstance(_json(arguments), dict)


def parse(text: str, funcs: list[dict]) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a reply. No valid call: (text, [])."""
    names = {f["name"] for f in funcs}
    if HERMES_OPEN in text:
        head, calls = text.split(HERMES_OPEN, 1)[0], []
        for block in text.split(HERMES_OPEN)[1:]:
            c = _call(_json(block.split(HERMES_CLOSE, 1)[0].strip()), names)
            if c is None:
                return text, []
            calls.append(c)
        return (head.strip() or None), calls
    s = text.strip()
    if s.startswith(MISTRAL):
        objs = _json(s[len(MISTRAL):].strip())
        objs = objs if isinstance(objs, list) else [objs]
        calls = [_call(o, names) for o in objs]
        return (None, calls) if calls and all(calls) else (text, [])
    if s.startswith(PYTHON_TAG):
        s = s[len(PYTHON_TAG):].strip()
    if s.startswith("{"):
        whole = _json(s)
        objs = [whole] if whole is not None else [_json(p.strip()) for p in s.split(";") if p.strip()]
        calls = [_call(o, names) for o in objs]
        if calls and all(calls):
            return None, calls
    return text, []


def _could_start_call(s: str) -> bool:
    """Whether a reply beginning with s (left-stripped) may be a whole-reply call (Llama/Mistral)."""
    if not s:
        return False
    if s[0] == "{":
        return True
    return any(m.startswith(s[:len(m)]) for m in (MISTRAL, PYTHON_TAG))


class _CallStream:
    """Tool-call deltas as a reply is generated (OpenAI's streaming shape): a call's id, type and name
    once its name is complete and declared, then its arguments object's text piece by piece, as the model
    writes it (so the pieces join into the call's arguments). Arguments given as a JSON string, or before the
    name, come whole once the call is complete. While no call has begun, `finish` is `parse`'s answer;
    once one has been sent the reply is calls: a later block that is not a valid call is dropped."""

    def __init__(self, forced: str | None, max_calls: int | None):
        self.forced, self.max_calls = forced, max_calls
        self.sent: list[int] = []  # characters of each begun call's arguments already sent
        self.args: list[str] = []  # each call's arguments as sent so far (the pieces joined)
        self.ends: dict[int, _ValueEnd] = {}  # the reply's JSON values, scanned as far as it has grown

    def _scan(self, text: str) -> list[tuple]:
        if self.forced and self.forced != "required":  # the whole reply is the named function's arguments
            i = _skip_ws(text, 0)
            end = _end_of_value(text, i, self.ends)
            return [(i, self.forced, (i, len(text) if end is None else end) if i < len(text) else None, None)]
        return _scan_calls(text, self.ends)[:self.max_calls]

    def deltas(self, text: str, funcs: list[dict]) -> list[dict]:
        names, out = {f["name"] for f in funcs}, []
        for k, (_, name, args, _end) in enumerate(self._scan(text)):
            if k == len(self.sent):  # not begun: begin it once its name is known and its arguments an object
                if name not in names or args is None or text[args[0]] != "{":
                    break
                out.append(dict(_new_call(name, ""), index=k))
                self.sent.append(0)
                self.args.append("")
            piece = self._next_piece(k, text, args)
            if piece:
                out.append({"index": k, "function": {"arguments": piece}})
        return out

    def _next_piece(self, k: int, text: str, args: tuple) -> str:
        raw = text[args[0]:args[1]]
        piece, self.sent[k] = raw[self.sent[k]:], len(raw)
        self.args[k] += piece
        return piece

    def finish(self, text: str, funcs: list[dict]) -> tuple[str | None, list[dict]]:
        """(the reply as content when it holds no call, the remaining deltas)."""
        if not self.sent:
            if self.forced:
                calls = parse_forced(text, self.forced)
                content = None if calls else text  # no call at all (cut short): the text as content
            else:
                content, calls = parse(text, funcs)
            calls = calls[:self.max_calls]
            self.sent = [0] * len(calls)
            self.args = [c["function"]["arguments"] for c in calls]
            return (content if not calls else None), [dict(c, index=k) for k, c in enumerate(calls)]
        names, out = {f["name"] for f in funcs}, []
        for k, (start, name, args, end) in enumerate(self._scan(text)):
            if k < len(self.sent):  # begun: the rest of its arguments (cut short: incomplete, as OpenAI's)
                piece = self._next_piece(k, text, args)
                if piece:
                    out.append({"index": k, "function": {"arguments": piece}})
                continue
            call = _call(_json(text[start:end]), names) if end is not None else None
            if call is None:
                break
            out.append(dict(call, index=k))
            self.sent.append(0)
            self.args.append(call["function"]["arguments"])
        return None, out

    @property
    def made_calls(self) -> bool:
        return bool(self.sent)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """A finished reply's finish_reason: "tool_calls" when it made calls, ended on its own ("stop") and
        every call is whole (its arguments a JSON object); else the engine's ("length": cut by max_tokens,
        the last call's arguments incomplete; "stop" too when a stop string or EOS broke a call's JSON)."""
        if self.sent and engine_reason == "stop" and all(map(whole_arguments, self.args)):
            return "tool_calls"
        return engine_reason


def _skip_ws(s: str, i: int, chars: str = " \t\r\n") -> int:
    while i < len(s) and s[i] in chars:
        i += 1
    return i


def _end_of_string(s: str, i: int) -> int | None:
    """The index after the JSON string starting at s[i] == '"'; None if s ends inside it."""
    i += 1
    while i < len(s):
        if s[i] == "\\":
            i += 2
        elif s[i] == '"':
            return i + 1
        else:
            i += 1
    return None


class _ValueEnd:
    """Where the JSON value starting at s[start] ends, found incrementally: a streamed reply only grows, so
    each call reads only the characters added since the last (a long argument is not rescanned per update).
    Not a validator: json.loads judges the whole value later."""

    def __init__(self, start: int):
        self.i, self.depth, self.in_str, self.esc, self.end, self.literal = start, 0, False, False, None, None

    def scan(self, s: str) -> int | None:
        """The index after the value in s (a prefix of every later s), or None while s ends inside it."""
        i, n = self.i, len(s)
        if self.end is not None or i >= n:
            return self.end
        if self.literal is None:
            self.literal = s[i] not in "\"{["
        while i < n:
            c = s[i]
            i += 1
            if self.literal:
                if c in ",}] \t\r\n":
                    self.end = i - 1
                    break
            elif self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.depth == 0:
                        self.end = i
                        break
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i
                    break
        self.i = i
        return self.end


def _end_of_value(s: str, i: int, ends: dict | None) -> int | None:
    """The index after the JSON value starting at s[i]; None if s ends inside it. ends: the scanners kept
    between updates of one growing reply (start -> _ValueEnd), or None."""
    sc = ends.setdefault(i, _ValueEnd(i)) if ends is not None else _ValueEnd(i)
    return sc.scan(s)


def _scan_call(s: str, i: int, ends: dict | None = None) -> tuple:
    """The call object starting at s[i] == '{', as far as s goes: (i, name, (args start, args stop), end);
    name None until its string is complete, args None until its value begins (stop: the value's end, or
    len(s) while it is open), end None while the object is open (or for good, when it is not JSON)."""
    start, name, args = i, None, None
    i += 1
    while True:
        i = _skip_ws(s, i, " \t\r\n,")
        if i >= len(s) or s[i] != '"':
            return start, name, args, (i + 1 if i < len(s) and s[i] == "}" else None)
        k = _end_of_string(s, i)
        key = _json(s[i:k]) if k else None
        i = _skip_ws(s, k) if k else len(s)
        if i >= len(s) or s[i] != ":":
            return start, name, args, None
        i = _skip_ws(s, i + 1)
        end = _end_of_value(s, i, ends)
        if key in ("arguments", "parameters") and args is None and i < len(s):
            args = (i, len(s) if end is None else end)
        elif key == "name" and end is not None:
            name = _json(s[i:end])
        if end is None:
            return start, name, args, None
        i = end


def _before_partial(text: str, marker: str) -> int:
    """len(text) less a suffix that could be the beginning of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _scan_calls(text: str, ends: dict | None = None) -> list[tuple]:
    """The call objects of a reply in any of `parse`'s formats, the last one possibly still open (ends: as
    for _end_of_value)."""
    out = []
    if HERMES_OPEN in text:
        i = text.find(HERMES_OPEN)
        while i >= 0:
            j = _skip_ws(text, i + len(HERMES_OPEN))
            if j >= len(text) or text[j] != "{":
                break
            close = text.find(HERMES_CLOSE, j)
            out.append(_scan_call(text[:close if close >= 0 else _before_partial(text, HERMES_CLOSE)], j, ends))
            i = text.find(HERMES_OPEN, j)
        return out
    i = _skip_ws(text, 0)
    for marker in (MISTRAL, PYTHON_TAG):
        if text.startswith(marker, i):
            i = _skip_ws(text, i + len(marker))
    if text.startswith("[", i):
        i += 1
    while True:
        i = _skip_ws(text, i, " \t\r\n,;")
        if i >= len(text) or text[i] != "{":
            return out
        out.append(_scan_call(text, i, ends))
        if out[-1][3] is None:
            return out
        i = out[-1][3]


def join_deltas(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas joined into one entry per call index: a call's first delta (id, type, name) with
    every argument piece after it."""
    out: dict[int, dict] = {}
    for d in deltas:
        k = d["index"]
        if k not in out:
            out[k] = dict(d, function=dict(d["function"]))
        else:
            f = out[k]["function"]
            f["arguments"] = f.get("arguments", "") + d["function"].get("arguments", "")
    return [out[k] for k in sorted(out)]


def delta_chunks(deltas: list[dict]) -> list[list[dict]]:
    """One update's tool-call deltas as the `tool_calls` of successive chunks, as OpenAI streams them: a
    chunk holds at most one entry per call, so a call's first delta (id, type, name, `arguments: ""`) comes
    in a chunk of its own before its argument pieces."""
    rounds: list[list[dict]] = []
    seen: dict[int, int] = {}  # call index -> the round of its last entry
    for d in deltas:
        k = d["index"]
        r = seen.get(k, -1) + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(d)
        seen[k] = r
    return rounds


def reply_calls(text: str, funcs: list[dict], forced: str | None, max_calls: int | None,
                engine_reason: str | None) -> tuple[str | None, list[dict], str | None]:
    """(content, tool calls, finish_reason) of a finished reply, unstreamed: exactly what its stream sends
    (the same holder reads the whole text at once), so a streamed call's joined argument pieces equal the
    unstreamed call's arguments (the model's own JSON text) and both say the same finish_reason."""
    holder = ForcedCallHolder(forced, max_calls) if forced else StreamHolder(max_calls)
    content = holder.feed(text)
    deltas = holder.call_deltas(funcs)
    rest, more = holder.finish(funcs)
    calls = [{"id": d["id"], "type": d["type"], "function": d["function"]} for d in join_deltas(deltas + more)]
    content += rest
    if calls:
        return content.strip() or None, calls, holder.calls.finish_reason(engine_reason)
    return content, [], engine_reason


class ForcedCallHolder:
    """StreamHolder's interface for a forced call: nothing is streamed as content, the call(s) as they
    are generated."""

    def __init__(self, forced: str, max_calls: int | None = None):
        self.text, self.calls = "", _CallStream(forced, max_calls)

    def feed(self, delta: str) -> str:
        self.text += delta
        return ""

    def call_deltas(self, funcs: list[dict]) -> list[dict]:
        return self.calls.deltas(self.text, funcs)

    def finish(self, funcs: list[dict]) -> tuple[str, list[dict]]:
        content, deltas = self.calls.finish(self.text, funcs)
        return content or "", deltas


class StreamHolder:
    """Streams content while it cannot be the start of a tool call; holds the rest for `parse`."""

    def __init__(self, max_calls: int | None = None):
        self.text = ""  # everything generated
        self.sent = 0  # characters already sent as content
        self.holding = False  # a call may have started: no more content is streamed
        self.calls = _CallStream(None, max_calls)

    def feed(self, delta: str) -> str:
        """The next content to stream (possibly empty)."""
        self.text += delta
        if self.holding:
            return ""
        if self.sent == 0:
            s = self.text.lstrip()
            if not s:
                return ""
            if _could_start_call(s):
                if s[0] == "{" or any(s.startswith(m) for m in (MISTRAL, PYTHON_TAG)):
                    self.holding = True  # a reply that is a call from its first character
                return ""  # or a prefix of a marker: wait for more
        i = self.text.find(HERMES_OPEN, self.sent)
        if i >= 0:
            self.holding = True
            out = self.text[self.sent:i].rstrip()  # the whitespace before the call waits for finish
            self.sent += len(out)
            return out
        # keep back a suffix that could be the beginning of "<tool_call>", and the whitespace before it
        # (a call's content ends without it, as the unstreamed reply's)
        end = _before_partial(self.text, HERMES_OPEN)
        while end > self.sent and self.text[end - 1].isspace():
            end -= 1
        end = max(self.sent, end)
        out, self.sent = self.text[self.sent:end], end
        return out

    def call_deltas(self, funcs: list[dict]) -> list[dict]:
        """The tool-call deltas (OpenAI's shape, with index) generated since the last call."""
        return self.calls.deltas(self.text, funcs) if self.holding else []

    def finish(self, funcs: list[dict]) -> tuple[str, list[dict]]:
        """(content not yet streamed, the last tool-call deltas) once the reply is complete."""
        if self.holding:
            _, deltas = self.calls.finish(self.text, funcs)
            if self.calls.made_calls:
                i = self.text.find(HERMES_OPEN)
                rest = self.text[self.sent:i].rstrip() if i >= self.sent else ""
                self.sent = len(self.text)
                return rest, deltas
        rest, self.sent = self.text[self.sent:], len(self.text)
        return rest, []
