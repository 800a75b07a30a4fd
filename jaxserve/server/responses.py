"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A request is translated into a chat request (server/chat.py does the rest: template, tools, structured
output, reasoning split): `instructions` and `input` (a string, or items: messages with input_text /
input_image / output_text parts, function_call and function_call_output items) become chat messages,
function tools ({"type": "function", "name", "parameters"}) and tool_choice take chat's shape, and
`text.format` becomes response_format. The reply comes back as output items (reasoning, message with
output_text, function_call) with the Responses usage; streamed as OpenAI's named events
(response.created ... response.output_text.delta ... response.completed). With `store` (the default, as
OpenAI's) the conversation is kept in memory (the last MAX_STORED responses, MAX_STORED_BYTES of JSON at
most), so `previous_response_id` continues it, GET returns it and GET .../input_items lists its input.
`background: true` stores the response "queued" and answers at once (or streams events kept for replays); a
task fills it in (POST .../cancel stops it).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import uuid
from typing import Any

from aiohttp import web
from pydantic import PrivateAttr

from jaxserve.server import conversations, tools
from jaxserve.server.chat import ChatRun, start_chat
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.generation import chat_logprobs
from jaxserve.server.protocol import ChatCompletionRequest, _Req, parse_request
from jaxserve.server.state import evict_oldest
from jaxserve.server.streaming import SSEWriter, failed

log = logging.getLogger("jaxserve.server")

MAX_STORED = 1000
MAX_STORED_BYTES = 64 * 2**20  # images as data: URLs make entries large: the oldest go first past this


class ResponsesRequest(_Req):
    _items: list | None = PrivateAttr(default=None)  # input_items(), made once: the ids stay the same
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing is obfuscated
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # effort/summary: the model thinks as its template says
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    # accepted and ignored, as on the chat endpoint
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    # vLLM's sampling extensions
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    structured_outputs: Any = None  # vLLM's {"json" | "regex" | "choice" | "grammar": ...}
    background: bool | None = None  # run detached: the reply is polled with GET (or streamed and replayed)
    conversation: Any = None  # a conversation id or {"id": ...} (server/conversations.py)
    # not implemented: refused when set
    prompt: Any = None


# chat request fields (errors from server/chat.py) -> the Responses fields they came from
_CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
                "logprobs": "include", "top_logprobs": "top_logprobs"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------------------ request
def _part(p: Any, where: str, role: str) -> dict:
    if not isinstance(p, dict):
        raise bad_request(f"{where} must be a content part object", where)
    kind = p.get("type")
    if kind in ("input_text", "output_text", "text"):
        if not isinstance(p.get("text"), str):
            raise bad_request(f"{where}.text must be a string", f"{where}.text")
        return {"type": "text", "text": p["text"]}
    if kind == "input_image" and role == "user":
        url = p.get("image_url")
        if not isinstance(url, str) or not url:
            raise bad_request(f"{where}: an input_image needs an image_url (a data: or http(s) URL; file_id "
                              "is not supported)", f"{where}.image_url")
        return {"type": "image_url", "image_url": {"url": url}}
    raise bad_request(f"{where}: content parts of type {kind!r} are not supported here (input_text, "
                      "input_image in user messages, output_text)", f"{where}.type")


