"""Encoder models: BERT, RoBERTa, XLM-RoBERTa — config, weights and a pure forward, for embeddings
and (with a sequence-classification head) cross-encoder scoring / reranking.

These are the sentence-embedding models (all-MiniLM, bge, e5, gte, multilingual-e5...) behind
`/v1/embeddings`: bidirectional attention over one padded batch, no KV cache, then the pooling that
the checkpoint's sentence-transformers files name (mean / CLS / max / last token) and, when they ask
for it, L2 normalisation. The forward is a pure function of a weights pytree (layers stacked on a
leading axis and run by lax.scan), jit-compiled once per (batch, length) bucket by engine/embedder.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.models.pooling import POOLING, PoolingConfigError, pool_rows, read_pooling  # noqa: F401

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish")


class EncoderConfigError(ValueError):
    """A config.json or checkpoint this encoder cannot run (one line naming what)."""


@dataclass(frozen=True)
class EncoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    pooling: str = "mean"
    normalize: bool = True
    max_seq_len: int = 512  # longest input (tokens, special ones included)
    num_labels: int = 0  # > 0: a sequence-classification head (cross-encoder / reranker), no pooling
    labels: tuple[str, ...] = ()  # the head's label names (config id2label), when it has them
    problem_type: str | None = None  # config problem_type: how /classify turns logits into scores

    @property
    def position_offset(self) -> int:
        """RoBERTa numbers positions from pad_token_id + 1 (padding sits at pad_token_id)."""
        return self.pad_token_id + 1 if self.model_type != "bert" else 0


def is_encoder_dir(d: Path) -> bool:
    cfg = Path(d) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("model_type") in ENCODER_TYPES
    except (OSError, ValueError):
        return False


def config_from_dir(d: str | Path) -> EncoderConfig:
    d = Path(d)
    c = json.loads((d / "config.json").read_text())
    mt = c.get("model_type")
    if mt not in ENCODER_TYPES:
        raise EncoderConfigError(f"{d}/config.json: model_type {mt!r} is not an encoder ({', '.join(ENCODER_TYPES)})")
    if c.get("position_embedding_type", "absolute") != "absolute":
        raise EncoderConfigError(f"position_embedding_type {c['position_embedding_type']!r} is not supported")
    act = c.get("hidden_act", "gelu")
    if act not in _ACTS:
        raise EncoderConfigError(f"hidden_act {act!r} is not supported ({', '.join(_ACTS)})")
    archs = c.get("architectures") or []
    num_labels, labels = 0, ()
    if any(a.endswith("ForSequenceClassification") for a in archs):
        num_labels, labels = head_labels(c)
        pooling, normalize = "cls", False
    else:
        try:
            pooling, normalize = read_pooling(d, ("mean", True))  # no files: mean, normalized (as OpenAI's)
        except PoolingConfigError as e:
            raise EncoderConfigError(str(e)) from None
    pad = int(c.get("pad_token_id", 0) or 0)
    max_pos = int(c["max_position_embeddings"])
    max_len = max_pos - (pad + 1 if mt != "bert" else 0)
    st = d / "sentence_bert_config.json"
    if st.is_file():
        max_len = min(max_len, int(json.loads(st.read_text()).get("max_seq_length") or max_len))
    return EncoderConfig(model_type=mt, vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
                         num_layers=int(c["num_hidden_layers"]), num_heads=int(c["num_attention_heads"]),
                         intermediate_size=int(c["intermediate_size"]), max_position_embeddings=max_pos,
                         type_vocab_size=int(c.get("type_vocab_size", 2)),
                         layer_norm_eps=float(c.get("layer_norm_eps", 1e-12)), hidden_act=act, pad_token_id=pad,
                         pooling=pooling, normalize=normalize, max_seq_len=max_len, num_labels=num_labels,
                         labels=labels, problem_type=c.get("problem_type"))


def head_labels(c: dict) -> tuple[int, tuple[str, ...]]:
    """(number of labels, their names) of a sequence-classification config.json (transformers' default
    is two labels named LABEL_0, LABEL_1)."""
    id2label = c.get("id2label") or {}
    n = int(c.get("num_labels") or len(id2label) or 2)
    return n, tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))


# Shapes of real encoders, for benchmarks with random weights (EmbeddingEngine.random).
PRESETS = {
    "minilm-l6": dict(hidden_size=384, num_layers=6, num_heads=12, intermediate_size=1536, max_seq_len=256),
    "bert-base": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072, max_seq_len=512),
    "bert-large": dict(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096, max_seq_len=512),
}


def preset(name: str) -> EncoderConfig:
    if name not in PRESETS:
        raise EncoderConfigError(f"unknown encoder preset {name!r}; known: {', '.join(PRESETS)}")
    return EncoderConfig(model_type="bert", vocab_size=30522, max_position_embeddings=512, type_vocab_size=2,
                         layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0, **PRESETS[name])


# checkpoint name (after the model prefix) -> (our name, is a matrix stored [out, in])
_LAYER = {"attention.self.query": "q", "attention.self.key": "k", "attention.self.value": "v",
          "attention.output.dense": "o", "attention.output.LayerNorm": "ln1", "intermediate.dense": "up",
          "output.dense": "down", "output.LayerNorm": "ln2"}


def load_weights(d: str | Path, cfg: EncoderConfig, dtype=np.float32) -> dict:
    """The weights pytree (numpy): emb {word, pos, type, ln_w, ln_b}; layers {name: [L, ...]} with
    matrices as [in, out]. Accepts the bare encoder's names and those under a task head's prefix
    ("bert.", "roberta."), and the old LayerNorm gamma/beta names; a missing tensor is an error."""
    from jaxserve.loader.safetensors_loader import _map_tensor, read_header

    d = Path(d)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise EncoderConfigError(f"{d}: no .safetensors weights")
    where = {}  # our name -> (file, data start, checkpoint name, header entry); read only when needed
    for f in files:
        start, header = read_header(f)
        for k, info in header.items():
            name = k
            for prefix in ("bert.", "roberta.", "model."):
                if name.startswith(prefix):
                    name = name[len(prefix):]
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
            where[name] = (f, start, k, info)
    raw = {k: tuple(v[3]["shape"]) for k, v in where.items()}  # shapes, for error messages

    def get(name):
        if name not in where:
            raise EncoderConfigError(f"{d}: tensor {name!r} is missing from the checkpoint")
        f, start, k, info = where[name]
        return _map_tensor(f, start, k, info).astype(dtype)  # f32 / f16 / bf16 files

    emb = {"word": get("embeddings.word_embeddings.weight"), "pos": get("embeddings.position_embeddings.weight"),
           "type": get("embeddings.token_type_embeddings.weight"),
           "ln_w": get("embeddings.LayerNorm.weight"), "ln_b": get("embeddings.LayerNorm.bias")}
    if emb["word"].shape != (cfg.vocab_size, cfg.hidden_size):
        raise EncoderConfigError(f"word embeddings are {emb['word'].shape}, config says "
                                 f"{(cfg.vocab_size, cfg.hidden_size)}")
    layers: dict[str, list] = {}
    for i in range(cfg.num_layers):
        for src, ours in _LAYER.items():
            p = f"encoder.layer.{i}.{src}"
            if ours.startswith("ln"):
                layers.setdefault(ours + "_w", []).append(get(p + ".weight"))
                layers.setdefault(ours + "_b", []).append(get(p + ".bias"))
            else:
                layers.setdefault(ours + "_w", []).append(get(p + ".weight").T)
                layers.setdefault(ours + "_b", []).append(get(p + ".bias"))
    out = {"emb": emb, "layers": _fuse_qkv({k: np.stack(v) for k, v in layers.items()})}
    if cfg.num_labels:
        # BERT: tanh(pooler(CLS)) -> classifier; RoBERTa: classifier.dense -> tanh -> out_proj: one shape
        if "classifier.out_proj.weight" in raw:
            dense, proj = "classifier.dense", "classifier.out_proj"
        else:
            dense, proj = "pooler.dense", "classifier"
        out["head"] = {"dense_w": get(dense + ".weight").T, "dense_b": get(dense + ".bias"),
                       "out_w": get(proj + ".weight").T, "out_b": get(proj + ".bias")}
        if out["head"]["out_w"].shape != (cfg.hidden_size, cfg.num_labels):
            raise EncoderConfigError(f"{proj}.weight is {raw[proj + '.weight']}, config says "
                                     f"{cfg.num_labels} labels")
    return out


def _fuse_qkv(layers: dict) -> dict:
    """q, k, v projections as one [L, H, 3H] matmul (one larger GEMM is faster on XLA:CPU)."""
    layers = dict(layers)
    layers["qkv_w"] = np.concatenate([layers.pop(n + "_w") for n in "qkv"], axis=-1)
    layers["qkv_b"] = np.concatenate([layers.pop(n + "_b") for n in "qkv"], axis=-1)
    return layers


def random_weights(cfg: EncoderConfig, seed: int = 0, dtype=np.float32) -> dict:
    """Random weights of cfg's shapes (benchmarks)."""
    rng = np.random.default_rng(seed)
    H, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    r = lambda *s: (rng.standard_normal(s) * 0.02).astype(dtype)
    emb = {"word": r(cfg.vocab_size, H), "pos": r(cfg.max_position_embeddings, H), "type": r(cfg.type_vocab_size, H),
           "ln_w": np.ones(H, dtype), "ln_b": np.zeros(H, dtype)}
    layers = {"q_w": r(L, H, H), "k_w": r(L, H, H), "v_w": r(L, H, H), "o_w": r(L, H, H), "up_w": r(L, H, F),
              "down_w": r(L, F, H), "ln1_w": np.ones((L, H), dtype), "ln2_w": np.ones((L, H), dtype)}
    for k in ("q", "k", "v", "o", "down", "ln1", "ln2"):
        layers[k + "_b"] = np.zeros((L, H), dtype)
    layers["up_b"] = np.zeros((L, F), dtype)
    return {"emb": emb, "layers": _fuse_qkv(layers)}


