"""Structured output requests -> engine.structured.StructuredOutput.

* `response_format` (OpenAI): {"type": "text"} (nothing), {"type": "json_object"} (any JSON object),
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
* `structured_outputs` (vLLM's extension, chat and completions): exactly one of "json" (a schema),
  "json_object", "regex", "choice", "grammar" (Lark);
* forced tool calls (chat `tool_choice` "required" or {"type": "function", "function": {"name"}}): the
  reply is constrained to the JSON of the call(s) and returned as `tool_calls` (server/tools.py).

Shapes are checked here and the grammar is compiled once, off the event loop (`compiled`): an
invalid schema, regex or grammar is a 400 naming the field it came from.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jaxserve.engine.structured import StructuredOutput, StructuredOutputError
from jaxserve.server.errors import bad_request

_SO_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}


def _spec(param: str, **kw) -> StructuredOutput:
    try:
        return StructuredOutput(**kw)
    except StructuredOutputError as e:
        raise bad_request(str(e), param) from None


def from_response_format(rf: Any) -> StructuredOutput | None:
    param = "response_format"
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request("response_format must be an object with a \"type\"", param)
    kind = rf["type"]
    extra = set(rf) - {"type", "json_schema"}
    if extra or ("json_schema" in rf and kind != "json_schema"):
        raise bad_request(f"response_format has unknown fields {sorted(extra or {'json_schema'})}", param)
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec(param, json_object=True)
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}",
                          f"{param}.type")
    js = rf.get("json_schema")
    where = f"{param}.json_schema"
    if not isinstance(js, dict):
        raise bad_request("response_format.json_schema must be an object {\"name\", \"schema\", ...}", where)
    extra = set(js) - {"name", "schema", "strict", "description"}
    if extra:
        raise bad_request(f"{where} has unknown fields {sorted(extra)}", where)
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
    schema = js.get("schema", {})  # OpenAI: optional; an empty schema allows any JSON value
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.schema must be a JSON schema object", f"{where}.schema")
    return _spec(f"{where}.schema", json_schema=schema)


def from_structured_outputs(so: Any) -> StructuredOutput | None:
    param = "structured_outputs"
    if so is None:
        return None
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object with one of "
                          f"{', '.join(sorted(_SO_KEYS))}", param)
    extra = set(so) - set(_SO_KEYS)
    if extra:
        raise bad_request(f"structured_outputs has unsupported fields {sorted(extra)} (supported: "
                          f"{', '.join(sorted(_SO_KEYS))})", param)
    kw = {_SO_KEYS[k]: v for k, v in so.items() if v not in (None, False)}
    for k in ("regex", "grammar"):
        if k in kw and not isinstance(kw[k], str):
            raise bad_request(f"structured_outputs.{k} must be a string", f"{param}.{k}")
    if "choice" in kw and not isinstance(kw["choice"], list):
        raise bad_request("structured_outputs.choice must be a list of strings", f"{param}.choice")
    if "json_object" in kw and kw["json_object"] is not True:
        raise bad_request("structured_outputs.json_object must be a boolean", f"{param}.json_object")
    return _spec(param, **kw)


def _hoist_defs(params: dict, prefix: str, defs: dict, depth: int = 0):
    """params without its $defs/definitions, which move into `defs` under prefix-qualified names, and
    with its "#/$defs/..." references rewritten: one function's parameters nested inside the combined
    "required" schema keep resolving their references (Pydantic-made tools use them for nested models)."""
    if depth == 0:
        params = dict(params)
        for key in ("$defs", "definitions"):
            for name, d in (params.pop(key, None) or {}).items():
                defs[f"{prefix}{name}"] = _hoist_defs(d, prefix, defs, 1)
    if isinstance(params, dict):
        out = {k: _hoist_defs(v, prefix, defs, depth + 1) for k, v in params.items()}
        ref = out.get("$ref")
        if isinstance(ref, str):
            for key in ("$defs", "definitions"):
                if ref.startswith(f"#/{key}/"):
                    out["$ref"] = f"#/$defs/{prefix}{ref[len(key) + 3:]}"
        return out
    if isinstance(params, list):
        return [_hoist_defs(v, prefix, defs, depth + 1) for v in params]
    return params


def _arguments_schema(params: dict) -> dict:
    """A function's parameters as the schema of its arguments: always a JSON object."""
    return params if params.get("type") == "object" else {**params, "type": "object"}


def forced_tool_spec(funcs: list[dict], forced: str, one_call: bool) -> StructuredOutput:
    """The JSON a forced call must be: a named function's arguments object, or for "required" a list
    of {"name", "arguments"} calls of the declared functions (one at most when one_call)."""
    if forced != "required":
        params = next(f["parameters"] for f in funcs if f["name"] == forced)
        return _spec("tool_choice", json_schema=_arguments_schema(params))
    defs: dict = {}
    call = []
    for i, f in enumerate(funcs):
        args = _hoist_defs(_arguments_schema(f["parameters"]), f"f{i}_", defs)
        call.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": args},
                     "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if one_call:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return _spec("tool_choice", json_schema=schema)


def pick(*specs: tuple[str, StructuredOutput | None]) -> tuple[str, StructuredOutput] | None:
    """The request's one source of structure as (field, spec); two are a 400."""
    given = [(name, s) for name, s in specs if s is not None]
    if len(given) > 1:
        raise bad_request(f"{given[0][0]} and {given[1][0]} cannot be combined: both constrain the output",
                          given[1][0])
    return given[0] if given else None


async def compiled(state, picked: tuple[str, StructuredOutput] | None) -> StructuredOutput | None:
    """Compile the grammar once, off the event loop (a large enum takes ~0.3 s; the engine reuses the
    compiled grammar): an invalid schema, regex or grammar is a 400 naming the field it came from."""
    if picked is None:
        return None
    name, spec = picked
    try:
        await asyncio.get_running_loop().run_in_executor(None, state.engine.grammar_compiler.matcher, spec)
    except StructuredOutputError as e:
        raise bad_request(str(e), name) from None
    return spec
