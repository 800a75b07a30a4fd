"""POST /v1/chat/completions."""

from __future__ import annotations

import logging

from aiohttp import web

from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.generation import Generation, Prompt, chat_logprobs, new_id
from jaxserve.server.protocol import (ChatChoice, ChatChoiceLogprobs, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatMessageOut, check_unsupported, dump,
                                      parse_request)
from jaxserve.server.sampling import chat_params, chat_prompt_ids
from jaxserve.server.streaming import SSEWriter, is_disconnect

log = logging.getLogger("jaxserve.server")


async def chat_completions(request: web.Request, state, body) -> web.StreamResponse:
    req = parse_request(ChatCompletionRequest, body)
    check_unsupported(req)
    model = state.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    params = chat_params(state, req)
    ids = chat_prompt_ids(state, req.messages, req.add_generation_prompt)
    gen = Generation(state, [Prompt(ids)], params, new_id("chatcmpl"), prompt_param="messages")
    gen.submit()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream(request, state, gen, model, include_usage)
    await gen.run()
    want_lp = params.logprobs is not None
    choices = [ChatChoice(index=c.index, message=ChatMessageOut(content=c.full_text),
                          logprobs=ChatChoiceLogprobs(content=chat_logprobs(state, c.token_ids, c.logprobs))
                          if want_lp else None,
                          finish_reason=c.finish_reason)
               for c in gen.choices]
    resp = ChatCompletionResponse(id=gen.id, created=gen.created, model=model, choices=choices, usage=gen.usage())
    return web.json_response(dump(resp))


async def _stream(request, state, gen: Generation, model: str, include_usage: bool) -> web.StreamResponse:
    want_lp = gen.params.logprobs is not None
    base = {"id": gen.id, "object": "chat.completion.chunk", "created": gen.created, "model": model}

    def chunk(choices: list, usage=None) -> dict:
        d = dict(base, choices=choices)
        if include_usage:  # OpenAI: every chunk carries usage, null except in the last one
            d["usage"] = usage
        return d

    def choice(index: int, delta: dict, lp=None, finish=None) -> dict:
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    w = SSEWriter(request)
    finished: set[int] = set()

    async def on_updates(updates) -> None:
        chunks = []
        for u in updates:
            idx = u.choice.index
            if idx in finished:
                continue
            lp = None
            if want_lp and u.token_ids:
                lp = {"content": chat_logprobs(state, u.token_ids, u.logprobs), "refusal": None}
            if not (u.text or lp or u.finished):
                continue
            fin = u.choice.finish_reason if u.finished else None
            if u.finished:
                finished.add(idx)
            chunks.append(chunk([choice(idx, {"content": u.text} if u.text else {}, lp, fin)]))
        await w.send(chunks)

    try:
        await w.start()
        # the role goes in the first delta of each choice, and only there
        await w.send([chunk([choice(c.index, {"role": "assistant", "content": ""})]) for c in gen.choices])
        try:
            await gen.run(on_updates)
        except APIError as e:
            await w.error(e)
            return await w.finish()
        tail = [chunk([choice(c.index, {}, None, c.finish_reason or "abort")])
                for c in gen.choices if c.index not in finished]
        if include_usage:
            tail.append(chunk([], dump(gen.usage())))
        await w.send(tail)
        return await w.finish()
    except Exception as e:
        if is_disconnect(e):
            return w.resp  # the client left; Generation.run already aborted the request
        if not w.resp.prepared:
            raise
        log.exception("chat stream %s failed", gen.id)  # headers are out: end the stream instead
        return w.resp
