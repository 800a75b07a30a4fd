"""Embedding engine: an encoder model (models/bert.py) compiled once per (batch, length) bucket.

No KV cache and no scheduler: `embed(list of token-id lists)` sorts the inputs by length, packs them
into padded batches whose shapes are among the compiled buckets, and returns one vector per input in
the caller's order. Every bucket is compiled at construction (the executables are called directly, so
an unexpected shape is an error, never a silent compile while serving). The server batches
concurrent requests into one `embed` call (server/embeddings.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.models import bert

log = logging.getLogger(__name__)

MIN_LEN_BUCKET = 16
BATCH_BUCKETS = (1, 4, 16, 64)


def pooling_task(model: str | None, revision: str | None = None, task: str | None = None,
                 hf_overrides: dict | None = None) -> str | None:
    """What `model` (a local directory or a Hub id) is served as: "encoder" (BERT / RoBERTa /
    XLM-RoBERTa), "embed" or "classify" (a decoder pooling model, models/decoder_pooling.py), or None
    (a generative model). task: "generate", "embed" or "classify" overrides the detection for a
    decoder; None or "auto" detects. Anything that does not resolve says None: the generative path
    then reports the problem."""
    from jaxserve.models import decoder_pooling

    if task == "generate" or not model or model.startswith("random:"):
        return None
    if model.endswith(".gguf"):
        return "encoder" if _is_encoder_gguf(model) else None
    d = _config_dir(model, revision)
    if d is None:
        return None
    if bert.is_encoder_dir(d):
        return "encoder"
    if task in ("embed", "classify"):
        return task
    return decoder_pooling.pooling_task(d, hf_overrides)


def _is_encoder_gguf(path: str) -> bool:
    """A local GGUF file of llama.cpp's `bert` architecture (an embedding model)."""
    from jaxserve.loader import gguf_encoder, gguf_loader

    try:
        return Path(path).expanduser().is_file() and gguf_encoder.is_encoder_gguf(gguf_loader.open_gguf(path))
    except Exception:
        return False  # not readable: the generative path reports it


def _config_dir(model: str, revision: str | None) -> Path | None:
    """A directory holding the model's config.json (and its sentence-transformers files), fetched alone
    for a Hub id that is not cached; None when there is none."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path if (path / "config.json").is_file() else None
    if path.exists():
        return None
    try:
        from jaxserve.loader import source

        snap = source._cached_snapshot(model, revision)  # no network when the config is cached
        if snap is not None and (snap / "config.json").is_file():
            return snap
        from huggingface_hub import hf_hub_download  # the config alone, not the whole repo

        d = Path(hf_hub_download(model, "config.json", revision=revision)).parent
        for name in source.EMBEDDING_FILES:  # the pooling files decide a decoder's task
            try:
                hf_hub_download(model, name, revision=revision)
            except Exception:
                pass  # not every model has them
        return d
    except Exception:
        return None


def is_embedding_model(model: str | None, revision: str | None = None, task: str | None = None,
                       hf_overrides: dict | None = None) -> bool:
    """Whether `model` is served by EmbeddingEngine (embeddings, rerank, score, classify) rather than
    generated with."""
    return pooling_task(model, revision, task, hf_overrides) is not None


def relevance(logits: np.ndarray) -> np.ndarray:
    """A one-label cross-encoder's logits [n, 1] -> scores in (0, 1)."""
    return (1.0 / (1.0 + np.exp(-logits[:, 0].astype(np.float64)))).astype(np.float32)


