"""Encoder models: embeddings against Hugging Face transformers (the real all-MiniLM-L6-v2 and tiny
random BERT / RoBERTa / XLM-RoBERTa with each pooling mode), cross-encoder scores (tiny random BERT and
XLM-RoBERTa sequence classifiers), the engine's buckets (no compile after warm-up, inputs in order),
and POST /v1/embeddings, /rerank and /score end to end on real servers."""

import asyncio
import base64
import json
import re
import shutil

import jax
import numpy as np
import pytest
import torch

from conftest import get_json, post_json, validate_schema
from jaxserve import LLM
from jaxserve.engine.embedder import EmbeddingEngine, EmbeddingInputError, is_embedding_model, length_buckets
from jaxserve.loader.pip_models import ensure_minilm
from model_files import smollm2_gguf, tiny_cross_encoder

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
         "hi", "Paris is the capital and most populous city of France, on the Seine. " * 6,
         "def add(a, b):\n    return a + b", "¿Dónde está la biblioteca? 東京は日本の首都です。"]

_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **k: _compiles.append(name) if "backend_compile" in name else None)


def _hf_pool(states: torch.Tensor, mode: str, normalize: bool) -> np.ndarray:
    """sentence-transformers' pooling of one unpadded row [T, H]."""
    v = {"mean": states.mean(0), "cls": states[0], "max": states.max(0).values, "lasttoken": states[-1]}[mode]
    if normalize:
        v = torch.nn.functional.normalize(v, dim=-1)
    return v.numpy()


@pytest.fixture(scope="module")
def minilm():
    return LLM(str(ensure_minilm()))


def test_minilm_matches_transformers(minilm):
    from transformers import AutoModel

    got = minilm.embed(TEXTS)
    assert got.shape == (len(TEXTS), 384) and got.dtype == np.float32
    hf = AutoModel.from_pretrained(str(ensure_minilm())).eval()
    for text, v in zip(TEXTS, got):
        ids = minilm.tokenizer.encode(text)
        assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
        with torch.no_grad():
            states = hf(input_ids=torch.tensor([ids])).last_hidden_state[0]
        np.testing.assert_allclose(v, _hf_pool(states, "mean", True), atol=2e-6)
    # the model's known behaviour: the two sentences about eating are close, the third is not
    sim = got[:3] @ got[:3].T
    assert sim[0, 1] > 0.7 > 0.0 > sim[0, 2]


def test_buckets_order_and_no_compiles(minilm):
    eng = minilm.engine
    assert eng.num_compiled() == len(eng.buckets) and length_buckets(256) == [16, 32, 64, 128, 256]
    rng = np.random.default_rng(0)
    many = [rng.integers(1000, 30000, size=int(n)).tolist() for n in rng.integers(1, 257, size=150)]
    n = len(_compiles)
    out = eng.embed(many)
    assert len(_compiles) == n, "compiled while embedding"
    # each row is the input's own embedding, whatever batch and padding it went through
    for i in (0, 7, 149):
        np.testing.assert_allclose(out[i], eng.embed([many[i]])[0], atol=2e-6)
    with pytest.raises(EmbeddingInputError, match="256"):
        eng.embed([[101] * 257])
    with pytest.raises(EmbeddingInputError, match="empty"):
        eng.embed([[101], []])
    with pytest.raises(EmbeddingInputError, match="out of range"):
        eng.embed([[30522]])
    with pytest.raises(ValueError, match="embedding model"):
        minilm.generate("hello")
    assert is_embedding_model(str(ensure_minilm())) and not is_embedding_model(str(smollm2_gguf()))
    assert not is_embedding_model(None)


@pytest.mark.parametrize("family,pooling,normalize", [("bert", "cls", False), ("roberta", "max", True),
                                                      ("xlm-roberta", "lasttoken", False)])
