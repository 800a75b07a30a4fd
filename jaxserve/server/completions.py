"""POST /v1/completions (legacy text completions, what lm-evaluation-harness's local-completions uses).

`echo` + `logprobs` returns the prompt's own token logprobs (the first token has none: null), then
the generated tokens'. `max_tokens: 0` with echo returns just the prompt (one token is generated
internally for the prompt logprobs and thrown away; completion_tokens is 0).
"""

from __future__ import annotations


from aiohttp import web

from jaxserve.server import structured
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.generation import (Choice, CompletionLogprobBuilder, Generation, Prompt,
                                        merge_completion_logprobs, new_id)
from jaxserve.server.protocol import (CompletionChoice, CompletionRequest, CompletionResponse, check_unsupported,
                                      dump, parse_request)
from jaxserve.server.sampling import completion_params, completion_prompts
from jaxserve.server.streaming import SSEWriter, failed

def _echo_text(state, p: Prompt) -> str:
    return p.text if p.text is not None else state.engine.tokenizer.decode(p.ids, skip_special_tokens=False)


def _prompt_logprobs(state, c: Choice, builder: CompletionLogprobBuilder) -> dict:
    plp = list(getattr(c.seq, "prompt_logprobs", None) or []) if c.seq is not None else []
    entries = [None] + plp
    entries += [None] * (len(c.prompt.ids) - len(entries))
    return builder.build(c.prompt.ids, entries, first_is_null=True)


async def completions(request: web.Request, state, body) -> web.StreamResponse:
    req = parse_request(CompletionRequest, body)
    state.require_generative()
    check_unsupported(req)
    model = state.check_model(req.model)
    lora = state.lora_for(req)  # now: an unload during the awaits below must not mean the base model
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    spec = await structured.compiled(state, structured.pick(
        ("response_format", structured.from_response_format(req.response_format)),
        ("structured_outputs", structured.from_structured_outputs(req.structured_outputs))))
    params, discard = completion_params(state, req, spec)
    prompts = [Prompt(ids, text) for ids, text in completion_prompts(state, req.prompt)]
    gen = Generation(state, prompts, params, new_id("cmpl"), discard_output=discard, lora=lora)
    want_lp = req.logprobs is not None
    echo = bool(req.echo)
    if discard and not want_lp:
        # nothing to compute: validate like a real request, then answer from the prompt alone
        for p in prompts:
            try:
                state.engine.validate(p.ids, params)
            except ValueError as e:
                raise bad_request(str(e), "prompt" if getattr(e, "param", None) == "messages"
                                  else getattr(e, "param", None)) from None
        for c in gen.choices:
            c.finish_reason = "length"
    else:
        gen.submit()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream(request, state, gen, model, include_usage, echo, want_lp)
    if gen.stream is not None:
        await gen.run()
    choices = []
    for c in gen.choices:
        b = CompletionLogprobBuilder(state)
        lp = None
        text = c.full_text
        if echo:
            if want_lp:
                lp = _prompt_logprobs(state, c, b)
            text = _echo_text(state, c.prompt) + text
        if want_lp:
            lp = merge_completion_logprobs(lp, b.build(c.token_ids, c.logprobs))
        choices.append(CompletionChoice(index=c.index, text=text, logprobs=lp, finish_reason=c.finish_reason))
    resp = CompletionResponse(id=gen.id, created=gen.created, model=model, choices=choices, usage=gen.usage())
    return web.json_response(dump(resp))


async def _stream(request, state, gen: Generation, model: str, include_usage: bool, echo: bool,
                  want_lp: bool) -> web.StreamResponse:
    base = {"id": gen.id, "object": "text_completion", "created": gen.created, "model": model}

    def chunk(choices: list, usage=None) -> dict:
        d = dict(base, choices=choices)
        if include_usage:
            d["usage"] = usage
        return d

    def choice(index: int, text: str, lp=None, finish=None) -> dict:
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    builders = {c.index: CompletionLogprobBuilder(state) for c in gen.choices}
    started: set[int] = set()
    finished: set[int] = set()

    def echo_chunk(c: Choice) -> list:
        # sent with the choice's first delta: by then its prompt logprobs are complete
        started.add(c.index)
        if not echo:
            return []
        lp = _prompt_logprobs(state, c, builders[c.index]) if want_lp else None
        return [chunk([choice(c.index, _echo_text(state, c.prompt), lp)])]

    w = SSEWriter(request)

    async def on_updates(updates) -> None:
        chunks = []
        for u in updates:
            c = u.choice
            if c.index in finished:
                continue
            if c.index not in started:
                chunks += echo_chunk(c)
            lp = builders[c.index].build(u.token_ids, u.logprobs) if want_lp and u.token_ids else None
            if not (u.text or lp or u.finished):
                continue
            fin = c.finish_reason if u.finished else None
            if u.finished:
                finished.add(c.index)
            chunks.append(chunk([choice(c.index, u.text, lp, fin)]))
        await w.send(chunks)

    try:
        await w.start()
        if gen.stream is not None:
            try:
                await gen.run(on_updates)
            except APIError as e:
                await w.error(e)
                return await w.finish()
        tail = []
        for c in gen.choices:
            if c.index not in started:
                tail += echo_chunk(c)
            if c.index not in finished:
                tail.append(chunk([choice(c.index, "", None, c.finish_reason or "abort")]))
        if include_usage:
            tail.append(chunk([], dump(gen.usage())))
        await w.send(tail)
        return await w.finish()
    except Exception as e:
        return failed(w, e, f"completion stream {gen.id}")
