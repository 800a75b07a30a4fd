"""POST /v1/chat/completions."""

from __future__ import annotations

import dataclasses
import logging

from aiohttp import web

from jaxserve.server import reasoning, structured, tools
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.generation import Generation, Prompt, chat_logprobs, new_id
from jaxserve.server.images import chat_prompt
from jaxserve.server.protocol import (ChatChoice, ChatChoiceLogprobs, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatMessageOut, check_unsupported, dump,
                                      parse_request)
from jaxserve.server.sampling import chat_params
from jaxserve.server.streaming import SSEWriter, is_disconnect

log = logging.getLogger("jaxserve.server")


async def chat_completions(request: web.Request, state, body) -> web.StreamResponse:
    req = parse_request(ChatCompletionRequest, body)
    state.require_generative()
    check_unsupported(req)
    model = state.check_model(req.model)
    lora = state.lora_for(req)  # now: an unload during the awaits below must not mean the base model
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    funcs = tools.check_tools(req.tools, req.tool_choice)
    one_call = req.parallel_tool_calls is False
    forced = tools.forced_call(req.tool_choice) if funcs else None
    spec = await structured.compiled(state, structured.pick(
        ("response_format", structured.from_response_format(req.response_format)),
        ("structured_outputs", structured.from_structured_outputs(req.structured_outputs)),
        ("tool_choice", structured.forced_tool_spec(funcs, forced, one_call) if forced else None)))
    parser = getattr(state.args, "reasoning_parser", None)
    if spec is not None and parser:  # the constraint holds for the answer, after the thinking
        spec = dataclasses.replace(spec, after_reasoning=True)
    params = chat_params(state, req, spec)
    ids, mm = await chat_prompt(state, req.messages, req.add_generation_prompt, funcs, req.chat_template_kwargs)
    gen = Generation(state, [Prompt(ids, mm=mm)], params, new_id("chatcmpl"), prompt_param="messages",
                     lora=lora)
    gen.submit()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream(request, state, gen, model, include_usage, funcs, one_call, forced, parser)
    await gen.run()
    want_lp = params.logprobs is not None
    choices = []
    for c in gen.choices:
        thought, text = reasoning.split(parser, c.full_text) if parser else (None, c.full_text)
        if forced:
            calls = tools.parse_forced(text or "", forced)
            content = None if calls else text  # a "required" reply cut before its first call ended
        else:
            content, calls = tools.parse(text, funcs) if funcs and text is not None else (text, [])
        calls = calls[:1] if one_call else calls
        choices.append(ChatChoice(
            index=c.index, message=ChatMessageOut(content=content, tool_calls=calls or None,
                                                  reasoning_content=thought),
            logprobs=ChatChoiceLogprobs(content=chat_logprobs(state, c.token_ids, c.logprobs)) if want_lp else None,
            # a call cut off by max_tokens says so ("length"): its arguments are incomplete JSON
            finish_reason="tool_calls" if calls and c.finish_reason != "length" else c.finish_reason))
    resp = ChatCompletionResponse(id=gen.id, created=gen.created, model=model, choices=choices, usage=gen.usage())
    return web.json_response(dump(resp))


async def _stream(request, state, gen: Generation, model: str, include_usage: bool,
                  funcs: list[dict] | None = None, one_call: bool = False,
                  forced: str | None = None, parser: str | None = None) -> web.StreamResponse:
    want_lp = gen.params.logprobs is not None
    base = {"id": gen.id, "object": "chat.completion.chunk", "created": gen.created, "model": model}

    def chunk(choices: list, usage=None) -> dict:
        d = dict(base, choices=choices)
        if include_usage:  # OpenAI: every chunk carries usage, null except in the last one
            d["usage"] = usage
        return d

    def choice(index: int, delta: dict, lp=None, finish=None) -> dict:
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def delta(text: str | None, thought: str | None) -> dict:
        return {**({"reasoning_content": thought} if thought else {}), **({"content": text} if text else {})}

    w = SSEWriter(request)
    finished: set[int] = set()
    # with tools: content is streamed until a call may have begun (server/tools.StreamHolder)
    # a forced call (tool_choice "required" or named) streams no content; calls stream as they are written
    max_calls = 1 if one_call else None
    holders = {c.index: tools.ForcedCallHolder(forced, max_calls) if forced else tools.StreamHolder(max_calls)
               for c in gen.choices} if funcs else {}
    # with a reasoning parser: the thinking streams as reasoning_content, the rest as content
    splitters = {c.index: reasoning.ReasoningSplitter(parser) for c in gen.choices} if parser else {}

    async def on_updates(updates) -> None:
        chunks = []
        for u in updates:
            idx = u.choice.index
            if idx in finished:
                continue
            lp = None
            if want_lp and u.token_ids:
                lp = {"content": chat_logprobs(state, u.token_ids, u.logprobs), "refusal": None}
            text, thought = u.text or "", ""
            if parser:
                thought, text = splitters[idx].feed(text, final=u.finished)
            text = holders[idx].feed(text) if funcs else text
            calls = holders[idx].call_deltas(funcs) if funcs else []
            if u.finished and funcs:
                rest, more = holders[idx].finish(funcs)
                text, calls = (text or "") + rest, calls + more
            if not (text or thought or lp or calls or u.finished):
                continue
            fin = u.choice.finish_reason if u.finished else None
            if u.finished:
                finished.add(idx)
                if funcs and holders[idx].calls.made_calls and fin != "length":
                    fin = "tool_calls"  # a call cut off by max_tokens says "length": its arguments are incomplete
            if text or thought or lp or (fin and not calls):
                chunks.append(chunk([choice(idx, delta(text, thought), lp, None if calls else fin)]))
            if calls:
                chunks.append(chunk([choice(idx, {"tool_calls": calls})]))
                if fin:
                    chunks.append(chunk([choice(idx, {}, None, fin)]))
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
