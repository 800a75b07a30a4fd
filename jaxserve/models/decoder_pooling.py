"""Decoder models (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3) as pooling models: sentence embeddings
(Qwen3-Embedding, gte-Qwen2, e5-mistral...: last-token pooling) and sequence classifiers / rerankers
(`*ForSequenceClassification`: a score head on the last token; Qwen3-Reranker through vLLM's
`classifier_from_token` overrides).

One causal pass over a padded batch [B, T] with no KV cache, through the same decoder blocks as
generation (models/transformer.py, `kv=None`); attention is the dense causal attention below, in
query chunks so that long inputs stay within memory. engine/embedder.py compiles it per (batch, length)
bucket exactly as it does the encoders (models/bert.py), and reads the same config fields from
DecoderPoolingConfig.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.pooling import PoolingConfigError, at_index, has_pooling_module, pool_rows, read_pooling

DEFAULT_MAX_LEN = 8192  # inputs longer than this need --max-model-len (dense attention per input)
Q_CHUNK = 512  # queries per attention block for inputs longer than this
# vLLM's `hf_overrides` keys that turn a causal LM into a classifier (its Qwen3-Reranker recipe)
OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker", "method",
                 "is_matryoshka", "matryoshka_dimensions")


class DecoderPoolingError(ValueError):
    """A decoder checkpoint or override this server cannot pool with (one line naming what)."""


@dataclass(frozen=True)
class DecoderPoolingConfig:
    model: ModelConfig
    pooling: str = "lasttoken"
    normalize: bool = True
    max_seq_len: int = DEFAULT_MAX_LEN
    num_labels: int = 0  # > 0: a classifier (score head on the last token), no pooling
    labels: tuple[str, ...] = ()
    pad_token_id: int | None = None  # classifiers take the last token that is not padding (as transformers)
    from_tokens: tuple[str, ...] = ()  # the head is these tokens' rows of lm_head (classifier_from_token)
    two_way: bool = False  # ... reduced to one logit: row[1] - row[0] (softmax over two tokens = its sigmoid)
    tied: bool = False  # the checkpoint's output projection is its embedding (tie_word_embeddings)
    problem_type: str | None = None  # config problem_type: how /classify turns logits into scores
    type_vocab_size: int = 1  # one segment: token types are ignored
    # Matryoshka embeddings (config is_matryoshka / matryoshka_dimensions): `dimensions` may shorten them
    matryoshka: bool = False
    matryoshka_dims: tuple[int, ...] = ()  # the sizes allowed (empty: any size up to hidden_size)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size


def _config_json(d: Path, overrides: dict | None) -> dict:
    c = json.loads((Path(d) / "config.json").read_text())
    return {**c, **(overrides or {})}


def pooling_task(d: Path, overrides: dict | None = None) -> str | None:
    """"embed" or "classify" when the decoder checkpoint in `d` is a pooling model (sentence-transformers
    files with a Pooling module, a bare `*Model`, or a `*ForSequenceClassification`), else None."""
    from jaxserve.loader.hf_config import SUPPORTED_MODEL_TYPES

    try:
        c = _config_json(d, overrides)
    except (OSError, ValueError):
        return None
    if c.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return None
    archs = c.get("architectures") or []
    archs = [str(a) for a in (archs if isinstance(archs, list) else [archs])]
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "classify"
    # a bare base model (Qwen3Model, MistralModel), not a head such as Qwen2ForRewardModel
    if has_pooling_module(Path(d)) or (archs and all(a.endswith("Model") and "For" not in a for a in archs)):
        return "embed"
    return None


def task_reason(d: Path, overrides: dict | None = None) -> str:
    """Why pooling_task decided what it did (logged at start-up)."""
    c = _config_json(d, overrides)
    archs = c.get("architectures") or []
    if has_pooling_module(Path(d)):
        return f"sentence-transformers pooling files (modules.json) beside architectures {archs}"
    return f"architectures {archs}"


_OVERRIDE_TYPES = {"architectures": list, "classifier_from_token": list, "is_original_qwen3_reranker": bool,
                   "method": str, "is_matryoshka": bool, "matryoshka_dimensions": list}


def check_overrides(overrides: dict | None) -> dict:
    if overrides is not None and not isinstance(overrides, dict):
        raise DecoderPoolingError("hf_overrides must be a JSON object")
    unknown = sorted(set(overrides or {}) - set(OVERRIDE_KEYS))
    if unknown:
        raise DecoderPoolingError(f"hf_overrides: unsupported key(s) {unknown}; supported: {', '.join(OVERRIDE_KEYS)}")
    for k, v in (overrides or {}).items():
        if not isinstance(v, _OVERRIDE_TYPES[k]):
            raise DecoderPoolingError(f"hf_overrides: {k} must be a {_OVERRIDE_TYPES[k].__name__}, got {v!r}")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0
               for x in (overrides or {}).get("matryoshka_dimensions", [])):
        raise DecoderPoolingError("hf_overrides: matryoshka_dimensions must be positive integers")
    return dict(overrides or {})


def config_from_dir(d: str | Path, task: str, overrides: dict | None = None,
                    max_model_len: int | None = None) -> DecoderPoolingConfig:
    """The pooling config of decoder checkpoint `d` for task "embed" or "classify"."""
    from jaxserve.loader.hf_config import model_config_from_hf
    from jaxserve.models import bert

    d = Path(d)
    c = _config_json(d, check_overrides(overrides))
    if c.get("is_causal") is False:
        raise DecoderPoolingError(f"{d}/config.json: is_causal false (bidirectional attention) is not supported")
    base = model_config_from_hf(c)
    cfg = dataclasses.replace(base, tie_word_embeddings=True)  # no lm_head is read
    limit = cfg.max_position_embeddings
    st = d / "sentence_bert_config.json"
    if st.is_file():
        limit = min(limit, int(json.loads(st.read_text()).get("max_seq_length") or limit))
    if max_model_len is not None:
        if max_model_len > limit:
            raise DecoderPoolingError(f"max_model_len {max_model_len} exceeds the model's {limit} tokens")
        limit = int(max_model_len)
    else:
        limit = min(limit, DEFAULT_MAX_LEN)
    out = DecoderPoolingConfig(model=cfg, max_seq_len=limit, pad_token_id=cfg.pad_token_id,
                               tied=base.tie_word_embeddings, problem_type=c.get("problem_type"))
    if task == "embed":
        try:
            pooling, normalize = read_pooling(d, ("lasttoken", True))  # vLLM's default for decoders
        except PoolingConfigError as e:
            raise DecoderPoolingError(str(e)) from None
        dims = tuple(int(x) for x in c.get("matryoshka_dimensions") or ())
        return dataclasses.replace(out, pooling=pooling, normalize=normalize, matryoshka_dims=dims,
                                   matryoshka=bool(c.get("is_matryoshka")) or bool(dims))
    if task != "classify":
        raise DecoderPoolingError(f"unknown pooling task {task!r}")
    tokens = tuple(str(t) for t in c.get("classifier_from_token") or ())
    two_way = bool(c.get("is_original_qwen3_reranker")) or c.get("method") == "from_2_way_softmax"
    if two_way and len(tokens) != 2:
        raise DecoderPoolingError("is_original_qwen3_reranker needs classifier_from_token with two tokens "
                                  "(e.g. [\"no\", \"yes\"])")
    if tokens:
        n, labels = (1, (tokens[1],)) if two_way else (len(tokens), tokens)
    else:
        n, labels = bert.head_labels(c)
    # a causal LM's own next-token logits come from the last token, padding id or not
    pad = None if tokens else out.pad_token_id
    return dataclasses.replace(out, num_labels=n, labels=labels, from_tokens=tokens, two_way=two_way,
                               pad_token_id=pad)


def _read_tensor(d: Path, names: tuple[str, ...]):
    """The first of `names` (in that order) that the checkpoint's safetensors files hold, memory-mapped;
    None when none is there."""
    from jaxserve.loader.safetensors_loader import _map_tensor, checkpoint_files, read_header

    headers = [(f, *read_header(f)) for f in checkpoint_files(d)]
    for n in names:
        for f, start, header in headers:
            if n in header:
                return _map_tensor(f, start, n, header[n])
    return None


def load_head(d: str | Path, pcfg: DecoderPoolingConfig, token_id) -> dict:
    """The classifier head {w [D, labels], b [labels]} (f32): the checkpoint's `score` layer, or rows
    of its output projection for `from_tokens` (token_id: token string -> id, or None)."""
    d = Path(d)
    D = pcfg.hidden_size
    if pcfg.from_tokens:
        names = ("lm_head.weight",) + (("model.embed_tokens.weight", "embed_tokens.weight") if pcfg.tied else ())
        rows = _read_tensor(d, names)
        if rows is None or rows.ndim != 2 or rows.shape[1] != D:
            raise DecoderPoolingError(f"{d}: classifier_from_token needs the output projection as a dense "
                                      f"{'lm_head.weight' if not pcfg.tied else 'embedding'} [vocab, {D}]")
        ids = []
        for t in pcfg.from_tokens:
            i = token_id(t)
            if i is None:
                raise DecoderPoolingError(f"classifier_from_token: {t!r} is not one token of this tokenizer")
            ids.append(int(i))
        w = np.asarray(rows[ids], np.float32)
        if pcfg.two_way:
            w = w[1:] - w[:1]
        return {"w": np.ascontiguousarray(w.T), "b": np.zeros(pcfg.num_labels, np.float32)}
    w = _read_tensor(d, ("score.weight",))
    if w is None:
        raise DecoderPoolingError(f"{d}: no classifier head (score.weight); a causal LM classifies through "
                                  "hf_overrides classifier_from_token (e.g. Qwen3-Reranker's [\"no\", \"yes\"])")
    if tuple(w.shape) != (pcfg.num_labels, D):
        raise DecoderPoolingError(f"score.weight is {tuple(w.shape)}, the config says {pcfg.num_labels} labels "
                                  f"of {D}")
    b = _read_tensor(d, ("score.bias",))
    return {"w": np.ascontiguousarray(np.asarray(w, np.float32).T),
            "b": np.zeros(pcfg.num_labels, np.float32) if b is None else np.asarray(b, np.float32)}


def load_weights(d: str | Path, pcfg: DecoderPoolingConfig, dtype, token_id=None) -> dict:
    """The decoder's weights (engine/model_loading.load_model, without its lm_head) and, for a classifier,
    its head."""
    from jaxserve.engine.llm_engine import load_model

    weights = dict(load_model(str(d), dtype=np.dtype(dtype).name, lm_head=False).weights)
    if pcfg.num_labels:
        weights["head"] = load_head(d, pcfg, token_id)
    return weights


# ----------------------------------------------------------------------------------------- forward

def causal_attention(q, k, v, positions, *, rows: int, scale, window=0, softcap=None):
    """Causal attention within each of `rows` equal-length rows of a flat batch: q [T, H, hd], k/v
    [T, KV, hd] (GQA), positions [T] (0.. in each row). Sliding window (traced int; 0 = none) and
    soft-cap as the paged kernels. Rows longer than Q_CHUNK go a query block at a time (scores of one
    block at once, not of the whole row; the last block padded)."""
    import jax
    import jax.numpy as jnp

    T, H, hd = q.shape
    KV = k.shape[1]
    G, R = H // KV, T // rows
    # heads before tokens: batched matmuls over (row, head), the layout XLA:CPU runs fastest (models/bert.py)
    qh = (q.astype(jnp.float32) * scale).reshape(rows, R, KV, G, hd).transpose(0, 2, 3, 1, 4)
    kh = k.astype(jnp.float32).reshape(rows, R, KV, hd).transpose(0, 2, 1, 3)[:, :, None]
    vh = v.astype(jnp.float32).reshape(rows, R, KV, hd).transpose(0, 2, 1, 3)[:, :, None]
    kpos = positions.reshape(rows, R)
    window = jnp.asarray(window, jnp.int32)

    def block(qb, qpos):  # qb [rows, KV, G, C, hd], qpos [rows, C]
        s = jnp.matmul(qb, kh.swapaxes(-1, -2))  # [rows, KV, G, C, R]
        if softcap:
            s = jnp.tanh(s / softcap) * softcap
        ok = kpos[:, None, :] <= qpos[:, :, None]
        ok &= (window <= 0) | (kpos[:, None, :] > qpos[:, :, None] - window)
        s = jnp.where(ok[:, None, None], s, -jnp.inf)
        return jnp.matmul(jax.nn.softmax(s, axis=-1), vh)  # [rows, KV, G, C, hd]

    if R > Q_CHUNK:
        n = -(-R // Q_CHUNK)
        pad = n * Q_CHUNK - R  # the last block's missing queries: zeros at position 0, dropped after
        qp = jnp.pad(qh, ((0, 0),) * 3 + ((0, pad), (0, 0)))
        pp = jnp.pad(kpos, ((0, 0), (0, pad)))
        qs = jnp.moveaxis(qp.reshape(rows, KV, G, n, Q_CHUNK, hd), 3, 0)
        ps = jnp.moveaxis(pp.reshape(rows, n, Q_CHUNK), 1, 0)
        o = jnp.moveaxis(jax.lax.map(lambda a: block(*a), (qs, ps)), 0, 3)
        o = o.reshape(rows, KV, G, n * Q_CHUNK, hd)[:, :, :, :R]
    else:
        o = block(qh, kpos)
    return o.transpose(0, 3, 1, 2, 4).reshape(T, H, hd).astype(q.dtype)


def states(pcfg: DecoderPoolingConfig, weights: dict, ids):
    """Final-normed hidden states [B, T, D] (f32) of ids [B, T] (each row one input from position 0;
    padding at the end, which causal attention keeps out of the real tokens)."""
    import jax.numpy as jnp

    from jaxserve.models.transformer import forward_hidden, layer_constants

    cfg = pcfg.model
    B, T = ids.shape
    batch = {"token_ids": ids.reshape(-1), "positions": jnp.tile(jnp.arange(T, dtype=jnp.int32), B)}
    if cfg.mrope_section:  # Qwen2-VL (e.g. GME embedders), text only: every RoPE axis at the token's position
        batch["rope_pos"] = jnp.broadcast_to(batch["positions"][None], (3, B * T))
    scan = not isinstance(weights["layers"], list)  # packed weights come as a per-layer list
    consts = {k: jnp.asarray(v) for k, v in layer_constants(cfg).items()}
    h, _ = forward_hidden(cfg, weights, consts, None, batch, scan_layers=scan,
                          attention=partial(causal_attention, rows=B))
    return h.reshape(B, T, -1).astype(jnp.float32)


def embed(pcfg: DecoderPoolingConfig, weights: dict, ids, types, mask):
    """Pooled (and normalized) embeddings [B, D], or for a classifier its logits [B, labels] at the last
    token that is not padding (transformers' rule: the last whose id is not pad_token_id). `types` is
    ignored (one segment)."""
    import jax.numpy as jnp

    del types
    h = states(pcfg, weights, ids)
    if not pcfg.num_labels:
        return pool_rows(h, mask, pcfg.pooling, pcfg.normalize)
    real = mask > 0
    if pcfg.pad_token_id is not None:
        real &= ids != pcfg.pad_token_id
    idx = jnp.max(jnp.where(real, jnp.arange(ids.shape[1])[None, :], 0), axis=1)
    head = weights["head"]
    return at_index(h, idx) @ head["w"] + head["b"]