def class_probs(logits: np.ndarray, problem_type: str | None = None) -> np.ndarray:
    """A classifier's logits [n, labels] -> its scores, by the config's problem_type (as transformers'
    pipelines and vLLM): "regression" the logits themselves, "multi_label_classification" a sigmoid
    per label, otherwise a softmax over the labels (one label: its sigmoid)."""
    x = logits.astype(np.float64)
    if problem_type == "regression":
        return logits.astype(np.float32)
    if x.shape[1] == 1 or problem_type == "multi_label_classification":
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def pair_cosines(vecs: np.ndarray, first, second) -> np.ndarray:
    """Cosine similarity of rows first[i] and second[i] of vecs, f32 [len(first)]."""
    unit = vecs / np.maximum(np.linalg.norm(vecs, axis=1), 1e-12)[:, None]
    return np.einsum("nd,nd->n", unit[np.asarray(first, int)], unit[np.asarray(second, int)]).astype(np.float32)


def cosine_to_first(vecs: np.ndarray) -> np.ndarray:
    """Cosine similarity of rows 1.. to row 0 (a query's embedding first, then its documents'), f32 [n - 1]."""
    return pair_cosines(vecs, [0] * (len(vecs) - 1), range(1, len(vecs)))


class EmbeddingInputError(ValueError):
    """An input this model cannot embed (empty, too long, out-of-vocabulary ids): the caller's fault."""

    def __init__(self, message: str, param: str | None = "input"):
        super().__init__(message)
        self.param = param


@dataclass
class _Model:
    """What the server reads of a loaded model (LoadedModel's fields that apply)."""
    name: str
    generation_defaults: dict | None = None


@dataclass(frozen=True)
class _Limits:
    max_model_len: int


class EncoderTokenizer:
    """The checkpoint's tokenizer.json with its special-token template ([CLS] ... [SEP], <s> ... </s>)
    and without the padding/truncation it may carry."""

    chat_template = None
    bos_token = eos_token = None

    def __init__(self, path: Path | None = None, backend=None):
        """path: a tokenizer.json; or backend: a `tokenizers.Tokenizer` (a GGUF file's, loader/gguf_encoder)."""
        from tokenizers import Tokenizer

        self.backend = backend if backend is not None else Tokenizer.from_file(str(path))
        self.backend.no_padding()
        self.backend.no_truncation()
        self._pairs = None  # (max_len, a copy of the tokenizer that truncates pairs' second text)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=True)]

    def encode_pairs(self, query: str, docs: list[str], max_len: int) -> list[tuple[list[int], list[int]]]:
        """(ids, token types) of each (query, doc) pair with the pair template ([CLS] q [SEP] d [SEP]);
        a document too long for max_len is cut (only the document: "only_second"), a query that
        leaves no room is an EmbeddingInputError."""
        if not self._pairs or self._pairs[0] != max_len:
            from tokenizers import Tokenizer

            t = Tokenizer.from_str(self.backend.to_str())
            t.enable_truncation(max_len, strategy="only_second")
            self._pairs = (max_len, t)
        try:
            encs = self._pairs[1].encode_batch([(query, d) for d in docs], add_special_tokens=True)
        except Exception as e:  # the query alone does not fit
            raise EmbeddingInputError(f"the query is too long for this model's {max_len} tokens ({e})", "query")
        return [(e.ids, e.type_ids) for e in encs]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    def token_bytes(self, i: int) -> bytes:
        """The token decoded alone, as UTF-8 (the tokenizer interface's byte view, which /tokenize reads;
        encoder vocabularies here are WordPiece / SentencePiece text pieces)."""
        return (self.decode([i], skip_special_tokens=False) or self.id_to_token(i) or "").encode("utf-8")


def length_buckets(max_len: int) -> list[int]:
    out, t = [], MIN_LEN_BUCKET
    while t < max_len:
        out.append(t)
        t *= 2
    return out + [max_len]


