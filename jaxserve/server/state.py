"""What the request handlers share: the engine, the served names, sampling defaults, metrics."""

from __future__ import annotations

import collections
import logging
import math
import time

from jaxserve.server.errors import APIError
from jaxserve.server.metrics import Metrics

log = logging.getLogger("jaxserve.server")

_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty")
# generation_config.json keys that carry sampling defaults (as vLLM reads them)
_GEN_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def evict_oldest(store: collections.OrderedDict, max_entries: int, max_bytes: int) -> None:
    """The in-memory stores (responses, conversations): past max_entries entries or max_bytes of their
    entries' "bytes", the oldest go first, but never one that holds a running "task" (a background
    response: GET, cancel and DELETE must find it)."""
    total = sum(e["bytes"] for e in store.values())
    while len(store) > max_entries or (total > max_bytes and len(store) > 1):
        key = next((k for k, e in store.items() if "task" not in e), None)
        if key is None:
            return
        total -= store.pop(key)["bytes"]


class ServerState:
    def __init__(self, args):
        self.args = args
        self.engine = None  # LLMEngine, once loaded
        self.aengine = None  # AsyncEngine, once started (None for an embedding model)
        self.embedder = None  # server/embeddings.EmbedBatcher when the model is an embedding model
        self.template = None
        self.template_error: str | None = None
        self.ready = False
        self.shutting_down = False
        self.load_error: str | None = None
        self.created = int(time.time())
        self.request_timeout = float(getattr(args, "request_timeout", None) or 0) or None
        names = [n.strip() for n in (getattr(args, "served_model_name", None) or "").split(",") if n.strip()]
        self.served_names = names
        self.accepted_names: set[str] = set(names)
        self.adapters: dict[str, str] = {}  # multi-LoRA: served adapter name -> its directory
        self.defaults: dict = {}
        self.metrics = Metrics(self._engine_stats)
        self._token_text: dict[int, tuple[str, bytes, str]] = {}
        # /v1/responses kept for previous_response_id and GET (server/responses.py): id -> entry, oldest first
        self.responses: collections.OrderedDict = collections.OrderedDict()
        # /v1/conversations (server/conversations.py): id -> {"conversation", "items", "bytes"}, oldest first
        self.conversations: collections.OrderedDict = collections.OrderedDict()
        self.background_tasks: set = set()  # background responses' tasks (the loop keeps only weak references)

    def _engine_stats(self) -> dict | None:
        if self.aengine is not None:
            return self.aengine.stats
        return {} if self.embedder is not None else None  # an embedding model: ready, no KV cache

    # ------------------------------------------------------------------ set-up (after load)
    def attach(self, engine, aengine) -> None:
        from jaxserve.loader.chat_template import ChatTemplate

        self.engine, self.aengine = engine, aengine
        model_arg = getattr(self.args, "model", None)
        weights = getattr(self.args, "weights_path", None)
        if not self.served_names:
            self.served_names = [engine.model.name]
        # the served name(s), the model path/id given on the command line and the resolved name
        self.accepted_names |= {n for n in (model_arg, weights, engine.model.name) if n}
        self.accepted_names |= set(self.served_names)
        self.adapters = dict(getattr(engine, "lora_paths", {}))
        self.lora_scales: dict[str, float] = {}  # POST /lora-adapters: what requests naming none run with
        self.defaults = self._sampling_defaults(engine.model.generation_defaults or {})
        if getattr(engine, "is_embedding", False):
            from jaxserve.server.embeddings import EmbedBatcher

            self.embedder = EmbedBatcher(engine)
            self.template_error = (f"`{self.model_name}` is a pooling model: it serves {engine.routes} only (a "
                                   "decoder model generates when jaxserve is started with --task generate)")
            return
        tok = engine.tokenizer
        try:
            self.template = ChatTemplate(getattr(tok, "chat_template", None), getattr(tok, "bos_token", None),
                                         getattr(tok, "eos_token", None))
        except Exception as e:  # no template or one that does not compile: chat requests get a 400
            self.template_error = str(e)
            log.warning("chat endpoint disabled: %s", e)

    def _sampling_defaults(self, gen: dict) -> dict:
        d = {}
        for k in _GEN_CONFIG_KEYS:
            v = gen.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                d[k] = int(v) if k == "top_k" else float(v)
        for k in _DEFAULT_KEYS:  # command-line flags win over generation_config
            v = getattr(self.args, k, None)
            if v is not None:
                d[k] = v
        return d

    # ------------------------------------------------------------------ helpers for handlers
    @property
    def model_name(self) -> str:
        return self.served_names[0] if self.served_names else (getattr(self.args, "model", None) or "unknown")

    def check_model(self, name: str | None) -> str:
        """The name to report for a request's `model`; unknown names are a 404 (not an alias)."""
        if name is None or name == "":
            return self.model_name
        if name in self.accepted_names:
            return name if name in self.served_names else self.model_name
        if name in self.adapters:
            return name
        raise APIError(404, f"The model `{name}` does not exist. Served: "
                       f"{', '.join(self.served_names + list(self.adapters))}", "model", "model_not_found")

    def lora_for(self, req):
        """The adapter(s) a generation request runs with: llama.cpp's `lora` [{id, scale}] (a mixture by
        adapter id = slot - 1, see /lora-adapters), else an adapter named as its model, else the scales set
        through POST /lora-adapters (none by default: the base model)."""
        if req.lora is None:
            return self.lora_of(req.model) or (dict(self.lora_scales) or None)
        if self.lora_of(req.model):
            raise APIError(400, "name the base model as `model` when `lora` picks the adapters", "lora")
        names = self.lora_ids()
        mix = {}
        for i, item in enumerate(req.lora):
            if item.id not in names:
                raise APIError(400, f"lora[{i}].id {item.id} is not a loaded LoRA adapter (loaded: "
                               f"{', '.join(f'{k}={v}' for k, v in names.items()) or 'none'})", "lora")
            mix[names[item.id]] = mix.get(names[item.id], 0.0) + item.scale
        return mix

    def lora_ids(self) -> dict[int, str]:
        """llama.cpp's adapter ids: adapter slot - 1 -> name, for the adapters loaded now."""
        return {s - 1: n for n, s in self.engine.lora.slot_of.items()} if hasattr(self.engine, "lora") else {}

    def lora_of(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (after check_model), or None for the base model."""
        return name if name in self.adapters else None

    def require_generative(self) -> None:
        if self.embedder is not None:
            raise APIError(400, f"the model `{self.model_name}` is a pooling model: it serves "
                           f"{self.engine.routes}, not text generation (a decoder model generates when jaxserve "
                           "is started with --task generate)", "model", "model_not_supported")

    def require_ready(self) -> None:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down")
        if not self.ready:
            raise APIError(503, "the model is still loading; poll /health until it answers 200")

    def token_text(self, tid: int) -> str:
        """Text of one token as it reads alone (for /tokenize); cached per id."""
        return self.token_piece(tid)[2]

    def token_piece(self, tid: int) -> tuple[str, bytes, str]:
        """(logprob token string, its bytes, its text decoded alone) of one token; cached per id. A token
        holding part of a UTF-8 character is named by its bytes, "bytes:\\xf0\\x9f" (OpenAI's form),
        so that such tokens stay distinct and `bytes` rebuilds the text."""
        got = self._token_text.get(tid)
        if got is None:
            tok = self.engine.tokenizer
            try:
                alone = tok.decode([tid], skip_special_tokens=False)
            except Exception:
                alone = ""
            alone = alone or tok.id_to_token(tid) or ""
            raw = tok.token_bytes(tid)
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            got = self._token_text[tid] = (name, raw, alone)
        return got