def _messages(items: str | list, where: str = "input") -> list[dict]:
    """Responses input -> chat messages (function calls grouped into one assistant message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    ids: set[str] = set()
    for i, it in enumerate(items):
        w = f"{where}[{i}]"
        kind = it.get("type", "message")
        if it.get("id") is not None:  # echoed by GET .../input_items, paged by id
            if not isinstance(it["id"], str):
                raise bad_request(f"{w}.id must be a string", f"{w}.id")
            if it["id"] in ids:
                raise bad_request(f"Duplicate item found with id {it['id']}", f"{w}.id")
            ids.add(it["id"])
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{w}.role must be user, assistant, system or developer", f"{w}.role")
            content = it.get("content")
            if isinstance(content, list):
                content = [_part(p, f"{w}.content[{j}]", role) for j, p in enumerate(content)]
                if all(p["type"] == "text" for p in content):
                    content = "".join(p["text"] for p in content)
            elif not isinstance(content, str):
                raise bad_request(f"{w}.content must be a string or a list of content parts", f"{w}.content")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(it.get(k), str):
                    raise bad_request(f"{w}.{k} must be a string", f"{w}.{k}")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = it.get("output")
            if isinstance(output, list):  # content parts: their text (a non-string text: refused below, not joined)
                texts = [p.get("text", "") for p in output if isinstance(p, dict)]
                output = "".join(texts) if all(isinstance(t, str) for t in texts) else None
            if not isinstance(it.get("call_id"), str) or not isinstance(output, str):
                raise bad_request(f"{w} needs call_id and output strings", w)
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": output})
        elif kind == "reasoning":
            summary = it.get("summary")
            if summary is not None and not (isinstance(summary, list) and all(
                    isinstance(p, dict) and p.get("type") == "summary_text" and isinstance(p.get("text"), str)
                    for p in summary)):
                raise bad_request(f"{w}.summary must be a list of summary_text parts", f"{w}.summary")
            continue  # earlier thinking is not shown to the model again (as chat templates drop it)
        else:
            raise bad_request(f"{w}: input items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output, reasoning)", f"{w}.type")
    return out


def _input_items(items: str | list) -> list[dict]:
    """The request's input as the API's item objects (what GET .../input_items lists), each with an id: user,
    system and developer messages with input parts, assistant messages with output_text parts, function calls
    and their outputs, reasoning items. Called after _messages accepted the input."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for it in items:
        kind = it.get("type", "message")
        if kind == "message":
            role, content = it["role"], it["content"]
            if isinstance(content, str):
                content = [{"type": "input_text", "text": content}]
            parts = []
            for p in content:
                if p["type"] == "input_image":
                    parts.append({"type": "input_image", "image_url": p["image_url"], "detail": p.get("detail", "auto")})
                elif role == "assistant":
                    parts.append({"type": "output_text", "text": p["text"], "annotations": []})
                else:
                    parts.append({"type": "input_text", "text": p["text"]})
            out.append({"id": it.get("id") or _id("msg"), "type": "message", "role": role, "content": parts,
                        "status": "completed"})
        elif kind == "function_call":
            out.append({"id": it.get("id") or _id("fc"), "type": "function_call", "call_id": it["call_id"],
                        "name": it["name"], "arguments": it["arguments"], "status": "completed"})
        elif kind == "function_call_output":
            out.append({"id": it.get("id") or _id("fco"), "type": "function_call_output", "call_id": it["call_id"],
                        "output": it["output"], "status": "completed"})
        else:  # reasoning
            out.append({"id": it.get("id") or _id("rs"), "type": "reasoning", "summary": it.get("summary") or []})
    return out


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as item objects, made once per request so that every copy (the stored response's
    input_items, its conversation) has the same ids."""
    if req._items is None:
        req._items = _input_items(req.input)
    return req._items


def _tools(tools: list | None) -> list | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise bad_request(f"tools[{i}]: tools of type {t.get('type')!r} are not supported (function tools only)",
                              f"tools[{i}].type")
        unknown = set(t) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise bad_request(f"tools[{i}] has unknown fields {sorted(unknown)}", f"tools[{i}]")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                      if t.get(k) is not None}})
    return out


def _tool_choice(tc: Any) -> Any:
    if isinstance(tc, dict):
        if tc.get("type") != "function" or set(tc) - {"type", "name"} or not isinstance(tc.get("name"), str):
            raise bad_request("a named tool_choice must be {\"type\": \"function\", \"name\": ...}", "tool_choice")
        return {"type": "function", "function": {"name": tc["name"]}}
    return tc


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object like {\"type\": \"json_schema\", ...}", "text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise bad_request(f"text.format type {fmt.get('type')!r} is not supported (text, json_object, json_schema)",
                      "text.format")


def _chat_request(state, req: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request of a Responses request, and the conversation so far (for the store)."""
    if req.prompt is not None:
        raise bad_request("'prompt' is not supported by this server", "prompt", "unsupported_parameter")
    if req.background:
        if req.store is False:
            raise bad_request("background responses must be stored: 'store' cannot be false", "store")

    if req.truncation not in (None, "disabled", "auto"):
        raise bad_request("truncation must be \"auto\" or \"disabled\"", "truncation")
    history: list[dict] = []
    cid = conversations.conversation_id(req.conversation)
    if cid is not None:
        if req.previous_response_id is not None:
            raise bad_request("conversation and previous_response_id cannot both be set", "conversation")
        history = conversations.history(state, cid, req.input)
    if req.previous_response_id is not None:
        prev = _store(state).get(req.previous_response_id)
        if prev is None:
            raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                           "previous_response_id", "previous_response_not_found")
        if prev["response"]["status"] not in ("completed", "incomplete"):
            raise bad_request(f"previous response '{req.previous_response_id}' is {prev['response']['status']}: "
                              "only a finished response can be continued", "previous_response_id")
        history = list(prev["conversation"])
    convo = history + _messages(req.input)
    msgs = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + convo
    want_lp = "message.output_text.logprobs" in (req.include or [])
    body = {"model": req.model, "messages": msgs, "stream": bool(req.stream),
            "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
            "seed": req.seed, "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
            "structured_outputs": req.structured_outputs,
            "logprobs": True if want_lp else None, "top_logprobs": req.top_logprobs if want_lp else None}
    body = {k: v for k, v in body.items() if v is not None}
    return parse_request(ChatCompletionRequest, body), convo