class EmbeddingEngine:
    """Load an encoder model (a local directory or a Hub id of BERT / RoBERTa / XLM-RoBERTa safetensors),
    compile its buckets, and embed token-id lists. max_batch_tokens bounds a batch's padded size."""

    is_embedding = True

    def __init__(self, model: str, *, dtype: str = "float32", max_batch_tokens: int = 8192,
                 max_model_len: int | None = None, warmup: bool = True, revision: str | None = None,
                 task: str | None = None, hf_overrides: dict | None = None):
        """task: for a decoder checkpoint, "embed" or "classify" (None: detected, see pooling_task);
        hf_overrides: config.json fields replaced (vLLM's Qwen3-Reranker recipe, decoder_pooling.OVERRIDE_KEYS)."""
        from jaxserve.loader import source
        from jaxserve.models import decoder_pooling

        t0 = time.perf_counter()
        res = source.resolve_model(model, revision=revision)
        if res.kind == "gguf":  # llama.cpp's `bert` files (loader/gguf_encoder)
            self._from_gguf(model, res, dtype, max_batch_tokens, max_model_len, warmup, hf_overrides, t0)
            return
        d = res.model_dir
        tok_file = (res.tokenizer_dir or d) / "tokenizer.json"
        if not tok_file.is_file():
            raise bert.EncoderConfigError(f"{d}: an embedding model needs tokenizer.json")
        tokenizer = EncoderTokenizer(tok_file)
        if bert.is_encoder_dir(d):
            if hf_overrides:
                raise ValueError("hf_overrides apply to decoder models only")
            self.cfg = bert.config_from_dir(d)
            if max_model_len is not None:
                if max_model_len > self.cfg.max_seq_len:
                    raise ValueError(f"max_model_len {max_model_len} exceeds the model's {self.cfg.max_seq_len} tokens")
                self.cfg = dataclasses.replace(self.cfg, max_seq_len=int(max_model_len))
            weights, forward = bert.load_weights(d, self.cfg, np.dtype(dtype)), bert.embed
        else:
            if task in ("embed", "classify"):
                log.info("%s: pooled for task %s (asked)", model, task)
            else:
                task = decoder_pooling.pooling_task(d, hf_overrides)
                if task is None:
                    raise decoder_pooling.DecoderPoolingError(
                        f"{model} is a generative model; to pool with it pass task 'embed' or 'classify' (--task)")
                log.info("%s: pooled for task %s, decided by its %s (--task generate to generate with it)", model,
                         task, decoder_pooling.task_reason(d, hf_overrides))
            self.cfg = decoder_pooling.config_from_dir(d, task, hf_overrides, max_model_len)
            weights = decoder_pooling.load_weights(d, self.cfg, dtype, tokenizer.backend.token_to_id)
            forward = decoder_pooling.embed
        self._setup(model, tokenizer, weights, max_batch_tokens, t0, warmup, forward)

    def _from_gguf(self, model, res, dtype, max_batch_tokens, max_model_len, warmup, hf_overrides, t0) -> None:
        from jaxserve.loader import gguf_encoder, gguf_loader

        if hf_overrides:
            raise ValueError("hf_overrides apply to decoder models only")
        readers = gguf_loader.open_gguf(res.paths[0])
        if not gguf_encoder.is_encoder_gguf(readers):
            raise bert.EncoderConfigError(f"{model}: a GGUF embedding model must be llama.cpp's 'bert' architecture")
        self.cfg = gguf_encoder.encoder_config(readers)
        if max_model_len is not None:
            if max_model_len > self.cfg.max_seq_len:
                raise ValueError(f"max_model_len {max_model_len} exceeds the model's {self.cfg.max_seq_len} tokens")
            self.cfg = dataclasses.replace(self.cfg, max_seq_len=int(max_model_len))
        tokenizer = EncoderTokenizer(backend=gguf_encoder.tokenizer(readers))
        weights = gguf_encoder.load_weights(readers, self.cfg, np.dtype(dtype))
        self._setup(model, tokenizer, weights, max_batch_tokens, t0, warmup, bert.embed)

    @classmethod
    def random(cls, preset: str, *, dtype: str = "float32", max_batch_tokens: int = 8192,
               warmup: bool = True) -> "EmbeddingEngine":
        """Random weights of a real encoder's shape (bert.PRESETS), no tokenizer: benchmarks on token ids."""
        self = cls.__new__(cls)
        self.cfg = bert.preset(preset)
        self._setup(f"random:{preset}", None, bert.random_weights(self.cfg, dtype=np.dtype(dtype)),
                    max_batch_tokens, time.perf_counter(), warmup, bert.embed)
        return self

    def _setup(self, name, tokenizer, weights, max_batch_tokens, t0, warmup, forward) -> None:
        import jax
        import jax.numpy as jnp

        self.tokenizer = tokenizer
        self.model = _Model(name=name)
        self.ecfg = _Limits(self.cfg.max_seq_len)
        self.dim = self.cfg.hidden_size
        self.weights = jax.device_put(jax.tree.map(jnp.asarray, weights))
        self.load_seconds = time.perf_counter() - t0
        self.max_batch_tokens = int(max_batch_tokens)
        self.buckets = [(b, t) for t in length_buckets(self.cfg.max_seq_len) for b in BATCH_BUCKETS
                        if b == 1 or b * t <= self.max_batch_tokens]
        self._fn = jax.jit(lambda w, ids, types, mask: forward(self.cfg, w, ids, types, mask))
        self.width = self.cfg.num_labels or self.dim  # a row of output: labels' logits or the embedding
        self._exe: dict[tuple[int, int], object] = {}
        if warmup:
            self.warmup()

    # ------------------------------------------------------------------ programs
    def _compile(self, key):
        import jax

        B, T = key
        spec = jax.ShapeDtypeStruct((B, T), np.int32)
        return self._fn.lower(self.weights, spec, spec, spec).compile()

    def warmup(self) -> None:
        t = time.perf_counter()
        for key in self.buckets:
            if key not in self._exe:
                self._exe[key] = self._compile(key)
        log.info("embedding programs: %d compiled in %.1fs", len(self._exe), time.perf_counter() - t)

    def num_compiled(self) -> int:
        return len(self._exe)

    # ------------------------------------------------------------------ inputs
    def check(self, ids: list[int], where: str = "input") -> None:
        if not ids:
            raise EmbeddingInputError(f"{where} is empty", where)
        if len(ids) > self.cfg.max_seq_len:
            raise EmbeddingInputError(f"{where} has {len(ids)} tokens; this model embeds at most "
                                      f"{self.cfg.max_seq_len}", where)
        bad = [t for t in ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise EmbeddingInputError(f"{where}: token id {bad[0]} is out of range [0, {self.cfg.vocab_size})", where)

    def _bucket(self, n: int, T: int) -> tuple[int, int]:
        t = next(t for t in length_buckets(self.cfg.max_seq_len) if t >= T)
        return next(((b, tt) for b, tt in self.buckets if tt == t and b >= n), None) or \
            max(((b, tt) for b, tt in self.buckets if tt == t), key=lambda k: k[0])

    # ------------------------------------------------------------------ embedding
    @property
    def is_classifier(self) -> bool:
        return self.cfg.num_labels > 0

    @property
    def routes(self) -> str:
        """What a server of this model answers (for messages)."""
        if not self.is_classifier:
            return "/v1/embeddings, /v1/rerank, /v1/score"
        return "/v1/classify, /v1/rerank, /v1/score" if self.cfg.num_labels == 1 else "/v1/classify"

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """float32 [len(inputs), dim], row i for inputs[i]. Inputs are checked first (EmbeddingInputError)."""
        if self.is_classifier:
            raise EmbeddingInputError("this model is a sequence classifier (a cross-encoder / reranker): it "
                                      "classifies and scores text pairs (classify, rerank, score), it does not "
                                      "embed", "model")
        return self.run(inputs)

    def check_dimensions(self, dimensions: int | None) -> None:
        """A requested embedding size: the model's own, or for a Matryoshka model (config is_matryoshka /
        matryoshka_dimensions) one it was trained for. EmbeddingInputError otherwise."""
        if dimensions is None or dimensions == self.dim:
            return
        if not getattr(self.cfg, "matryoshka", False):
            raise EmbeddingInputError(f"this model's embeddings have {self.dim} dimensions and cannot be shortened "
                                      "(not a Matryoshka model)", "dimensions")
        allowed = self.cfg.matryoshka_dims
        if not 1 <= dimensions <= self.dim or (allowed and dimensions not in allowed):
            raise EmbeddingInputError(f"dimensions {dimensions}: this model gives "
                                      f"{', '.join(map(str, allowed)) if allowed else f'1 to {self.dim}'}",
                                      "dimensions")

    def shorten(self, vecs: np.ndarray, dimensions: int | None) -> np.ndarray:
        """Matryoshka: the first `dimensions` of each embedding, normalized again if the model normalizes."""
        self.check_dimensions(dimensions)
        if dimensions is None or dimensions == self.dim:
            return vecs
        v = vecs[:, :dimensions]
        if self.cfg.normalize:
            v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(v, np.float32)

    def classify(self, inputs: list[list[int]]) -> np.ndarray:
        """Class probabilities float32 [len(inputs), num_labels] of a classifier (class_probs)."""
        if not self.is_classifier:
            raise EmbeddingInputError("this model embeds; classification needs a sequence-classification model",
                                      "model")
        return class_probs(self.run(inputs), self.cfg.problem_type)

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> np.ndarray:
        """Relevance of encoded text pairs (ids, token types), float32 [n]: a one-label cross-encoder's
        sigmoid (sentence-transformers' CrossEncoder default)."""
        if self.cfg.num_labels != 1:
            raise EmbeddingInputError(f"scoring needs a one-label cross-encoder; this model has "
                                      f"{self.cfg.num_labels or 'no'} labels", "model")
        return relevance(self.run([ids for ids, _ in pairs], [types for _, types in pairs]))

    def run(self, inputs: list[list[int]], types: list[list[int]] | None = None) -> np.ndarray:
        """The model's output rows (embeddings, or a classifier's logits) for token-id lists, with
        their token types (segments; zeros when None), in order."""
        for i, ids in enumerate(inputs):
            self.check(ids, f"input[{i}]" if len(inputs) > 1 else "input")
        if self.cfg.type_vocab_size == 1:
            types = None  # RoBERTa-style: one segment whatever the tokenizer's pair template says
        out = np.zeros((len(inputs), self.width), np.float32)
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        lens = length_buckets(self.cfg.max_seq_len)
        bucket_of = [next(t for t in lens if t >= len(inputs[i])) for i in order]
        pos = 0
        while pos < len(order):
            # the longest remaining input fixes the length bucket; a batch holds inputs of that bucket only
            # (a short input is not padded to a long one's length), as many as its largest batch holds
            same = bucket_of[pos:].count(bucket_of[pos])
            B, T = self._bucket(same, len(inputs[order[pos]]))
            rows = order[pos:pos + min(B, same)]
            pos += len(rows)
            ids = np.zeros((B, T), np.int32)
            tt = np.zeros((B, T), np.int32)
            mask = np.zeros((B, T), np.int32)
            for r, i in enumerate(rows):
                ids[r, :len(inputs[i])] = inputs[i]
                if types is not None:
                    tt[r, :len(types[i])] = types[i]
                mask[r, :len(inputs[i])] = 1
            mask[len(rows):, 0] = 1  # padding rows: one visible token, so no row is all masked
            exe = self._exe.get((B, T))
            if exe is None:  # warmup=False: compile on first use (offline scripts that skip warm-up)
                exe = self._exe[(B, T)] = self._compile((B, T))
            vecs = np.asarray(exe(self.weights, ids, tt, mask))
            out[rows] = vecs[:len(rows)]
        return out

