"""OpenAI's Conversations API on the main SmolLM2 server, through the openai client: a conversation's items are
the history of the responses created in it (the reply equals the same conversation sent as input), each
response adds its input and output items, items are listed, paged, fetched, added and deleted."""

from __future__ import annotations

import json
import urllib.error

import pytest

from conftest import get_json, post_json
from test_responses import client, url  # noqa: F401  (the main server's fixtures)

pytestmark = pytest.mark.timeout(900)


def _status(fn):
    import openai

    try:
        fn()
    except openai.APIStatusError as e:
        return e.status_code, e.body
    return 200, None


def test_responses_in_a_conversation_see_its_items(url, client):
    from openai.types.conversations import Conversation

    seed = [{"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
            {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Nice to meet you, Ada."}]
    conv = client.conversations.create(items=seed, metadata={"topic": "names"})
    assert isinstance(conv, Conversation) and conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    kw = dict(model="smol", temperature=0, max_output_tokens=16)
    r1 = client.responses.create(conversation=conv.id, input="What is my name?", **kw)
    # the same conversation sent as input gives the same reply
    want = client.responses.create(input=seed + [{"role": "user", "content": "What is my name?"}], **kw)
    assert r1.output_text == want.output_text and r1.conversation.id == conv.id
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [getattr(i, "role", None) for i in items] == ["system", "user", "assistant", "user", "assistant"]
    assert items[3].content[0].text == "What is my name?" and items[4].content[0].text == r1.output_text
    assert items[4].id == r1.output[0].id  # the response's own output item
    assert items[3].id == client.responses.input_items.list(r1.id).data[0].id  # ... and its input item
    # an item the conversation holds already (a previous output sent back as input) is a 400
    status, err = post_json(f"{url}/v1/responses", {"model": "smol", "conversation": conv.id, "input": [
        r1.output[0].model_dump(exclude_none=True)]})
    assert status == 400 and err["error"]["param"] == "input[0].id", err
    # a second turn sees the first; the object form {"id": ...} works too
    r2 = client.responses.create(conversation={"id": conv.id}, input="And what did I ask?", **kw)
    want2 = client.responses.create(input=seed + [{"role": "user", "content": "What is my name?"},
                                                  {"role": "assistant", "content": r1.output_text},
                                                  {"role": "user", "content": "And what did I ask?"}], **kw)
    assert r2.output_text == want2.output_text
    assert len(list(client.conversations.items.list(conv.id))) == 7
    # a response that is not stored still joins its conversation
    client.responses.create(conversation=conv.id, input="Thanks.", store=False, **kw)
    assert len(list(client.conversations.items.list(conv.id))) == 9


def test_items_are_managed(url, client):
    conv = client.conversations.create()
    assert list(client.conversations.items.list(conv.id)) == []
    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"line {i}"}]}
        for i in range(5)])
    assert [i.content[0].text for i in added.data] == [f"line {i}" for i in range(5)]
    assert added.first_id == added.data[0].id and added.last_id == added.data[-1].id and not added.has_more
    desc = client.conversations.items.list(conv.id, limit=2)  # newest first by default
    assert [i.content[0].text for i in desc.data] == ["line 4", "line 3"] and desc.has_more
    walked = list(client.conversations.items.list(conv.id, limit=2, order="asc"))  # pages followed by `after`
    assert [i.content[0].text for i in walked] == [f"line {i}" for i in range(5)]
    status, err = post_json(f"{url}/v1/conversations/{conv.id}/items", {"items": [
        {"type": "message", "role": "user", "content": "again", "id": added.data[0].id}]})
    assert status == 400 and err["error"]["param"] == "items[0].id", err
    one = client.conversations.items.retrieve(added.data[2].id, conversation_id=conv.id)
    assert one.content[0].text == "line 2"
    after = client.conversations.items.delete(added.data[2].id, conversation_id=conv.id)
    assert after.id == conv.id
    assert [i.content[0].text for i in client.conversations.items.list(conv.id, order="asc")] == \
        ["line 0", "line 1", "line 3", "line 4"]
    upd = client.conversations.update(conv.id, metadata={"k": "v"})
    assert upd.metadata == {"k": "v"} and client.conversations.retrieve(conv.id).metadata == {"k": "v"}
    gone = client.conversations.delete(conv.id)
    assert gone.deleted and gone.id == conv.id and gone.object == "conversation.deleted"
    assert _status(lambda: client.conversations.retrieve(conv.id))[0] == 404
    # a response in a deleted (or unknown) conversation: 404 naming the parameter
    status, err = post_json(f"{url}/v1/responses", {"model": "smol", "input": "hi", "conversation": conv.id})
    assert status == 404 and err["error"]["param"] == "conversation", err


@pytest.mark.parametrize("path,body,param", [
    ("/v1/conversations", {"items": [{"role": "robot", "content": "x"}]}, "items[0].role"),
    ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "items"),
    ("/v1/conversations", {"metadata": {"k": 1}}, "metadata.k"),
    ("/v1/conversations", {"frobnicate": 1}, "frobnicate"),
    ("/v1/responses", {"input": "hi", "conversation": {"id": "conv_x", "extra": 1}}, "conversation"),
    ("/v1/responses", {"input": "hi", "conversation": "conv_x", "previous_response_id": "resp_x"}, "conversation"),
])
def test_errors(url, path, body, param):
    status, err = post_json(f"{url}{path}", {"model": "smol", **body} if path.endswith("responses") else body)
    assert status == 400, err
    assert err["error"]["param"] == param, err


def test_unknown_ids_are_404(url, client):
    conv = client.conversations.create()
    for call in (lambda: client.conversations.items.list("conv_missing"),
                 lambda: client.conversations.items.retrieve("msg_missing", conversation_id=conv.id),
                 lambda: client.conversations.items.delete("msg_missing", conversation_id=conv.id),
                 lambda: client.conversations.delete("conv_missing")):
        assert _status(call)[0] == 404
    try:
        get_json(f"{url}/v1/conversations/{conv.id}/items?limit=0")
        raise AssertionError("limit=0 accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400 and json.loads(e.read())["error"]["param"] == "limit"


def test_store_is_bounded(monkeypatch):
    """The oldest conversations go past MAX_CONVERSATIONS (or MAX_CONVERSATION_BYTES of JSON); the same
    eviction as the response store's."""
    import argparse

    from jaxserve.server import conversations as mod
    from jaxserve.server.state import ServerState

    state = ServerState(argparse.Namespace(model="m"))
    monkeypatch.setattr(mod, "MAX_CONVERSATIONS", 3)
    for i in range(5):
        entry = {"conversation": {"id": f"conv_{i}"}, "items": []}
        state.conversations[f"conv_{i}"] = entry
        mod._resize(state, entry)
    assert list(state.conversations) == ["conv_2", "conv_3", "conv_4"]
    monkeypatch.setattr(mod, "MAX_CONVERSATION_BYTES", 2000)
    mod.append(state, "conv_4", [{"id": "m", "type": "message", "content": "x" * 2500}], [])
    assert list(state.conversations) == ["conv_4"]  # the others went to make room; the newest always stays
    mod.append(state, "conv_gone", [{"id": "m2"}], [])  # a deleted conversation: nothing to add to
    assert list(state.conversations) == ["conv_4"]
