"""POST /v1/embeddings, /rerank and /score, and the batcher that runs concurrent requests' inputs together.

Served when the model is an embedding model (engine/embedder.py); a generative model answers 400.
`input`: a string, a list of strings, a token-id list or a list of token-id lists (at most 2048
inputs, each at most the model's max_seq_len tokens: longer is a 400, not a silent truncation);
`encoding_format` "float" (default) or "base64" (little-endian float32, what the `openai` client asks
for by default); `dimensions` only as the model's own size. `/rerank` (Cohere / Jina: query + documents, top_n,
return_documents) and `/score` (vLLM: text_1 against text_2) score with a cross-encoder (a
sequence-classification checkpoint with one label: the sigmoid of its logit) or, with an embedding
model, the cosine similarity of the embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import queue
import threading
import time
import uuid
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

    async def run(self, ids: list[list[int]], types: list[list[int]] | None = None) -> np.ndarray:
        """The engine's output rows (embeddings, or a cross-encoder's logits) for these inputs."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((ids, types or [[] for _ in ids], fut, loop))
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
                vecs = self.engine.run([ids for job in jobs for ids in job[0]], [t for job in jobs for t in job[1]])
            except BaseException as e:  # inputs were checked per request: a failure here is the engine's
                log.exception("embedding batch failed")
                for *_, fut, loop in jobs:
                    _hand(loop, lambda f=fut, err=e: f.done() or f.set_exception(RuntimeError(str(err))))
                continue
            start = 0
            for ids, _, fut, loop in jobs:
                part = vecs[start:start + len(ids)]
                start += len(ids)
                _hand(loop, lambda f=fut, v=part: f.done() or f.set_result(v))


def _hand(loop, fn) -> None:
    """Deliver a result to a request's event loop; a loop that is gone (shutdown) must not end the thread."""
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:
        log.debug("embedding result for a closed event loop dropped")


def _inputs(state, req) -> list[list[int]]:
    """The request's `input` as checked token-id lists (texts tokenized with the model's template)."""
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
    _need_encoder(state, model)
    if state.engine.is_classifier:
        raise bad_request(f"the model `{model}` is a sequence classifier: it serves {state.engine.routes}, it "
                          "does not embed", "model", "model_not_supported")
    from jaxserve.engine.embedder import EmbeddingInputError

    try:
        state.engine.check_dimensions(req.dimensions)
    except EmbeddingInputError as e:
        raise bad_request(str(e), "dimensions", "unsupported_parameter") from None
    # tokenizing and checking up to 2048 inputs: off the event loop
    ids = await asyncio.get_running_loop().run_in_executor(None, _inputs, state, req)
    vecs = state.engine.shorten(await _run(state, ids), req.dimensions)
    b64 = req.encoding_format == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if b64 else v.tolist()}
            for i, v in enumerate(vecs)]
    n = sum(len(x) for x in ids)
    state.metrics.prompt_tokens.inc(n)
    return web.json_response({"object": "list", "data": data, "model": model,
                              "usage": {"prompt_tokens": n, "total_tokens": n}})


async def _run(state, ids, types=None) -> np.ndarray:
    try:
        return await state.embedder.run(ids, types)
    except Exception as e:
        raise APIError(500, f"the model failed: {e}") from None


def _need_encoder(state, model: str) -> None:
    if state.embedder is None:
        raise bad_request(f"the model `{model}` generates text and does not serve embeddings, scores or classes; "
                          "start jaxserve with a pooling model (an encoder or decoder embedding model, a "
                          "cross-encoder / reranker or sequence classifier; --task embed|classify)", "model",
                          "model_not_supported")


class ClassifyRequest(_Req):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    user: str | None = None


