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
anything else stays text. In a stream, text that may begin a call is held back until it is known
(`StreamHolder`), so a client sees either content deltas or tool-call deltas, never the raw markup.
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


class ForcedCallHolder:
    """StreamHolder's interface for a forced call: nothing is streamed as content, the calls come at
    the end."""

    def __init__(self, forced: str):
        self.forced, self.text = forced, ""

    def feed(self, delta: str) -> str:
        self.text += delta
        return ""

    def finish(self, funcs: list[dict]) -> tuple[str, list[dict]]:
        calls = parse_forced(self.text, self.forced)
        return ("" if calls else self.text), calls  # no call at all (cut short): the text as content


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


class StreamHolder:
    """Streams content while it cannot be the start of a tool call; holds the rest for `parse`."""

    def __init__(self):
        self.text = ""  # everything generated
        self.sent = 0  # characters already sent as content
        self.holding = False  # a call may have started: nothing more is streamed

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
            out, self.sent = self.text[self.sent:i], i
            return out
        # keep back a suffix that could be the beginning of "<tool_call>"
        end = len(self.text)
        for k in range(min(len(HERMES_OPEN) - 1, end - self.sent), 0, -1):
            if HERMES_OPEN.startswith(self.text[end - k:]):
                end -= k
                break
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self, funcs: list[dict]) -> tuple[str, list[dict]]:
        """(content not yet streamed, tool calls) once the reply is complete."""
        if self.holding:
            _, calls = parse(self.text, funcs)
            if calls:
                i = self.text.find(HERMES_OPEN)
                rest = self.text[self.sent:i] if i >= self.sent else ""
                self.sent = len(self.text)
                return rest, calls
        rest, self.sent = self.text[self.sent:], len(self.text)
        return rest, []
