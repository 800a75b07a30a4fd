"""BERT embedding models from GGUF files (llama.cpp's `bert` architecture): config, weights, tokenizer.

What llama.cpp's converter writes for a BERT checkpoint and how it is read back here:
  metadata   bert.{embedding_length, feed_forward_length, block_count, context_length,
             attention.head_count, attention.layer_norm_epsilon, pooling_type} (pooling: 1 mean,
             2 CLS, 3 last token; llama.cpp's server L2-normalizes embeddings, so we do too)
  tensors    token_embd, token_types, position_embd, token_embd_norm (weight, bias);
             blk.N.{attn_q, attn_k, attn_v, attn_output, attn_output_norm, ffn_up, ffn_down,
             layer_output_norm}.{weight, bias}; matrices stored [out, in] like every GGUF
  vocabulary WordPiece in "phantom space" spelling: a word-initial piece gains U+2581, a continuation
             loses its "##", control tokens ([CLS], [SEP], ...) stay as they are. The inverse gives
             back the HF vocabulary; the tokenizer is the original uncased BERT one (lower-casing,
             accent stripping, punctuation and CJK split, [CLS] ... [SEP] around each input). llama.cpp's
             WPM tokenizer differs on accented words (it keeps the combining marks: [UNK]) and on
             words over 100 characters (no [UNK] limit); we follow the model, not llama.cpp.
Sequence-classification heads (rerankers: `cls`, `cls.output`) are refused by name.
"""

from __future__ import annotations

import numpy as np

from jaxserve.models.bert import EncoderConfig, EncoderConfigError, _fuse_qkv

PHANTOM = "\u2581"
POOLING_TYPES = {1: "mean", 2: "cls", 3: "lasttoken"}  # gguf.PoolingType values we implement
CONTROL = 3  # gguf.TokenType.CONTROL
# GGUF per-layer name -> our layer name (models/bert.py: *_w [in, out] and *_b)
_LAYER = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "attn_output_norm": "ln1",
          "ffn_up": "up", "ffn_down": "down", "layer_output_norm": "ln2"}


def is_encoder_gguf(readers) -> bool:
    from jaxserve.loader.gguf_loader import meta_get

    return meta_get(readers, "general.architecture") == "bert"


def encoder_config(readers) -> EncoderConfig:
    from jaxserve.loader.gguf_loader import meta_get, tensor_names

    def g(key, default=None):
        v = meta_get(readers, f"bert.{key}", default)
        if v is None:
            raise EncoderConfigError(f"GGUF bert file: metadata bert.{key} is missing")
        return v

    names = tensor_names(readers)
    head = sorted(n for n in names if n.startswith("cls"))
    if head:
        raise EncoderConfigError(f"GGUF bert file: classification head tensors {head} are not supported "
                                 "(embedding models only; load the HF checkpoint of a reranker)")
    if meta_get(readers, "bert.attention.causal", False):
        raise EncoderConfigError("GGUF bert file: causal attention is not an encoder")
    pool = int(g("pooling_type", 1))
    if pool not in POOLING_TYPES:
        raise EncoderConfigError(f"GGUF bert file: pooling_type {pool} is not supported (1 mean, 2 cls, 3 last)")
    types = next(t for r in readers for t in r.tensors if t.name == "token_types.weight") \
        if "token_types.weight" in names else None
    ctx = int(g("context_length"))
    vocab = meta_get(readers, "bert.vocab_size") or len(meta_get(readers, "tokenizer.ggml.tokens") or [])
    return EncoderConfig(model_type="bert", vocab_size=int(vocab), hidden_size=int(g("embedding_length")),
                         num_layers=int(g("block_count")), num_heads=int(g("attention.head_count")),
                         intermediate_size=int(g("feed_forward_length")), max_position_embeddings=ctx,
                         type_vocab_size=int(types.shape[-1]) if types is not None else 1,
                         layer_norm_eps=float(g("attention.layer_norm_epsilon", 1e-12)), hidden_act="gelu",
                         pad_token_id=int(meta_get(readers, "tokenizer.ggml.padding_token_id", 0) or 0),
                         pooling=POOLING_TYPES[pool], normalize=True, max_seq_len=ctx)