# ----------------------------------------------------------------------------------------- forward

def _act(name):
    import jax

    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)  # HF "gelu" is the exact erf form
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.relu if name == "relu" else jax.nn.silu


def _ln(x, w, b, eps):
    import jax.numpy as jnp

    m = jnp.mean(x, axis=-1, keepdims=True)
    v = jnp.mean(jnp.square(x - m), axis=-1, keepdims=True)
    return (x - m) * (1.0 / jnp.sqrt(v + eps)) * w + b


def encode(cfg: EncoderConfig, weights: dict, ids, types, mask):
    """Token states [B, T, H] (f32) of ids [B, T] int32 with token types (segments) [B, T] and mask
    [B, T] (1 = token, 0 = padding; padding at the end of each row)."""
    import jax
    import jax.numpy as jnp

    e = weights["emb"]
    f32 = lambda a: a.astype(jnp.float32)
    B, T = ids.shape
    if cfg.position_offset:  # RoBERTa: positions count real tokens from pad_token_id + 1
        pos = jnp.cumsum(mask, axis=1) * mask + cfg.pad_token_id
    else:
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    x = f32(e["word"][ids]) + f32(e["pos"][pos]) + f32(e["type"][types])
    x = _ln(x, f32(e["ln_w"]), f32(e["ln_b"]), cfg.layer_norm_eps)
    nh, hd = cfg.num_heads, cfg.hidden_size // cfg.num_heads
    bias = jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)  # [B, 1, 1, T] keys
    act = _act(cfg.hidden_act)
    dt = weights["layers"]["qkv_w"].dtype

    def lin(h, w, b):
        return jnp.dot(h.astype(dt), w, preferred_element_type=jnp.float32) + f32(b)

    def layer(x, w):
        # heads before tokens ([3, B, nh, T, hd]): batched matmuls over (B, nh) ran 3.3x faster on
        # XLA:CPU than einsums over the [B, T, nh, hd] layout (bench/RESULTS.md, session 14)
        qkv = lin(x, w["qkv_w"], w["qkv_b"]).reshape(B, T, 3, nh, hd).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        s = jnp.matmul(q, k.swapaxes(-1, -2)) * (1.0 / np.sqrt(hd)) + bias
        p = jax.nn.softmax(s, axis=-1)
        ctx = jnp.matmul(p, v).transpose(0, 2, 1, 3).reshape(B, T, nh * hd)
        a = _ln(lin(ctx, w["o_w"], w["o_b"]) + x, f32(w["ln1_w"]), f32(w["ln1_b"]), cfg.layer_norm_eps)
        h = act(lin(a, w["up_w"], w["up_b"]))
        return _ln(lin(h, w["down_w"], w["down_b"]) + a, f32(w["ln2_w"]), f32(w["ln2_b"]), cfg.layer_norm_eps), None

    x, _ = jax.lax.scan(layer, x, weights["layers"])
    return x


def pool(cfg: EncoderConfig, states, mask):
    return pool_rows(states, mask, cfg.pooling, cfg.normalize)


def embed(cfg: EncoderConfig, weights: dict, ids, types, mask):
    """Sentence embeddings [B, H] of a padded batch: encode, then pool; for a classification model the
    head's logits [B, num_labels] instead (of the first token's state)."""
    import jax.numpy as jnp

    states = encode(cfg, weights, ids, types, mask)
    if not cfg.num_labels:
        return pool(cfg, states, mask)
    h = weights["head"]
    f32 = lambda a: a.astype(jnp.float32)
    x = jnp.tanh(states[:, 0] @ f32(h["dense_w"]) + f32(h["dense_b"]))
    return x @ f32(h["out_w"]) + f32(h["out_b"])
