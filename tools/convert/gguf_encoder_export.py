"""Write a BERT embedding model (HF safetensors + tokenizer.json) as a llama.cpp `bert` GGUF file.

The inverse of jaxserve/loader/gguf_encoder.py, and what llama.cpp's converter writes for a BertModel:
tensor names from the `gguf` package's own name map for the BERT architecture, matrices in their
checkpoint [out, in] rows, norms and biases F32, the WordPiece vocabulary in llama.cpp's phantom-space
spelling, the sentence-transformers pooling as bert.pooling_type. Refused by name: classification heads,
max pooling, RoBERTa-style position offsets, and cased tokenizers (llama.cpp's WordPiece tokenizer
lower-cases every input, so a cased model would tokenize differently there).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DTYPES = ("f32", "f16", "q8_0")
POOLING_IDS = {"mean": 1, "cls": 2, "lasttoken": 3}


def export_encoder_gguf(model_dir: str | Path, path: str | Path, dtype: str = "f16", name: str | None = None) -> Path:
    import gguf

    from jaxserve.loader.gguf_encoder import CONTROL, phantom_vocab
    from jaxserve.loader.safetensors_loader import _map_tensor, read_header
    from jaxserve.models import bert
    from tools.convert.gguf_export import ExportError, add_shape_metadata

    d, path = Path(model_dir), Path(path)
    if dtype not in DTYPES:
        raise ExportError(f"GGUF encoder dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    cfg = bert.config_from_dir(d)
    if cfg.model_type != "bert":
        raise ExportError(f"{cfg.model_type}: only BERT encoders can be written as GGUF (RoBERTa position "
                          "offsets have no GGUF key)")
    if cfg.num_labels:
        raise ExportError("a sequence-classification head (reranker) cannot be written as a llama.cpp bert GGUF")
    if cfg.pooling not in POOLING_IDS:
        raise ExportError(f"pooling {cfg.pooling!r} has no GGUF pooling_type (mean, cls, lasttoken)")
    tj = json.loads((d / "tokenizer.json").read_text())
    model, norm = tj.get("model") or {}, tj.get("normalizer") or {}
    if model.get("type") != "WordPiece":
        raise ExportError(f"tokenizer model {model.get('type')!r} is not WordPiece")
    if norm.get("type") != "BertNormalizer" or not norm.get("lowercase", False):
        raise ExportError("a cased tokenizer: llama.cpp's WordPiece tokenizer lower-cases every input")

    vocab = [None] * len(model["vocab"])
    for tok, i in model["vocab"].items():
        vocab[i] = tok
    special = {t["id"] for t in tj.get("added_tokens", []) if t.get("special")}
    types = [CONTROL if i in special else int(gguf.TokenType.NORMAL) for i in range(len(vocab))]
    ids = model["vocab"]

    w = gguf.GGUFWriter(path, "bert")
    w.add_name(name or d.name)
    w.add_file_type(int({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                         "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]))
    add_shape_metadata(w, blocks=cfg.num_layers, context=cfg.max_position_embeddings, embedding=cfg.hidden_size,
                       feed_forward=cfg.intermediate_size, heads=cfg.num_heads)
    w.add_layer_norm_eps(cfg.layer_norm_eps)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(POOLING_IDS[cfg.pooling]))
    w.add_tokenizer_model("bert")
    w.add_token_list(phantom_vocab(vocab, special))
    w.add_token_types(types)
    w.add_token_type_count(cfg.type_vocab_size)
    for key, text in (("bos_token_id", "[CLS]"), ("seperator_token_id", "[SEP]"), ("eos_token_id", "[SEP]"),
                      ("padding_token_id", "[PAD]"), ("unknown_token_id", "[UNK]"), ("mask_token_id", "[MASK]")):
        if text in ids:
            w.add_uint32(f"tokenizer.ggml.{key}", int(ids[text]))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, cfg.num_layers)
    for f in sorted(d.glob("*.safetensors")):
        start, header = read_header(f)
        for key, info in header.items():
            hf = key.removeprefix("bert.").replace("LayerNorm.gamma", "LayerNorm.weight") \
                .replace("LayerNorm.beta", "LayerNorm.bias")
            if hf.startswith("pooler.") or hf.endswith("position_ids"):
                continue  # llama.cpp's embeddings do not use the pooler
            target = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            if target is None:
                raise ExportError(f"tensor {key!r} has no llama.cpp bert name")
            a = np.asarray(_map_tensor(f, start, key, info), np.float32)
            if a.ndim == 2 and dtype != "f32" and not target.startswith(("position_embd", "token_types")):
                if dtype == "q8_0" and a.shape[-1] % 32 == 0:
                    w.add_tensor(target, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                    continue
                a = a.astype(np.float16)
            w.add_tensor(target, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
