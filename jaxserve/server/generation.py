"""One HTTP request's generation: submit its prompts, collect the engine's deltas per choice.

Shared by chat and completions, streaming or not. Handles the request timeout (abort, choices end
with finish_reason "abort") and client disconnects (the handler task is cancelled: `finally` aborts,
which frees the KV blocks before the engine's next step).
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from jaxserve.engine.async_engine import EngineStopped, QueueFull, RequestFailed
from jaxserve.engine.sampling_params import SamplingParams, SamplingParamsError
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import PromptTokensDetails, Usage

log = logging.getLogger("jaxserve.server")


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None
    rid: str = ""
    mm: object = None  # a multimodal model's engine/multimodal.MultiModalPrompt (ids = its token ids)


@dataclass
class Choice:
    index: int
    prompt: Prompt
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    seq: object = None
    first_t: float | None = None
    last_t: float | None = None

    @property
    def full_text(self) -> str:
        return "".join(self.text)


@dataclass
class Update:
    """What one engine delta changed for one choice (what a streaming chunk carries)."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list
    finished: bool


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Generation:
    def __init__(self, state, prompts: list[Prompt], params: SamplingParams, req_id: str,
                 discard_output: bool = False, prompt_param: str = "prompt", lora: str | None = None):
        self.state = state
        self.lora = lora  # the LoRA adapter (a name of lora_modules) the prompts run with, or None
        self.prompt_param = prompt_param  # what a prompt error names: 'messages' or 'prompt'
        self.params = params
        self.prompts = prompts
        self.n = params.n
        self.discard = discard_output
        self.id = req_id
        self.arrival = time.monotonic()
        self.created = int(time.time())
        self.choices: list[Choice] = []
        self._by_rid: dict[str, int] = {}
        for p_i, p in enumerate(prompts):
            p.rid = req_id if len(prompts) == 1 else f"{req_id}-{p_i}"
            self._by_rid[p.rid] = p_i
            for i in range(self.n):
                self.choices.append(Choice(p_i * self.n + i, p))
        self.stream = None
        self.first_token_seen = False

    # ------------------------------------------------------------------ submission
    def submit(self) -> None:
        st = self.state
        aeng = st.aengine
        if aeng is None:
            raise APIError(503, "the model is still loading")
        self.stream = aeng.open_stream()
        try:
            aeng.submit(self.stream, [(p.rid, p.mm or p.ids, self.params) for p in self.prompts],
                        lora_request=self.lora)
        except QueueFull as e:
            raise APIError(429, str(e)) from None
        except EngineStopped as e:
            raise APIError(503, str(e)) from None
        except ValueError as e:  # SamplingParamsError, PromptTooLongError: the request's fault
            param = getattr(e, "param", None)
            if param in ("messages", "prompt"):
                param = self.prompt_param
            raise bad_request(str(e), param) from None
        st.metrics.prompt_tokens.inc(sum(len(p.ids) for p in self.prompts))

    # ------------------------------------------------------------------ consuming
    def _apply(self, rid: str, out) -> Update:
        seq = out.seq
        c = self.choices[self._by_rid[rid] * self.n + seq.choice_index]
        c.seq = seq
        now = time.monotonic()
        m = self.state.metrics
        ids = list(out.new_token_ids)
        if ids:
            m.generation_tokens.inc(len(ids))
            if c.first_t is None:
                c.first_t = now
            c.last_t = now
            if not self.first_token_seen:
                self.first_token_seen = True
                m.ttft.observe(now - self.arrival)
        text, lps = out.new_text, list(out.new_logprobs or [])
        if self.discard:
            text, ids, lps = "", [], []
        c.text.append(text)
        c.token_ids.extend(ids)
        c.logprobs.extend(lps)
        if out.finished and c.finish_reason is None:
            fr = getattr(seq.finish_reason, "value", None) or "stop"
            c.finish_reason = "length" if self.discard else fr
            m.finished.labels(c.finish_reason).inc()
            if len(c.token_ids) > 1 and c.first_t is not None:
                m.tpot.observe((c.last_t - c.first_t) / (len(c.token_ids) - 1))
            m.e2e.observe(now - self.arrival)
        return Update(c, text, ids, lps, bool(out.finished))

    async def run(self, on_updates=None) -> None:
        """Consume the engine's outputs until every choice ended (or the timeout hits).

        on_updates(list[Update]) is awaited once per batch of deltas (a streaming writer)."""
        stream = self.stream
        timeout = self.state.request_timeout
        try:
            try:
                async with asyncio.timeout(timeout):
                    async for rid, item in stream:
                        batch = [(rid, item)] + stream.drain_nowait()
                        updates = []
                        for r, it in batch:
                            if isinstance(it, SamplingParamsError):  # (AsyncEngine: an adapter unloaded)
                                raise bad_request(str(it), it.param) from None
                            if isinstance(it, RequestFailed):
                                raise APIError(500, f"generation failed: {it}") from None
                            if isinstance(it, BaseException):
                                raise APIError(500, f"generation failed: {type(it).__name__}: {it}") from None
                            updates.append(self._apply(r, it))
                        if on_updates is not None and updates:
                            await on_updates(updates)
            except TimeoutError:
                log.info("request %s timed out after %.1fs: aborted", self.id, timeout)
                stream.abort()
                for c in self.choices:
                    if c.finish_reason is None:
                        c.finish_reason = "abort"
                        self.state.metrics.finished.labels("abort").inc()
        finally:
            if not stream.done:
                stream.abort()  # client went away (cancelled) or an error: free the blocks now
                for c in self.choices:
                    if c.finish_reason is None:
                        c.finish_reason = "abort"
                        self.state.metrics.finished.labels("abort").inc()

    # ------------------------------------------------------------------ results
    def usage(self) -> Usage:
        prompt = sum(len(p.ids) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        cached = 0
        for p_i in range(len(self.prompts)):
            seq = self.choices[p_i * self.n].seq
            cached += int(getattr(seq, "num_cached_tokens", 0) or 0) if seq is not None else 0
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


# ----------------------------------------------------------------------------- logprob formatting

def safe_lp(x: float) -> float:
    # JSON has no -inf/NaN: report impossible tokens as a very negative number, as vLLM does
    x = float(x)
    return -9999.0 if not math.isfinite(x) else x


def chat_logprobs(state, token_ids: list[int], entries: list) -> list[dict]:
    out = []
    for tid, e in zip(token_ids, entries):
        if e is None:
            continue
        lp, top = e
        s, raw, _ = state.token_piece(tid)
        tops = []
        for a, b in top:
            t, traw, _ = state.token_piece(a)
            tops.append({"token": t, "logprob": safe_lp(b), "bytes": list(traw)})
        out.append({"token": s, "logprob": safe_lp(lp), "bytes": list(raw), "top_logprobs": tops})
    return out


class CompletionLogprobBuilder:
    """Legacy completions logprobs: parallel lists, text offsets counted in characters over the tokens'
    bytes (a token holding part of a character gets the offset where that character starts)."""

    def __init__(self, state, offset: int = 0):
        self.state = state
        self.offset = offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def build(self, token_ids: list[int], entries: list, first_is_null: bool = False) -> dict:
        tokens, lps, tops, offs = [], [], [], []
        for j, tid in enumerate(token_ids):
            s, raw, _ = self.state.token_piece(tid)
            tokens.append(s)
            offs.append(self.offset)
            self.offset += len(self._utf8.decode(raw))
            e = entries[j] if j < len(entries) else None
            if e is None or (first_is_null and j == 0):
                lps.append(None)
                tops.append(None)
                continue
            lp, top = e
            d = {self.state.token_piece(a)[0]: safe_lp(b) for a, b in top}
            d.setdefault(s, safe_lp(lp))  # the chosen token is always listed (up to logprobs+1)
            lps.append(safe_lp(lp))
            tops.append(d)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def merge_completion_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        a[k] = a[k] + b[k]
    return a