def test_tiny_encoders_match_transformers(tmp_path, family, pooling, normalize):
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel, XLMRobertaConfig, XLMRobertaModel

    cls_cfg, cls_model = {"bert": (BertConfig, BertModel), "roberta": (RobertaConfig, RobertaModel),
                          "xlm-roberta": (XLMRobertaConfig, XLMRobertaModel)}[family]
    kw = dict(vocab_size=30522, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
              max_position_embeddings=70, hidden_act="gelu_new" if family == "xlm-roberta" else "gelu")
    if family != "bert":
        kw.update(pad_token_id=1, type_vocab_size=1)
    torch.manual_seed(0)
    model = cls_model(cls_cfg(**kw), add_pooling_layer=False).eval()
    with torch.no_grad():  # random LayerNorm parameters, so that a mix-up of weights shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    shutil.copy(ensure_minilm() / "tokenizer.json", tmp_path / "tokenizer.json")
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        mods.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(mods))
    (tmp_path / "1_Pooling").mkdir()
    key = {"cls": "cls_token", "max": "max_tokens", "mean": "mean_tokens", "lasttoken": "lasttoken"}[pooling]
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 48,
                                                                    f"pooling_mode_{key}": True}))
    eng = EmbeddingEngine(str(tmp_path), warmup=False)
    want_len = 70 - (2 if family != "bert" else 0)  # RoBERTa positions start after the padding index
    assert eng.cfg.max_seq_len == want_len and eng.cfg.pooling == pooling and eng.cfg.normalize == normalize
    rng = np.random.default_rng(1)
    inputs = [rng.integers(5, 30522, size=int(n)).tolist() for n in (1, 3, 17, 40, want_len)]
    got = eng.embed(inputs)
    for ids, v in zip(inputs, got):
        with torch.no_grad():
            states = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        np.testing.assert_allclose(v, _hf_pool(states, pooling, normalize), atol=3e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------- server

@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("embed")


def test_embeddings_endpoint(server, minilm):
    import openai

    url = server.url
    status, r = post_json(f"{url}/v1/embeddings", {"model": "minilm", "input": TEXTS[:3]})
    assert status == 200, r
    validate_schema(r, "CreateEmbeddingResponse")
    assert [d["index"] for d in r["data"]] == [0, 1, 2] and r["model"] == "minilm"
    want = minilm.embed(TEXTS[:3])
    np.testing.assert_allclose(np.array([d["embedding"] for d in r["data"]]), want, atol=1e-6)
    n_tokens = sum(len(minilm.tokenizer.encode(t)) for t in TEXTS[:3])
    assert r["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    # base64 (the openai client's default) decodes to the same float32 vectors
    status, r = post_json(f"{url}/embeddings", {"input": TEXTS[3], "encoding_format": "base64"})
    assert status == 200
    v = np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(v, minilm.embed(TEXTS[3])[0], atol=1e-6)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    e = client.embeddings.create(model="minilm", input=TEXTS[:2])
    np.testing.assert_allclose(np.array([d.embedding for d in e.data]), want[:2], atol=1e-6)
    e = client.embeddings.create(model="minilm", input=[minilm.tokenizer.encode(t) for t in TEXTS[1:3]])
    np.testing.assert_allclose(np.array([d.embedding for d in e.data]), want[1:3], atol=1e-6)
    # concurrent requests are batched together and each gets its own vectors
    import aiohttp

    async def many():
        async with aiohttp.ClientSession() as s:
            async def one(i):
                async with s.post(f"{url}/v1/embeddings", json={"input": [TEXTS[i % 7], TEXTS[(i + 3) % 7]]}) as resp:
                    assert resp.status == 200
                    return await resp.json()
            return await asyncio.gather(*[one(i) for i in range(24)])

    all_vecs = minilm.embed(TEXTS)
    for i, r in enumerate(asyncio.run(many())):
        got = np.array([d["embedding"] for d in r["data"]])
        np.testing.assert_allclose(got, all_vecs[[i % 7, (i + 3) % 7]], atol=1e-6)
    # bad inputs: 400 with OpenAI's error shape, the server keeps serving
    for body, param in [({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[101] * 300]}, "input"),
                        ({"input": [[1, 2], [40000]]}, "input"), ({"input": ["x", [101]]}, "input"), ({"input": "x", "dimensions": 12}, "dimensions"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "x", "inputs": "x"}, "inputs"), ({"inputs": "x"}, "input"),
                        ({"input": ["x"] * 2049}, "input"), ({"input": "x", "model": "other"}, "model")]:
        status, err = post_json(f"{url}/v1/embeddings", body)
        assert status in (400, 404), (body, status, err)
        validate_schema(err, "ErrorResponse")
        assert err["error"]["param"] == param, (body, err)
    status, err = post_json(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and err["error"]["code"] == "model_not_supported"
    # /tokenize and /detokenize serve pooling models too (token_strs was an AttributeError: a 500)
    status, r = post_json(f"{url}/tokenize", {"model": "minilm", "prompt": TEXTS[3]})
    assert status == 200 and r["tokens"] == minilm.tokenizer.encode(TEXTS[3]), r
    assert r["count"] == len(r["token_strs"]) == len(r["tokens"]) and r["max_model_len"] == 256
    status, r2 = post_json(f"{url}/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and "hi" in r2["prompt"], r2
    status, models = get_json(f"{url}/v1/models")
    assert status == 200 and models["data"][0]["id"] == "minilm" and models["data"][0]["max_model_len"] == 256
    assert get_json(f"{url}/health")[0] == 200
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    assert "jaxserve_ready 1.0" in text
    assert float(re.search(r"^jaxserve_prompt_tokens_total (\S+)", text, re.M).group(1)) >= n_tokens


def test_hub_id_from_the_offline_cache(tmp_path, minilm):
    """`--model org/name` of an embedding model loads from huggingface_hub's cache with HF_HUB_OFFLINE,
    sentence-transformers' pooling files included."""
    import os
    import subprocess
    import sys

    from test_source import ROOT, _fake_cache

    src = ensure_minilm()
    files = {str(p.relative_to(src)): p for p in src.rglob("*") if p.is_file() and p.suffix != ".lock"}
    assert "1_Pooling/config.json" in files
    _fake_cache(tmp_path / "hf", "sentence-transformers/all-MiniLM-L6-v2", files)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    code = ("import json; from jaxserve import LLM; llm = LLM('sentence-transformers/all-MiniLM-L6-v2'); "
            "print(json.dumps(llm.embed(['A man is eating food.'])[0].tolist()))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.array(json.loads(r.stdout.strip().splitlines()[-1]))
    np.testing.assert_allclose(got, minilm.embed(["A man is eating food."])[0], atol=1e-6)


QUERY = "what is the capital of france"
DOCS = ["Paris is the capital of France.", "Bananas are yellow. " * 40, "x", "Berlin is in Germany.",
        "The capital city of France is Paris, on the Seine."]


def _hf_pair_scores(model, tok_json, query, docs, max_len, token_types=True):
    """transformers' sigmoid(logit) of each (query, doc), tokenized by the tokenizers library itself."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok_json))
    t.no_padding()
    t.enable_truncation(max_len, strategy="only_second")
    out = []
    for d in docs:
        e = t.encode(query, d)
        kw = {"token_type_ids": torch.tensor([e.type_ids])} if token_types else {}
        with torch.no_grad():
            out.append(torch.sigmoid(model(input_ids=torch.tensor([e.ids]), **kw).logits[0, 0]).item())
    return np.array(out)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_cross_encoders_match_transformers(tmp_path, family):
    from transformers import (BertConfig, BertForSequenceClassification, XLMRobertaConfig,
                              XLMRobertaForSequenceClassification)

    if family == "bert":
        d = tiny_cross_encoder()
        model = BertForSequenceClassification.from_pretrained(str(d)).eval()
    else:
        torch.manual_seed(1)
        model = XLMRobertaForSequenceClassification(XLMRobertaConfig(
            vocab_size=30522, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=70, num_labels=1, pad_token_id=1, type_vocab_size=1)).eval()
        with torch.no_grad():  # a larger head so that scores spread out over (0, 1)
            model.classifier.dense.weight.mul_(20.0)
            model.classifier.out_proj.weight.mul_(10.0)
        model.save_pretrained(tmp_path, safe_serialization=True)
        shutil.copy(ensure_minilm() / "tokenizer.json", tmp_path / "tokenizer.json")
        d = tmp_path
    llm = LLM(str(d))
    eng = llm.engine
    assert eng.is_classifier and eng.cfg.num_labels == 1
    got = llm.rerank(QUERY, DOCS)
    want = _hf_pair_scores(model, d / "tokenizer.json", QUERY, DOCS, eng.cfg.max_seq_len,
                           token_types=family == "bert")
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert len(set(np.round(got, 4))) == len(DOCS)  # distinct far beyond the tolerance: a mix-up would show
    with pytest.raises(EmbeddingInputError, match="cross-encoder"):
        llm.embed(["hello"])
    with pytest.raises(EmbeddingInputError, match="query is too long"):
        llm.rerank("word " * 300, ["doc"])


@pytest.fixture(scope="module")
def rerank_server(server_factory):
    return server_factory("rerank")


def test_rerank_and_score_endpoints(rerank_server, server, minilm):
    url = rerank_server.url
    llm = LLM(str(tiny_cross_encoder()))
    want = llm.rerank(QUERY, DOCS)
    status, r = post_json(f"{url}/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 3})
    assert status == 200, r
    assert [x["index"] for x in r["results"]] == list(np.argsort(-want)[:3])
    np.testing.assert_allclose([x["relevance_score"] for x in r["results"]], np.sort(want)[::-1][:3], atol=1e-6)
    assert r["results"][0]["document"]["text"] == DOCS[r["results"][0]["index"]] and r["usage"]["total_tokens"] > 0
    # Cohere's v2 path, documents as objects, without the documents echoed
    status, r = post_json(f"{url}/v2/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                               "return_documents": False})
    assert status == 200 and len(r["results"]) == len(DOCS) and "document" not in r["results"][0]
    # vLLM's /score: one text against many, and pairwise
    status, r = post_json(f"{url}/score", {"text_1": QUERY, "text_2": DOCS})
    assert status == 200 and [x["index"] for x in r["data"]] == list(range(len(DOCS)))
    np.testing.assert_allclose([x["score"] for x in r["data"]], want, atol=1e-6)
    status, r = post_json(f"{url}/v1/score", {"text_1": [QUERY, "berlin"], "text_2": [DOCS[0], DOCS[3]]})
    assert status == 200
    np.testing.assert_allclose([x["score"] for x in r["data"]],
                               [want[0], llm.rerank("berlin", [DOCS[3]])[0]], atol=1e-6)
    for path, body, param in [("/v1/rerank", {"query": "", "documents": ["a"]}, "documents"),
                              ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
                              ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
                              ("/v1/rerank", {"query": "word " * 300, "documents": ["a"]}, "documents"),
                              ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
                              ("/v1/embeddings", {"input": "hello"}, "model"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model")]:
        status, err = post_json(f"{url}{path}", body)
        assert status == 400, (path, body, err)
        validate_schema(err, "ErrorResponse")
        assert err["error"]["param"] == param, (path, body, err)
    # an embedding model scores by cosine similarity
    status, r = post_json(f"{server.url}/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:4]})
    assert status == 200, r
    v = minilm.embed(TEXTS[:4])
    cos = v[1:] @ v[0]  # normalized embeddings
    np.testing.assert_allclose(sorted((x["relevance_score"] for x in r["results"]), reverse=True),
                               np.sort(cos)[::-1], atol=1e-5)
    assert r["results"][0]["index"] == int(np.argmax(cos)) == 0  # "eating bread" is closest to "eating food"


def test_checkpoint_variants(tmp_path):
    """bf16 weights under a task prefix with the old gamma/beta LayerNorm names load and match; modules
    that would change the vectors, several pooling modes, and a many-label cross-encoder are refused."""
    from safetensors.torch import save_file
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(3)
    cfg = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=64)
    model = BertModel(BertConfig(**cfg), add_pooling_layer=False).eval()
    d = tmp_path / "bf16"
    model.save_pretrained(d, safe_serialization=True)
    for f in d.glob("*.safetensors"):
        f.unlink()
    sd = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"):
          v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(d / "model.safetensors"))
    shutil.copy(ensure_minilm() / "tokenizer.json", d / "tokenizer.json")
    eng = EmbeddingEngine(str(d), warmup=False)
    ids = [101, 2023, 2003, 1037, 3231, 102]
    model = model.to(torch.bfloat16).float()  # the reference with the same rounded weights
    with torch.no_grad():
        want = _hf_pool(model(input_ids=torch.tensor([ids])).last_hidden_state[0], "mean", True)
    np.testing.assert_allclose(eng.embed([ids])[0], want, atol=1e-5)

    from jaxserve.models.bert import EncoderConfigError

    dense = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
             {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
             {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    (d / "1_Pooling").mkdir()
    (d / "modules.json").write_text(json.dumps(dense))
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with pytest.raises(EncoderConfigError, match="Dense"):
        EmbeddingEngine(str(d), warmup=False)
    (d / "modules.json").write_text(json.dumps(dense[:2]))
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True,
                                                             "pooling_mode_max_tokens": True}))
    with pytest.raises(EncoderConfigError, match="exactly one"):
        EmbeddingEngine(str(d), warmup=False)
    # a three-label classifier (NLI-style) loads, but cannot rerank
    d3 = tmp_path / "nli"
    BertForSequenceClassification(BertConfig(num_labels=3, **cfg)).save_pretrained(d3, safe_serialization=True)
    shutil.copy(ensure_minilm() / "tokenizer.json", d3 / "tokenizer.json")
    llm = LLM(str(d3))
    assert llm.engine.cfg.num_labels == 3
    with pytest.raises(EmbeddingInputError, match="one-label"):
        llm.rerank("q", ["d"])