def _store(state) -> collections.OrderedDict:
    return state.responses


# ----------------------------------------------------------------------------------------- response
def _envelope(req: ResponsesRequest, rid: str, created: int, model: str) -> dict:
    """The response object's fields that do not depend on the reply."""
    return {"id": rid, "object": "response", "created_at": created, "status": "in_progress", "error": None,
            "incomplete_details": None, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": model, "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store is not False, "temperature": req.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "top_p": req.top_p, "truncation": req.truncation or "disabled", "usage": None, "user": req.user,
            "metadata": req.metadata or {}, "background": bool(req.background),
            "conversation": {"id": conversations.conversation_id(req.conversation)} if req.conversation else None}


def _usage(gen) -> dict:
    u = gen.usage()
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def _reasoning_item(iid: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": iid, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(iid: str, text: str, status: str, logprobs: list) -> dict:
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _call_item(iid: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": iid, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _call_status(arguments: str, finish_reason: str | None) -> str:
    """A function_call item's status: "incomplete" when max_output_tokens cut its arguments short."""
    return "incomplete" if finish_reason == "length" and not tools.whole_arguments(arguments) else "completed"


def _responses_logprobs(entries: list[dict]) -> list[dict]:
    """Chat's logprob entries in the Responses shape (no bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}
                              for t in e["top_logprobs"]]} for e in entries]


def _finish(resp: dict, finish_reason: str | None, usage: dict) -> dict:
    incomplete = finish_reason == "length"
    return dict(resp, status="incomplete" if incomplete else "completed", usage=usage,
                incomplete_details={"reason": "max_output_tokens"} if incomplete else None)


def _remember(state, req: ResponsesRequest, resp: dict, convo: list[dict], content, calls) -> None:
    """A finished response: stored (unless store is false) and added to its conversation."""
    old = _store(state).get(resp["id"])
    if old is not None and old["response"]["status"] == "cancelled":  # a cancelled background response
        return
    if req.conversation is not None:
        conversations.append(state, conversations.conversation_id(req.conversation), input_items(req),
                             resp["output"])
    if req.store is False:
        return
    reply = {"role": "assistant", "content": content}
    if calls:
        reply["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    st = _store(state)
    entry = {"response": resp, "conversation": convo + [reply], "input_items": input_items(req)}
    entry["bytes"] = len(json.dumps(entry))
    if old is not None:  # a background response: its queued entry is filled in where it stands
        old.update(entry)
        entry = old
    st[resp["id"]] = entry
    evict_oldest(st, MAX_STORED, MAX_STORED_BYTES)


async def create_response(request: web.Request, state, body) -> web.StreamResponse:
    req = parse_request(ResponsesRequest, body)
    try:
        chat_req, convo = _chat_request(state, req)
        run = await start_chat(state, chat_req, id_prefix="resp")
    except APIError as e:  # the chat request's field names, in this API's terms
        if e.param:
            head = e.param.split("[", 1)[0].split(".", 1)[0]
            e.param = _CHAT_PARAMS.get(head, e.param)
        raise
    resp = _envelope(req, "resp_" + run.gen.id.split("-", 1)[1], run.gen.created, run.model)
    if req.background:
        queued = _start_background(state, req, run, resp, convo)
        if req.stream:
            return await _replay(request, _store(state)[resp["id"]], -1)
        return web.json_response(queued)
    if req.stream:
        return await _stream(request, state, req, run, resp, convo)
    await run.gen.run()
    return web.json_response(_completed(state, req, run, resp, convo))


def _completed(state, req: ResponsesRequest, run: ChatRun, resp: dict, convo: list[dict]) -> dict:
    """The response object of a finished generation (stored unless store is false)."""
    gen = run.gen
    (c,) = gen.choices
    thought, content, calls, finish = run.reply(c)
    status = "incomplete" if finish == "length" else "completed"
    lps = _responses_logprobs(chat_logprobs(state, c.token_ids, c.logprobs)) if gen.params.logprobs is not None else []
    output = [_reasoning_item(_id("rs"), thought, status)] if thought else []
    if content is not None or not calls:
        output.append(_message_item(_id("msg"), content or "", status, lps))
    out_calls = [_call_item(_id("fc"), k["id"], k["function"]["name"], k["function"]["arguments"],
                            _call_status(k["function"]["arguments"], finish)) for k in calls]
    resp = _finish(dict(resp, output=output + out_calls), finish, _usage(gen))
    _remember(state, req, resp, convo, content, out_calls)
    return resp


# ---------------------------------------------------------------------------------------- background
def _start_background(state, req: ResponsesRequest, run: ChatRun, resp: dict, convo: list[dict]) -> dict:
    """background: true. The request is already admitted (errors were 4xx above); it is stored as "queued",
    turns "in_progress" at its first token and is replaced by the finished response (or "failed" with its
    error, or "cancelled"). The task is held in the store's entry until it ends. With stream, its events
    are kept in the entry for _replay (the POST's own stream and GET ...?stream=true)."""
    queued = dict(resp, status="queued")
    st = _store(state)
    entry = {"response": queued, "conversation": convo, "input_items": input_items(req), "bytes": 0}
    if req.stream:
        entry.update(events=[], events_done=False, wake=asyncio.Event())
    st[resp["id"]] = entry

    def fail(message: str, code: str | None) -> None:
        # the Responses API's error codes are a fixed set: ours (internal_error, ...) report as server_error
        code = code if code in ("rate_limit_exceeded", "invalid_prompt") else "server_error"
        entry["response"] = dict(entry["response"], status="failed", output=[],
                                 error={"code": code, "message": message})
        if req.stream:  # the stream's last event (the openai client's stream helper waits for one)
            _publish(entry, [{"type": "response.failed", "sequence_number": len(entry["events"]),
                              "response": entry["response"]}])

    async def on_updates(_updates) -> None:
        if entry["response"]["status"] == "queued":
            entry["response"] = dict(entry["response"], status="in_progress")

    async def emit(evs: list[dict]) -> None:
        if any(e["type"] == "response.in_progress" for e in evs):
            await on_updates(evs)
        _publish(entry, evs)

    async def work() -> None:
        try:
            if req.stream:
                if not await _produce(state, req, run, resp, convo, emit, queued=True):
                    err = entry["events"][-1]
                    fail(err["message"], err["code"])
            else:
                await run.gen.run(on_updates)
            if any(c.finish_reason == "abort" for c in run.gen.choices):
                raise APIError(500, "the generation was aborted (request timeout or server shutdown)")
            if not req.stream:
                _completed(state, req, run, resp, convo)
        except asyncio.CancelledError:  # POST .../cancel: the generation was aborted as the task ended
            pass
        except APIError as e:
            fail(e.message, e.code)
        except Exception as e:  # noqa: BLE001 - reported in the stored response, never lost
            log.exception("background response %s failed", resp["id"])
            fail(f"{type(e).__name__}: {e}", None)
        finally:
            entry.pop("task", None)
            if req.stream:
                _publish(entry, done=True)
                entry["bytes"] += len(json.dumps(entry["events"]))  # kept for replays: counted in the store

    entry["task"] = task = asyncio.get_running_loop().create_task(work())
    state.background_tasks.add(task)  # the loop keeps only a weak reference
    task.add_done_callback(state.background_tasks.discard)
    evict_oldest(st, MAX_STORED, MAX_STORED_BYTES)
    return queued


def _publish(entry: dict, evs=(), done: bool = False) -> None:
    """Add a streamed background response's events and wake its readers."""
    entry["events"].extend(evs)
    entry["events_done"] |= done
    wake, entry["wake"] = entry["wake"], asyncio.Event()
    wake.set()


async def cancel_response(request: web.Request, state) -> web.Response:
    """POST /v1/responses/{id}/cancel: a background response still queued or running stops ("cancelled",
    its output dropped); cancelling one already cancelled returns it again."""
    rid = request.match_info["response_id"]
    entry = _store(state).get(rid)
    if entry is None:
        raise APIError(404, f"Response with id '{rid}' not found.", "response_id", "not_found")
    resp = entry["response"]
    if not resp.get("background"):
        raise bad_request("only responses created with background: true can be cancelled", "response_id")
    task = entry.get("task")
    if task is not None:
        task.cancel()  # Generation.run's finally aborts the engine request and frees its blocks
        entry["response"] = resp = dict(resp, status="cancelled")
        entry.pop("task", None)
    elif resp["status"] != "cancelled":
        raise bad_request(f"cannot cancel a response that is {resp['status']}", "response_id")
    return web.json_response(resp)


async def get_response(request: web.Request, state) -> web.StreamResponse:
    """GET /v1/responses/{id}; with ?stream=true (a streamed background response) its events again, those
    after ?starting_after=N (a sequence_number) only."""
    rid = request.match_info["response_id"]
    entry = _store(state).get(rid)
    if entry is None:
        raise APIError(404, f"Response with id '{rid}' not found.", "response_id", "not_found")
    q = request.query
    if q.get("stream", "false").lower() not in ("false", "0"):
        if "events" not in entry:
            raise bad_request("only a response created with background and stream true can be streamed again",
                              "stream")
        try:
            after = int(q.get("starting_after", -1))
        except ValueError:
            raise bad_request("starting_after must be an integer (an event's sequence_number)",
                              "starting_after") from None
        return await _replay(request, entry, after)
    return web.json_response(entry["response"])


async def list_input_items(request: web.Request, state) -> web.Response:
    """GET /v1/responses/{id}/input_items: the response's input items, paged (item_page)."""
    rid = request.match_info["response_id"]
    entry = _store(state).get(rid)
    if entry is None:
        raise APIError(404, f"Response with id '{rid}' not found.", "response_id", "not_found")
    return web.json_response(item_page(entry["input_items"], request.query))


def item_page(all_items: list[dict], q) -> dict:
    """A page of items as the API lists them (a response's input items, a conversation's items): `order`
    desc (default) or asc, `limit` 1-100 (20), `after` an item id (the page after it)."""
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be \"asc\" or \"desc\"", "order")
    try:
        limit = int(q.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise bad_request("limit must be an integer from 1 to 100", "limit")
    items = all_items[::-1] if order == "desc" else list(all_items)
    if "after" in q:
        ids = [it["id"] for it in items]
        if q["after"] not in ids:
            raise bad_request(f"no item with id '{q['after']}' here", "after")
        items = items[ids.index(q["after"]) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


async def delete_response(request: web.Request, state) -> web.Response:
    rid = request.match_info["response_id"]
    entry = _store(state).pop(rid, None)
    if entry is None:
        raise APIError(404, f"Response with id '{rid}' not found.", "response_id", "not_found")
    if entry.get("task") is not None:  # a background response still running: stopped, not stored again
        entry["response"] = dict(entry["response"], status="cancelled")
        entry.pop("task").cancel()
    return web.json_response({"id": rid, "object": "response", "deleted": True})


# ---------------------------------------------------------------------------------------- streaming
class _EventStream:
    """The Responses events of one streamed reply: items opened as their first piece arrives and closed in
    order (a reasoning item, a message, function calls)."""

    def __init__(self, resp: dict):
        self.resp, self.seq, self.output = resp, 0, []
        self.open: dict | None = None  # the item being written: {"kind", "index", "item", "text"}
        self.calls: dict[int, dict] = {}  # tool-call index -> its open item

    def event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _open(self, kind: str, item: dict) -> list[dict]:
        evs = self._close()
        self.open = {"kind": kind, "index": len(self.output), "item": item, "text": "", "logprobs": []}
        self.output.append(item)
        evs.append(self.event("response.output_item.added", output_index=self.open["index"], item=item))
        if kind == "message":
            evs.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.open["index"],
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}))
        return evs

    def _close(self, status: str = "completed") -> list[dict]:
        o, self.open = self.open, None
        if o is None:
            return []
        i, iid, text = o["index"], o["item"]["id"], o["text"]
        if o["kind"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": o["logprobs"]}
            item = _message_item(iid, text, status, o["logprobs"])
            evs = [self.event("response.output_text.done", item_id=iid, output_index=i, content_index=0, text=text,
                              logprobs=o["logprobs"]),
                   self.event("response.content_part.done", item_id=iid, output_index=i, content_index=0, part=part)]
        else:
            item = _reasoning_item(iid, text, status)
            evs = [self.event("response.reasoning_text.done", item_id=iid, output_index=i, content_index=0, text=text)]
        self.output[i] = item
        return evs + [self.event("response.output_item.done", output_index=i, item=item)]

    def text(self, kind: str, piece: str, logprobs: list) -> list[dict]:
        evs = []
        if self.open is None or self.open["kind"] != kind:
            evs += self._open(kind, _message_item(_id("msg"), "", "in_progress", []) if kind == "message"
                              else _reasoning_item(_id("rs"), "", "in_progress"))
        o = self.open
        o["text"] += piece
        iid, i = o["item"]["id"], o["index"]
        if kind == "message":
            o["logprobs"] += logprobs
            return evs + [self.event("response.output_text.delta", item_id=iid, output_index=i, content_index=0,
                                     delta=piece, logprobs=logprobs)]
        return evs + [self.event("response.reasoning_text.delta", item_id=iid, output_index=i, content_index=0,
                                 delta=piece)]

    def call(self, d: dict) -> list[dict]:
        evs = []
        k = d["index"]
        if k not in self.calls:
            evs += self._close()
            item = _call_item(_id("fc"), d["id"], d["function"]["name"], "", "in_progress")
            self.calls[k] = {"index": len(self.output), "item": item}
            self.output.append(item)
            evs.append(self.event("response.output_item.added", output_index=self.calls[k]["index"], item=item))
        c = self.calls[k]
        piece = d["function"].get("arguments") or ""
        if piece:
            c["item"]["arguments"] += piece
            evs.append(self.event("response.function_call_arguments.delta", item_id=c["item"]["id"],
                                  output_index=c["index"], delta=piece))
        return evs

    def finish(self, finish_reason: str | None, usage: dict) -> tuple[list[dict], dict]:
        status = "incomplete" if finish_reason == "length" else "completed"
        evs = self._close(status)
        if not self.output:  # nothing was generated: an empty message, as a non-streamed reply has
            evs += self._open("message", _message_item(_id("msg"), "", "in_progress", [])) + self._close(status)
        for c in self.calls.values():
            item = dict(c["item"], status=_call_status(c["item"]["arguments"], finish_reason))
            self.output[c["index"]] = item
            evs += [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=c["index"],
                               arguments=item["arguments"], name=item["name"]),
                    self.event("response.output_item.done", output_index=c["index"], item=item)]
        resp = _finish(dict(self.resp, output=list(self.output)), finish_reason, usage)
        evs.append(self.event("response.incomplete" if status == "incomplete" else "response.completed",
                              response=resp))
        return evs, resp


async def _produce(state, req: ResponsesRequest, run: ChatRun, resp: dict, convo: list, emit,
                   queued: bool = False) -> bool:
    """Run the generation, handing its Responses events to `emit` (awaited per engine step); the finished
    response is stored (unless store is false). queued: the first event shows the response "queued" and
    "in_progress" follows at the first token (a background response). False when it ended in an error
    event."""
    gen = run.gen
    want_lp = gen.params.logprobs is not None
    es = _EventStream(resp)
    reply = run.streamer()
    final: dict = {}
    started = not queued

    async def on_updates(updates) -> None:
        nonlocal started
        evs = [] if started else [es.event("response.in_progress", response=resp)]
        started = True
        for u in updates:
            lp = _responses_logprobs(chat_logprobs(state, u.token_ids, u.logprobs)) if want_lp and u.token_ids else []
            text, thought, calls, fin = reply.feed(u.text or "", u.finished, u.choice.finish_reason)
            if thought:
                evs += es.text("reasoning", thought, [])
            if text or (lp and not calls):
                evs += es.text("message", text, lp)
            for d in calls:
                evs += es.call(d)
            if u.finished:
                done, final["resp"] = es.finish(fin, _usage(gen))
                evs += done
        await emit(evs)

    first = [es.event("response.created", response=dict(resp, status="queued") if queued else resp)]
    await emit(first if queued else first + [es.event("response.in_progress", response=resp)])
    try:
        await gen.run(on_updates)
    except APIError as e:
        body = e.body()["error"]
        await emit([es.event("error", code=body.get("code"), message=body["message"], param=body.get("param"))])
        return False
    if "resp" in final:
        out = final["resp"]["output"]
        calls = [o for o in out if o["type"] == "function_call"]
        msg = next((o for o in out if o["type"] == "message"), None)
        content = msg["content"][0]["text"] if msg is not None else None
        _remember(state, req, final["resp"], convo, content, calls)
    return True


async def _stream(request, state, req: ResponsesRequest, run: ChatRun, resp: dict, convo: list) -> web.StreamResponse:
    w = SSEWriter(request)
    try:
        await w.start()
        await _produce(state, req, run, resp, convo, w.send_events)
        return await w.finish(done=False)
    except Exception as e:
        return failed(w, e, f"responses stream {run.gen.id}")


async def _replay(request, entry: dict, after: int) -> web.StreamResponse:
    """A streamed background response's events with sequence_number > after: those already made, then the
    rest as they come, until the response ends (or is cancelled). The generation does not depend on
    this connection: a client that drops it can come back with GET ...?stream=true&starting_after=N."""
    w = SSEWriter(request)
    try:
        await w.start()
        events = entry["events"]
        pos = max(after + 1, 0)
        while True:
            # read together, with no await between: an event published after this wakes `wake`
            batch, ended, wake = events[pos:], entry["events_done"], entry["wake"]
            pos += len(batch)
            await w.send_events(batch)
            if ended and pos >= len(events):
                return await w.finish(done=False)
            if not batch:
                await wake.wait()
    except Exception as e:
        return failed(w, e, f"background responses stream {entry['response']['id']}")