async def classify(request: web.Request, state, body) -> web.Response:
    """vLLM's /classify: each input's class probabilities (softmax over the labels; one label: its
    sigmoid) and the most likely label's name."""
    from jaxserve.engine.embedder import class_probs

    req = parse_request(ClassifyRequest, body)
    model = state.check_model(req.model)
    _need_encoder(state, model)
    eng = state.engine
    if not eng.is_classifier:
        raise bad_request(f"the model `{model}` is an embedding model: classification needs a "
                          "sequence-classification model", "model", "model_not_supported")
    ids = await asyncio.get_running_loop().run_in_executor(None, _inputs, state, req)
    probs = class_probs(await _run(state, ids), eng.cfg.problem_type)
    labels = eng.cfg.labels or tuple(f"LABEL_{i}" for i in range(probs.shape[1]))
    data = [{"index": i, "object": "classification", "label": labels[int(np.argmax(p))], "probs": p.tolist(),
             "num_classes": int(p.shape[0])} for i, p in enumerate(probs)]
    n = sum(len(x) for x in ids)
    state.metrics.prompt_tokens.inc(n)
    return web.json_response({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": model, "data": data,
                              "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})


# ----------------------------------------------------------------------------- rerank and score

class RerankRequest(_Req):
    query: str
    documents: list[str | dict[str, str]]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool | None = None
    max_chunks_per_doc: int | None = None  # Cohere v1: accepted, documents are not chunked (they are cut)


class ScoreRequest(_Req):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    encoding_format: str | None = None  # vLLM accepts it; scores are plain numbers either way


def _encode_pairs(eng, t1: list[str], t2: list[str]) -> list[tuple[list[int], list[int]]]:
    """(ids, token types) of each pair (t1[i], t2[i]) with the tokenizer's pair template, in order
    (pairs that share their first text are tokenized together)."""
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(t1):
        groups.setdefault(a, []).append(i)
    out: list = [None] * len(t1)
    for a, idx in groups.items():
        for i, p in zip(idx, eng.tokenizer.encode_pairs(a, [t2[i] for i in idx], eng.cfg.max_seq_len)):
            out[i] = p
    return out


def _encode_texts(eng, texts: list[str], where: list[str]) -> list[list[int]]:
    ids = eng.tokenizer.encode_batch(texts)
    for x, w in zip(ids, where):
        eng.check(x, w)
    return ids


async def _pair_scores(state, t1: list[str], t2: list[str], param: str,
                       names: tuple[str, str] = ("text_1", "text_2")) -> tuple[np.ndarray, int]:
    """(relevance of each pair (t1[i], t2[i]), tokens read), all pairs in one engine run: a one-label
    classifier's sigmoid over the pair, or for an embedding model the cosine similarity of the two
    texts' embeddings (as vLLM scores with them; each distinct text embedded once). Tokenized off the
    event loop."""
    from jaxserve.engine.embedder import EmbeddingInputError, pair_cosines, relevance

    eng = state.engine
    if eng.is_classifier and eng.cfg.num_labels != 1:
        raise bad_request(f"this classifier has {eng.cfg.num_labels} labels; rerank and score need a "
                          "one-label model (a relevance logit); use /v1/classify", "model", "model_not_supported")
    if any(not a for a in t1):
        raise bad_request(f"{names[0]} is empty", param)
    if any(not d for d in t2):
        raise bad_request(f"a text of {names[1]} is empty", param)
    loop = asyncio.get_running_loop()
    try:
        if eng.is_classifier:
            pairs = await loop.run_in_executor(None, _encode_pairs, eng, t1, t2)
            logits = await _run(state, [p[0] for p in pairs], [p[1] for p in pairs])
            return relevance(logits), sum(len(p[0]) for p in pairs)
        where = {}
        for i, a in enumerate(t1):
            where.setdefault(a, names[0] if len(set(t1)) == 1 else f"{names[0]}[{i}]")
        for i, b in enumerate(t2):
            where.setdefault(b, f"{names[1]}[{i}]")
        texts = list(where)
        ids = await loop.run_in_executor(None, _encode_texts, eng, texts, list(where.values()))
    except EmbeddingInputError as e:
        raise bad_request(str(e), param) from None
    vecs = await _run(state, ids)
    row = {t: i for i, t in enumerate(texts)}
    return pair_cosines(vecs, [row[a] for a in t1], [row[b] for b in t2]), sum(len(x) for x in ids)


async def rerank(request: web.Request, state, body) -> web.Response:
    """Cohere / Jina style: documents ordered by relevance to the query."""
    req = parse_request(RerankRequest, body)
    model = state.check_model(req.model)
    _need_encoder(state, model)
    docs = [d if isinstance(d, str) else d.get("text") for d in req.documents]
    if not docs or any(not isinstance(d, str) for d in docs):
        raise bad_request("documents must be a non-empty list of strings or {\"text\": ...} objects", "documents")
    if len(docs) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} documents per request, got {len(docs)}", "documents")
    if req.top_n is not None and req.top_n < 1:
        raise bad_request(f"top_n must be >= 1, got {req.top_n}", "top_n")
    scores, n = await _pair_scores(state, [req.query] * len(docs), docs, "documents", ("query", "documents"))
    state.metrics.prompt_tokens.inc(n)
    order = sorted(range(len(docs)), key=lambda i: -float(scores[i]))[:req.top_n or len(docs)]
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": docs[i]}} if req.return_documents is not False else {})} for i in order]
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                              "usage": {"total_tokens": n}})


async def score(request: web.Request, state, body) -> web.Response:
    """vLLM's /score: text_1 against each of text_2 (one to many), or pairwise (two lists of one length)."""
    req = parse_request(ScoreRequest, body)
    model = state.check_model(req.model)
    _need_encoder(state, model)
    t1 = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
    t2 = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
    if not t1 or not t2:
        raise bad_request("text_1 and text_2 must not be empty", "text_1" if not t1 else "text_2")
    if len(t1) == 1:
        t1 = t1 * len(t2)
    if len(t1) != len(t2):
        raise bad_request(f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1, or lists of one "
                          "length", "text_2")
    if len(t2) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} pairs per request, got {len(t2)}", "text_2")
    scores, n = await _pair_scores(state, t1, t2, "text_2")
    state.metrics.prompt_tokens.inc(n)
    out = [{"index": i, "object": "score", "score": float(v)} for i, v in enumerate(scores)]
    return web.json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": model, "data": out, "usage": {"prompt_tokens": n, "total_tokens": n}})
