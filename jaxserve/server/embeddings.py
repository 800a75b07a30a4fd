"""POST /v1/embeddings, and the batcher that runs concurrent requests' inputs together.

Served when the model is an embedding model (engine/embedder.py); a generative model answers 400.
`input`: a string, a list of strings, a token-id list or a list of token-id lists (at most 2048
inputs, each at most the model's max_seq_len tokens: longer is a 400, not a silent truncation);
`encoding_format` "float" (default) or "base64" (little-endian float32, what the `openai` client asks
for by default); `dimensions` only as the model's own size.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import queue
import threading
from typing import Literal

import numpy as np
from aiohttp import web

from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import _Req, parse_request

log = logging.getLogger("jaxserve.server")

MAX_INPUTS = 2048


class EmbeddingRequest(_Req):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None  # accepted and ignored, as on the other endpoints


class EmbedBatcher:
    """One worker thread runs the embedding engine; inputs of requests that arrive while a batch runs
    are embedded together in the next one (up to max_batch_inputs)."""

    def __init__(self, engine, max_batch_inputs: int = 256):
        self.engine = engine
        self.max_batch_inputs = max_batch_inputs
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="jaxserve-embed", daemon=True)
        self._thread.start()

    async def embed(self, ids: list[list[int]]) -> np.ndarray:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((ids, fut, loop))
        return await fut

    def _work(self) -> None:
        while True:
            jobs = [self._q.get()]
            n = len(jobs[0][0])
            while n < self.max_batch_inputs:
                try:
                    job = self._q.get_nowait()
                except queue.Empty:
                    break
                jobs.append(job)
                n += len(job[0])
            try:
                vecs = self.engine.embed([ids for job in jobs for ids in job[0]])
            except Exception as e:  # inputs were checked per request: a failure here is the engine's
                log.exception("embedding batch failed")
                for _, fut, loop in jobs:
                    loop.call_soon_threadsafe(lambda f=fut, err=e: f.done() or f.set_exception(err))
                continue
            start = 0
            for ids, fut, loop in jobs:
                part = vecs[start:start + len(ids)]
                start += len(ids)
                loop.call_soon_threadsafe(lambda f=fut, v=part: f.done() or f.set_result(v))


def _inputs(state, req: EmbeddingRequest) -> list[list[int]]:
    inp = req.input
    if isinstance(inp, str) or (isinstance(inp, list) and inp and isinstance(inp[0], int)):
        inp = [inp]
    if not inp:
        raise bad_request("input must not be an empty list", "input")
    if len(inp) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request, got {len(inp)}", "input")
    eng = state.engine
    texts = [x for x in inp if isinstance(x, str)]
    encoded = iter(eng.tokenizer.encode_batch(texts)) if texts else iter(())
    ids = []
    for i, x in enumerate(inp):
        where = "input" if len(inp) == 1 else f"input[{i}]"
        if isinstance(x, str) and not x:
            raise bad_request(f"{where} is an empty string", "input")
        one = next(encoded) if isinstance(x, str) else list(x)
        try:
            eng.check(one, where)
        except ValueError as e:
            raise bad_request(str(e), "input") from None
        ids.append(one)
    return ids


async def embeddings(request: web.Request, state, body) -> web.Response:
    req = parse_request(EmbeddingRequest, body)
    model = state.check_model(req.model)
    if state.embedder is None:
        raise bad_request(f"the model `{model}` generates text and does not serve embeddings; start jaxserve "
                          "with an embedding model (a BERT / RoBERTa / XLM-RoBERTa sentence-transformers "
                          "checkpoint)", "model", "model_not_supported")
    dim = state.engine.dim
    if req.dimensions is not None and req.dimensions != dim:
        raise bad_request(f"dimensions: this model's embeddings have {dim} dimensions and cannot be shortened",
                          "dimensions", "unsupported_parameter")
    ids = _inputs(state, req)
    try:
        vecs = await state.embedder.embed(ids)
    except Exception as e:
        raise APIError(500, f"embedding failed: {e}") from None
    b64 = req.encoding_format == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if b64 else v.tolist()}
            for i, v in enumerate(vecs)]
    n = sum(len(x) for x in ids)
    state.metrics.prompt_tokens.inc(n)
    return web.json_response({"object": "list", "data": data, "model": model,
                              "usage": {"prompt_tokens": n, "total_tokens": n}})
