"""BERT embedding models as llama.cpp `bert` GGUF files: the real all-MiniLM-L6-v2 written by our
exporter (tensor names from the `gguf` package's own BERT name map, vocabulary in llama.cpp's
phantom-space spelling) loads through the hand-written reader with the same tokens as the HF
tokenizer.json and the same embeddings (F32 exactly, Q8_0 within its rounding), through `LLM` and the
server's loader; malformed files and what the format cannot carry fail by name."""

import json
import shutil

import numpy as np
import pytest

from jaxserve.loader.pip_models import ensure_minilm

TEXTS = ["A man is eating food.", "Ünïcödé FAÇADE naïve Café", "東京は日本の首都です。 and 中文",
         "don't split---this...OK? e-mail@example.com #hashtag", "x" * 120 + " unbelievably",
         "Paris is the capital and most populous city of France, on the Seine. " * 3]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tools.convert import export

    root = tmp_path_factory.mktemp("encoder-gguf")
    out = {}
    for dtype in ("f32", "q8_0"):
        out[dtype] = root / f"minilm-{dtype}.gguf"
        assert export.main(["--model", str(ensure_minilm()), "--format", "gguf", "--out", str(out[dtype]),
                            "--dtype", dtype]) == 0
    return out


def _engine(model, **kw):
    from jaxserve.engine.embedder import EmbeddingEngine

    return EmbeddingEngine(str(model), max_model_len=64, max_batch_tokens=256, warmup=False, **kw)


@pytest.fixture(scope="module")
def reference():
    return _engine(ensure_minilm())


def test_file_is_what_llama_cpp_writes(files):
    from jaxserve.loader.gguf_loader import meta_get, open_gguf, tensor_names

    rd = open_gguf(files["f32"])
    assert meta_get(rd, "general.architecture") == "bert" and meta_get(rd, "tokenizer.ggml.model") == "bert"
    assert meta_get(rd, "bert.pooling_type") == 1 and meta_get(rd, "bert.attention.causal") is False
    tokens = meta_get(rd, "tokenizer.ggml.tokens")
    vocab = json.loads((ensure_minilm() / "tokenizer.json").read_text())["model"]["vocab"]
    # llama.cpp's spelling: word starts gain U+2581, continuations lose "##", control tokens stay
    assert tokens[vocab["hello"]] == "\u2581hello" and tokens[vocab["##ing"]] == "ing"
    assert tokens[vocab["[CLS]"]] == "[CLS]" and meta_get(rd, "tokenizer.ggml.bos_token_id") == vocab["[CLS]"]
    names = tensor_names(rd)
    assert {"token_embd.weight", "token_types.weight", "position_embd.weight", "token_embd_norm.bias",
            "blk.5.attn_q.weight", "blk.5.layer_output_norm.weight", "blk.0.ffn_down.bias"} <= names
    assert not any(n.startswith("pooler") for n in names)


def test_tokens_and_embeddings_match_the_safetensors_model(files, reference):
    for dtype, tol in (("f32", 1e-6), ("q8_0", 0.02)):
        eng = _engine(files[dtype])
        assert eng.cfg.pooling == "mean" and eng.cfg.normalize and eng.dim == 384
        for t in TEXTS:  # lower-cased, accents stripped, CJK and punctuation split, [UNK] for a 120-char word
            assert eng.tokenizer.encode(t) == reference.tokenizer.encode(t), (dtype, t)
        ids = [eng.tokenizer.encode(t) for t in TEXTS]
        got, want = eng.embed(ids), reference.embed(ids)
        np.testing.assert_allclose(got, want, atol=tol)
        if dtype == "q8_0":
            assert np.min(np.sum(got * want, axis=-1)) > 0.999


def test_server_serves_it_as_an_embedding_model(files, reference):
    """`jaxserve run --model file.gguf` on a bert GGUF: the server's loader picks the embedding engine
    (the /v1/embeddings route itself is tested on the safetensors model in tests/test_embeddings.py)."""
    from argparse import Namespace

    from jaxserve.config import EngineConfig
    from jaxserve.engine.embedder import EmbeddingEngine, is_embedding_model
    from jaxserve.server.app import _load_engine

    args = Namespace(model=str(files["f32"]), task="auto", hf_overrides=None, revision=None, max_model_len=16)
    eng = _load_engine(args, EngineConfig())  # (compiles its buckets, as the server does)
    assert isinstance(eng, EmbeddingEngine) and eng.cfg.max_seq_len == 16
    ids = [eng.tokenizer.encode(TEXTS[0])]
    np.testing.assert_allclose(eng.embed(ids), reference.embed(ids), atol=1e-6)
    assert is_embedding_model(str(files["q8_0"]))  # what `LLM(path)` decides by too


def test_refusals(files, tmp_path):
    import gguf

    from jaxserve.loader import gguf_encoder
    from jaxserve.loader.gguf_loader import open_gguf
    from jaxserve.models.bert import EncoderConfigError
    from tools.convert.gguf_encoder_export import export_encoder_gguf
    from tools.convert.gguf_export import ExportError

    # a file missing a tensor, and one with a classification head: named
    src = open_gguf(files["f32"])[0]

    def rewrite(path, drop=(), add=()):
        w = gguf.GGUFWriter(path, "bert")
        for f in src.fields.values():
            if f.name.startswith("GGUF.") or f.name == "general.architecture":
                continue
            v = f.contents()
            if f.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_array(f.name, v)
            elif f.types[0] == gguf.GGUFValueType.STRING:
                w.add_string(f.name, v)
            else:
                w.add_key_value(f.name, v, f.types[0])
        for t in src.tensors:
            if t.name not in drop:
                w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        for name, a in add:
            w.add_tensor(name, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return open_gguf(path)

    rd = rewrite(tmp_path / "missing.gguf", drop=("blk.3.ffn_up.bias",))
    cfg = gguf_encoder.encoder_config(rd)
    with pytest.raises(EncoderConfigError, match=r"blk\.3\.ffn_up\.bias"):
        gguf_encoder.load_weights(rd, cfg)
    rd = rewrite(tmp_path / "head.gguf", add=(("cls.output.weight", np.zeros((1, 384), np.float32)),))
    with pytest.raises(EncoderConfigError, match="classification head"):
        gguf_encoder.encoder_config(rd)
    # export: max pooling and a cased tokenizer have no llama.cpp form
    d = tmp_path / "m"
    shutil.copytree(ensure_minilm(), d)
    pool = d / "1_Pooling" / "config.json"
    conf = json.loads(pool.read_text())
    pool.write_text(json.dumps({**conf, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}))
    with pytest.raises(ExportError, match="max"):
        export_encoder_gguf(d, tmp_path / "x.gguf")
    pool.write_text(json.dumps(conf))
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["normalizer"]["lowercase"] = False
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ExportError, match="cased"):
        export_encoder_gguf(d, tmp_path / "y.gguf")
