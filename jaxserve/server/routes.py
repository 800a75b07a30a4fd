"""Route table and the small endpoints: models, health, metrics, tokenize, detokenize.

Every route exists with and without the `/v1` prefix, as vLLM and llama.cpp serve them.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from aiohttp import web

from jaxserve.server.chat import chat_completions
from jaxserve.server.completions import completions
from jaxserve.server import conversations as conv
from jaxserve.server.embeddings import classify, embeddings, rerank, score
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import (DetokenizeRequest, ModelCard, ModelList, TokenizeRequest, dump,
                                      parse_request)
from jaxserve.server.images import chat_prompt
from jaxserve.server.lora import list_lora_adapters, load_lora_adapter, set_lora_adapters, unload_lora_adapter
from jaxserve.server.responses import (cancel_response, create_response, delete_response, get_response,
                                       list_input_items)
from jaxserve.server.sampling import check_ids

STATE = web.AppKey("jaxserve_state", object)
MAX_BODY = web.AppKey("jaxserve_max_body", int)  # bytes (JAXSERVE_MAX_BODY_MB)
BODY_TIMEOUT = web.AppKey("jaxserve_body_timeout", float)  # seconds (JAXSERVE_BODY_TIMEOUT)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


# a \ud800-\udfff escape: JSON lets one stand alone, and json.loads turns it into a lone surrogate
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _lone_surrogate(body) -> tuple[bool, str | None]:
    """(found, where) of the first string or key holding a lone UTF-16 surrogate (iterative: the body
    may be nested as deep as json.loads allows)."""
    stack = [(body, None)]
    while stack:
        x, where = stack.pop()
        if isinstance(x, str):
            if not _is_text(x):
                return True, where
        elif isinstance(x, dict):
            for k, v in reversed(list(x.items())):
                if not _is_text(k):
                    return True, where
                stack.append((v, k if where is None else f"{where}.{k}"))
        elif isinstance(x, list):
            stack += [(v, f"{where or ''}[{i}]") for i, v in reversed(list(enumerate(x)))]
    return False, None


async def read_json(request: web.Request):
    """The decoded body; 400 for anything that is not JSON (413 comes from aiohttp's size limit)."""
    limit = request.app[MAX_BODY]
    if request.content_length is not None and request.content_length > limit:
        # refuse before reading: no point in receiving megabytes we will throw away
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    try:
        # a client that stalls mid-body would otherwise hold its connection (and this task) for good
        limit_s = request.app[BODY_TIMEOUT]
        raw = await asyncio.wait_for(request.read(), limit_s if limit_s > 0 else None)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body was not received within {request.app[BODY_TIMEOUT]:g} s "
                       "(JAXSERVE_BODY_TIMEOUT)", code="request_timeout") from None
    except web.RequestPayloadError as e:  # e.g. a Content-Encoding the body does not match: the client's fault
        why = " ".join(str(getattr(e.__cause__, "message", None) or e).split())
        raise bad_request(f"the request body could not be read: {why}") from None
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        # decoded strictly here: json.loads(bytes) decodes with 'surrogatepass', letting UTF-8-encoded
        # surrogates through
        text = raw.decode(json.detect_encoding(raw))
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    # A lone surrogate is not Unicode text: the tokenizer and UTF-8 encoders fail on it (a 500 deep in a
    # handler), so it is refused here, once for every endpoint.
    if _SURROGATE_ESCAPE.search(text):
        found, where = _lone_surrogate(body)
        if found:
            raise bad_request(f"the request body is not valid JSON: {where or 'a string'} holds a lone UTF-16 "
                              "surrogate escape (\\ud800-\\udfff without its pair), which is not Unicode text",
                              where)
    return body