def load_weights(readers, cfg: EncoderConfig, dtype=np.float32) -> dict:
    """The weights pytree of models/bert.py (emb {word, pos, type, ln_w, ln_b}; layers {name: [L, ...]}
    with matrices [in, out]), dequantized from any GGUF type; a missing or misshapen tensor is named."""
    from jaxserve.loader.dequant import dequantize_tensor

    tensors = {t.name: t for r in readers for t in r.tensors}

    def get(name: str, shape: tuple[int, ...]):
        t = tensors.get(name)
        if t is None:
            raise EncoderConfigError(f"GGUF bert file: tensor {name!r} is missing")
        a = dequantize_tensor(t)
        if a.shape != shape:
            raise EncoderConfigError(f"GGUF bert file: tensor {name!r} is {a.shape}, the metadata implies {shape}")
        return a.astype(dtype)

    H, F = cfg.hidden_size, cfg.intermediate_size
    emb = {"word": get("token_embd.weight", (cfg.vocab_size, H)),
           "pos": get("position_embd.weight", (cfg.max_position_embeddings, H)),
           "type": get("token_types.weight", (cfg.type_vocab_size, H)),
           "ln_w": get("token_embd_norm.weight", (H,)), "ln_b": get("token_embd_norm.bias", (H,))}
    out_in = {"q": (H, H), "k": (H, H), "v": (H, H), "o": (H, H), "up": (F, H), "down": (H, F)}
    layers: dict[str, list] = {}
    for i in range(cfg.num_layers):
        for src, ours in _LAYER.items():
            p = f"blk.{i}.{src}"
            if ours.startswith("ln"):
                layers.setdefault(ours + "_w", []).append(get(p + ".weight", (H,)))
                layers.setdefault(ours + "_b", []).append(get(p + ".bias", (H,)))
            else:
                layers.setdefault(ours + "_w", []).append(get(p + ".weight", out_in[ours]).T)
                layers.setdefault(ours + "_b", []).append(get(p + ".bias", out_in[ours][:1]))
    return {"emb": emb, "layers": _fuse_qkv({k: np.stack(v) for k, v in layers.items()})}


def hf_vocab(tokens: list[str], types: list[int] | None) -> list[str]:
    """The HF WordPiece vocabulary of a phantom-space GGUF vocabulary (see the module docstring)."""
    out = []
    for i, tok in enumerate(tokens):
        control = types is not None and types[i] == CONTROL
        if tok.startswith(PHANTOM):
            out.append(tok[len(PHANTOM):])
        elif control or (tok.startswith("[") and tok.endswith("]")):  # (older converters kept [..] as is)
            out.append(tok)
        else:
            out.append("##" + tok)
    return out


def phantom_vocab(vocab: list[str], control: set[int]) -> list[str]:
    """The inverse of hf_vocab: how llama.cpp's converter spells an HF WordPiece vocabulary (it keeps
    some non-control bracketed tokens such as [unusedN] unprefixed; both spellings read back the same)."""
    return [tok if i in control else tok[2:] if tok.startswith("##") else PHANTOM + tok
            for i, tok in enumerate(vocab)]


def tokenizer(readers):
    """A `tokenizers.Tokenizer` for the file's WordPiece vocabulary: the original model's uncased BERT
    tokenizer (see the module docstring for where llama.cpp's differs)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    from jaxserve.loader.gguf_loader import meta_get

    if meta_get(readers, "tokenizer.ggml.model") != "bert":
        raise EncoderConfigError(f"GGUF bert file: tokenizer model {meta_get(readers, 'tokenizer.ggml.model')!r} "
                                 "is not WordPiece ('bert')")
    vocab = hf_vocab(meta_get(readers, "tokenizer.ggml.tokens"), meta_get(readers, "tokenizer.ggml.token_type"))
    ids = {tok: i for i, tok in reversed(list(enumerate(vocab)))}  # the first of duplicates wins

    def special(key: str, text: str) -> int:
        v = meta_get(readers, f"tokenizer.ggml.{key}")
        if v is None:
            v = ids.get(text)
        if v is None or not 0 <= int(v) < len(vocab):
            raise EncoderConfigError(f"GGUF bert file: no {text} token (tokenizer.ggml.{key})")
        return int(v)

    cls, sep = special("bos_token_id", "[CLS]"), special("seperator_token_id", "[SEP]")
    unk = vocab[special("unknown_token_id", "[UNK]")]
    tok = Tokenizer(models.WordPiece(ids, unk_token=unk, max_input_chars_per_word=100))
    # llama.cpp's converter writes uncased vocabularies (its tokenizer lower-cases every input)
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=True,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    c, s = vocab[cls], vocab[sep]
    tok.post_processor = processors.TemplateProcessing(single=f"{c} $A {s}", pair=f"{c} $A {s} $B:1 {s}:1",
                                                       special_tokens=[(c, cls), (s, sep)])
    tok.decoder = decoders.WordPiece()
    control = {i for i, t in enumerate(meta_get(readers, "tokenizer.ggml.token_type") or []) if t == CONTROL}
    tok.add_special_tokens([vocab[i] for i in sorted(control)])
    return tok

