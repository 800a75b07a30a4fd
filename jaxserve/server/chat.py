"""POST /v1/chat/completions."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from jaxserve.server import reasoning, structured, tools
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.generation import Generation, Prompt, chat_logprobs, new_id
from jaxserve.server.images import chat_prompt
from jaxserve.server.protocol import (ChatChoice, ChatChoiceLogprobs, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatMessageOut, check_unsupported, dump,
                                      parse_request)
from jaxserve.server.sampling import chat_params
from jaxserve.server.streaming import SSEWriter, failed

@dataclasses.dataclass
class ChatRun:
    """A submitted chat generation and how its replies are read (shared with server/responses.py)."""

    gen: Generation
    model: str
    funcs: list[dict] | None
    one_call: bool
    forced: str | None
    parser: str | None

    def reply(self, c) -> tuple[str | None, str | None, list[dict], str | None]:
        """(reasoning, content, tool calls, finish_reason) of a finished choice."""
        thought, text = reasoning.split(self.parser, c.full_text) if self.parser else (None, c.full_text)
        if not self.funcs or (text is None and not self.forced):
            return thought, text, [], c.finish_reason
        # what the stream sends, joined: the same calls (arguments as the model wrote them) and finish_reason
        # ("tool_calls" only for whole calls: one cut off by max_tokens says "length")
        content, calls, finish = tools.reply_calls(text or "", self.funcs, self.forced, 1 if self.one_call else None,
                                                   c.finish_reason)
        return thought, content, calls, finish

    def streamer(self):
        return ReplyStream(self.funcs, self.one_call, self.forced, self.parser)


class ReplyStream:
    """One choice's stream: each engine update's text split into reasoning and content, content that may be
    a tool call held back, tool calls as OpenAI's deltas (server/tools.py)."""

    def __init__(self, funcs, one_call: bool, forced: str | None, parser: str | None):
        max_calls = 1 if one_call else None
        self.funcs = funcs
        self.holder = (tools.ForcedCallHolder(forced, max_calls) if forced else tools.StreamHolder(max_calls)) \
            if funcs else None
        self.splitter = reasoning.ReasoningSplitter(parser) if parser else None

    def feed(self, text: str, finished: bool, finish_reason: str | None):
        """(content, reasoning, tool-call deltas, finish_reason or None while going on)."""
        thought = ""
        if self.splitter:
            thought, text = self.splitter.feed(text, final=finished)
        calls = []
        if self.holder:
            text = self.holder.feed(text)
            calls = self.holder.call_deltas(self.funcs)
            if finished:
                rest, more = self.holder.finish(self.funcs)
                text, calls = (text or "") + rest, calls + more
        fin = finish_reason if finished else None
        if fin is not None and self.holder:
            fin = self.holder.calls.finish_reason(fin)  # "tool_calls" for whole calls (cut: "length")
        return text, thought, calls, fin


async def start_chat(state, req: ChatCompletionRequest, id_prefix: str = "chatcmpl") -> ChatRun:
    """Validate a chat request, build its prompt and submit it (errors are 4xx APIErrors)."""
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
    gen = Generation(state, [Prompt(ids, mm=mm)], params, new_id(id_prefix), prompt_param="messages",
                     lora=lora)
    gen.submit()
    return ChatRun(gen, model, funcs, one_call, forced, parser)


async def chat_completions(request: web.Request, state, body) -> web.StreamResponse:
    req = parse_request(ChatCompletionRequest, body)
    run = await start_chat(state, req)
    gen = run.gen
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream(request, state, run, include_usage)
    await gen.run()
    want_lp = gen.params.logprobs is not None
    choices = []
    for c in gen.choices:
        thought, content, calls, finish = run.reply(c)
        choices.append(ChatChoice(
            index=c.index, message=ChatMessageOut(content=content, tool_calls=calls or None,
                                                  reasoning_content=thought),
            logprobs=ChatChoiceLogprobs(content=chat_logprobs(state, c.token_ids, c.logprobs)) if want_lp else None,
            finish_reason=finish))
    resp = ChatCompletionResponse(id=gen.id, created=gen.created, model=run.model, choices=choices, usage=gen.usage())
    return web.json_response(dump(resp))


async def _stream(request, state, run: ChatRun, include_usage: bool) -> web.StreamResponse:
    gen = run.gen
    want_lp = gen.params.logprobs is not None
    base = {"id": gen.id, "object": "chat.completion.chunk", "created": gen.created, "model": run.model}

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
    # with tools: content is streamed until a call may have begun, calls as they are written; with a
    # reasoning parser: the thinking streams as reasoning_content (ReplyStream)
    streams = {c.index: run.streamer() for c in gen.choices}

    async def on_updates(updates) -> None:
        chunks = []
        for u in updates:
            idx = u.choice.index
            if idx in finished:
                continue
            lp = None
            if want_lp and u.token_ids:
                lp = {"content": chat_logprobs(state, u.token_ids, u.logprobs), "refusal": None}
            text, thought, calls, fin = streams[idx].feed(u.text or "", u.finished, u.choice.finish_reason)
            if not (text or thought or lp or calls or u.finished):
                continue
            if u.finished:
                finished.add(idx)
            if text or thought or lp or (fin and not calls):
                chunks.append(chunk([choice(idx, delta(text, thought), lp, None if calls else fin)]))
            if calls:  # one entry per call in a chunk: a call's id and name, then its argument pieces
                chunks += [chunk([choice(idx, {"tool_calls": part})]) for part in tools.delta_chunks(calls)]
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
        return failed(w, e, f"chat stream {gen.id}")
