"""OpenAI's Conversations API (/v1/conversations) and the Responses `conversation` parameter.

A conversation is a list of items (messages, function calls and their outputs, reasoning) kept in memory
(the last MAX_CONVERSATIONS, MAX_CONVERSATION_BYTES of JSON at most: the oldest go first). A response
created with `conversation` reads its items as the history before its own input, and when it finishes
its input items and output items are added to it (as OpenAI's). Items are validated and shaped by the
Responses code (responses._messages, responses._input_items), so what a conversation accepts is what
`input` accepts.
"""

from __future__ import annotations

import collections
import json
import time
from typing import Any

from aiohttp import web

from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import _Req, parse_request
from jaxserve.server.state import evict_oldest

MAX_CONVERSATIONS = 1000
MAX_CONVERSATION_BYTES = 64 * 2**20
MAX_ITEMS_PER_CALL = 20  # items in one create / add call, as OpenAI's


class CreateConversation(_Req):
    items: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None  # accepted and ignored, as on the other endpoints


class UpdateConversation(_Req):
    metadata: dict[str, str]


class AddItems(_Req):
    items: list[dict[str, Any]]


def _store(state) -> collections.OrderedDict:
    return state.conversations


def _entry(state, cid: str, param: str = "conversation_id") -> dict:
    entry = _store(state).get(cid)
    if entry is None:
        raise APIError(404, f"Conversation with id '{cid}' not found.", param, "not_found")
    return entry


def _check_metadata(metadata: dict | None) -> dict:
    metadata = metadata or {}
    if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise bad_request("metadata holds at most 16 pairs, keys of at most 64 characters and values of at "
                          "most 512", "metadata")
    return metadata


def _new_items(items: list[dict], param: str, entry: dict | None = None) -> list[dict]:
    """Validated request items -> stored item objects with ids (none already in the conversation)."""
    from jaxserve.server.responses import _input_items, _messages

    if len(items) > MAX_ITEMS_PER_CALL:
        raise bad_request(f"at most {MAX_ITEMS_PER_CALL} items can be added at once, got {len(items)}", param)
    _messages(items, param)  # 400s naming the item and field
    if entry is not None:
        check_new_ids(entry, items, param)
    return _input_items(items)


def check_new_ids(entry: dict, items, param: str) -> None:
    """An item id the conversation already holds is a 400 (as OpenAI's): ids page the item list."""
    if isinstance(items, str):
        return
    have = {it.get("id") for it in entry["items"]}
    for i, it in enumerate(items):
        if it.get("id") is not None and it["id"] in have:
            raise bad_request(f"Duplicate item found with id {it['id']}", f"{param}[{i}].id")


def _resize(state, entry: dict) -> None:
    entry["bytes"] = len(json.dumps(entry["conversation"])) + len(json.dumps(entry["items"]))
    evict_oldest(_store(state), MAX_CONVERSATIONS, MAX_CONVERSATION_BYTES)


# ------------------------------------------------------------------------------ the Responses side
def conversation_id(conversation: Any) -> str | None:
    """The Responses `conversation` parameter: an id or {"id": ...}."""
    if conversation is None:
        return None
    cid = conversation.get("id") if isinstance(conversation, dict) else conversation
    if not isinstance(cid, str) or (isinstance(conversation, dict) and set(conversation) != {"id"}):
        raise bad_request("conversation must be a conversation id or {\"id\": ...}", "conversation")
    return cid


def history(state, cid: str, input_items) -> list[dict]:
    """The conversation's items, as chat messages, for a response created in it with input_items (the
    request's `input`: ids the conversation holds already are a 400)."""
    from jaxserve.server.responses import _messages

    entry = _entry(state, cid, "conversation")
    check_new_ids(entry, input_items, "input")
    return _messages(entry["items"], "conversation")


def append(state, cid: str, input_items: list[dict], output: list[dict]) -> None:
    """A finished response's input and output items join its conversation (unless it was deleted)."""
    entry = _store(state).get(cid)
    if entry is None:
        return
    entry["items"].extend(input_items)
    entry["items"].extend(dict(it) for it in output)
    _resize(state, entry)


# ------------------------------------------------------------------------------ routes
async def create_conversation(request: web.Request, state, body) -> web.Response:
    req = parse_request(CreateConversation, body)
    from jaxserve.server.responses import _id

    conv = {"id": _id("conv"), "object": "conversation", "created_at": int(time.time()),
            "metadata": _check_metadata(req.metadata)}
    entry = {"conversation": conv, "items": _new_items(req.items or [], "items")}
    _store(state)[conv["id"]] = entry
    _resize(state, entry)
    return web.json_response(conv)


async def get_conversation(request: web.Request, state) -> web.Response:
    return web.json_response(_entry(state, request.match_info["conversation_id"])["conversation"])


async def update_conversation(request: web.Request, state, body) -> web.Response:
    req = parse_request(UpdateConversation, body)
    entry = _entry(state, request.match_info["conversation_id"])
    entry["conversation"] = dict(entry["conversation"], metadata=_check_metadata(req.metadata))
    return web.json_response(entry["conversation"])


async def delete_conversation(request: web.Request, state) -> web.Response:
    cid = request.match_info["conversation_id"]
    _entry(state, cid)
    del _store(state)[cid]
    return web.json_response({"id": cid, "object": "conversation.deleted", "deleted": True})


async def list_items(request: web.Request, state) -> web.Response:
    """GET .../items: `order` desc (default) or asc, `limit` 1-100 (20), `after` an item id."""
    from jaxserve.server.responses import item_page

    entry = _entry(state, request.match_info["conversation_id"])
    return web.json_response(item_page(entry["items"], request.query))


async def add_items(request: web.Request, state, body) -> web.Response:
    req = parse_request(AddItems, body)
    entry = _entry(state, request.match_info["conversation_id"])
    new = _new_items(req.items, "items", entry)
    entry["items"].extend(new)
    _resize(state, entry)
    return web.json_response({"object": "list", "data": new, "first_id": new[0]["id"] if new else None,
                              "last_id": new[-1]["id"] if new else None, "has_more": False})


def _item_index(entry: dict, item_id: str) -> int:
    for i, it in enumerate(entry["items"]):
        if it.get("id") == item_id:
            return i
    raise APIError(404, f"Item with id '{item_id}' not found.", "item_id", "not_found")


async def get_item(request: web.Request, state) -> web.Response:
    entry = _entry(state, request.match_info["conversation_id"])
    return web.json_response(entry["items"][_item_index(entry, request.match_info["item_id"])])


async def delete_item(request: web.Request, state) -> web.Response:
    entry = _entry(state, request.match_info["conversation_id"])
    del entry["items"][_item_index(entry, request.match_info["item_id"])]
    _resize(state, entry)
    return web.json_response(entry["conversation"])