def _json_endpoint(fn):
    async def handler(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        state.require_ready()
        body = await read_json(request)
        return await fn(request, state, body)

    handler.__name__ = fn.__name__
    return handler


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    cards = [_card(state, n) for n in state.served_names] + [_card(state, n) for n in state.adapters]
    return web.json_response(dump(ModelList(data=cards)))


async def props(request: web.Request) -> web.Response:
    """GET /props (llama.cpp's server): what the chat page needs to know — the served model, its context, and
    whether it takes images (`modalities.vision`)."""
    state = request.app[STATE]
    state.require_ready()
    eng = state.engine
    return web.json_response({"model": state.model_name, "max_model_len": eng.ecfg.max_model_len,
                              "modalities": {"vision": getattr(eng, "vision", None) is not None, "audio": False}})


async def lora_adapters(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    return list_lora_adapters(state)


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    name = request.match_info["model"]
    return web.json_response(dump(_card(state, state.check_model(name))))


def _card(state, name: str) -> ModelCard:
    """A served name's card, or a LoRA adapter's: its directory as root, the base model as parent (vLLM's)."""
    lora = state.lora_of(name)
    return ModelCard(id=name, created=state.created, root=state.adapters[lora] if lora else state.engine.model.name,
                     parent=state.model_name if lora else None, max_model_len=state.engine.ecfg.max_model_len)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.shutting_down:
        return web.json_response({"status": "shutting_down"}, status=503)
    if state.load_error:
        return web.json_response({"status": "error", "error": state.load_error}, status=503)
    if not state.ready:
        return web.json_response({"status": "loading"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def tokenize(request: web.Request, state, body) -> web.Response:
    req = parse_request(TokenizeRequest, body)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
    if req.messages is not None:
        ids, _ = await chat_prompt(state, req.messages, req.add_generation_prompt,
                                   template_kwargs=req.chat_template_kwargs)
    else:
        ids = state.engine.tokenizer.encode(req.prompt)
    return web.json_response({"count": len(ids), "max_model_len": state.engine.ecfg.max_model_len,
                              "tokens": ids, "token_strs": [state.token_text(t) for t in ids]})


async def detokenize(request: web.Request, state, body) -> web.Response:
    req = parse_request(DetokenizeRequest, body)
    state.check_model(req.model)
    check_ids(state, req.tokens, "tokens")
    return web.json_response({"prompt": state.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)})


_WEBUI = Path(__file__).parent / "webui"


def add_webui(app: web.Application) -> None:
    """The chat page at / (webui/: one HTML file and its script, read once at start-up)."""
    page = (_WEBUI / "index.html").read_bytes()
    script = (_WEBUI / "app.js").read_bytes()

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8")

    async def app_js(request: web.Request) -> web.Response:
        return web.Response(body=script, content_type="application/javascript", charset="utf-8")

    app.router.add_get("/", index)
    app.router.add_get("/webui/app.js", app_js)


def _state_endpoint(fn):
    """A handler without a body (GET, DELETE) that needs the loaded model."""
    async def handler(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        state.require_ready()
        return await fn(request, state)

    handler.__name__ = fn.__name__
    return handler


def add_routes(app: web.Application) -> None:
    posts = {"/chat/completions": _json_endpoint(chat_completions),
             "/responses": _json_endpoint(create_response),
             "/completions": _json_endpoint(completions),
             "/embeddings": _json_endpoint(embeddings),
             "/rerank": _json_endpoint(rerank),
             "/score": _json_endpoint(score),
             "/classify": _json_endpoint(classify),
             "/tokenize": _json_endpoint(tokenize),
             "/detokenize": _json_endpoint(detokenize),
             "/load_lora_adapter": _json_endpoint(load_lora_adapter),
             "/unload_lora_adapter": _json_endpoint(unload_lora_adapter),
             "/lora-adapters": _json_endpoint(set_lora_adapters),
             "/conversations": _json_endpoint(conv.create_conversation),
             "/conversations/{conversation_id}": _json_endpoint(conv.update_conversation),
             "/conversations/{conversation_id}/items": _json_endpoint(conv.add_items)}
    gets = {"/models": list_models, "/models/{model:.+}": get_model, "/health": health, "/metrics": metrics,
            "/lora-adapters": lora_adapters, "/props": props, "/responses/{response_id}": _state_endpoint(get_response),
            "/responses/{response_id}/input_items": _state_endpoint(list_input_items),
            "/conversations/{conversation_id}": _state_endpoint(conv.get_conversation),
            "/conversations/{conversation_id}/items": _state_endpoint(conv.list_items),
            "/conversations/{conversation_id}/items/{item_id}": _state_endpoint(conv.get_item)}
    for prefix in ("/v1", ""):
        for path, h in posts.items():
            app.router.add_post(prefix + path, h)
        for path, h in gets.items():
            app.router.add_get(prefix + path, h)
        app.router.add_delete(prefix + "/responses/{response_id}", _state_endpoint(delete_response))
        app.router.add_post(prefix + "/responses/{response_id}/cancel", _state_endpoint(cancel_response))
        app.router.add_delete(prefix + "/conversations/{conversation_id}", _state_endpoint(conv.delete_conversation))
        app.router.add_delete(prefix + "/conversations/{conversation_id}/items/{item_id}",
                              _state_endpoint(conv.delete_item))
    app.router.add_post("/v2/rerank", _json_endpoint(rerank))  # Cohere's v2 path
