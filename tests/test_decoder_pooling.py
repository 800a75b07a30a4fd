"""Decoder models as pooling models (models/decoder_pooling.py) against Hugging Face transformers:
embeddings of tiny random Qwen3 / Llama / Mistral / Gemma 2 / Gemma 3 base models with last-token and
mean pooling (sliding windows, soft-caps and long inputs in query blocks included), sequence
classifiers (Qwen2 with three labels, Llama with one as a reranker; transformers' last-non-padding-
token rule), vLLM's Qwen3-Reranker overrides (a causal LM's "no"/"yes" logits as a score), refusals,
and a server started with --hf-overrides answering /classify, /rerank and /score."""

import json

import numpy as np
import pytest
import torch

from conftest import post_json, validate_schema
from hf_tiny import make_tiny_model
from jaxserve import LLM
from jaxserve.engine.embedder import EmbeddingEngine, pooling_task
from jaxserve.models.decoder_pooling import DecoderPoolingError
from model_files import QWEN3_RERANKER_OVERRIDES, tiny_qwen3_causal
from tiny_tokenizer import add_byte_tokenizer

TEXTS = ["hello world, this is a test", "hi", "a somewhat longer sentence that goes well past the window",
         "x", "the same words, the same words, the same words, again and again!"]
QUERY = "capital of france"
DOCS = ["paris is the capital of france", "bananas are yellow", "berlin", "france: its capital is paris!"]


def _st_files(d, pooling: str, normalize: bool) -> None:
    """sentence-transformers' modules.json + 1_Pooling/config.json (as Qwen3-Embedding ships them)."""
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        mods.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (d / "modules.json").write_text(json.dumps(mods))
    (d / "1_Pooling").mkdir(exist_ok=True)
    key = {"mean": "mean_tokens", "cls": "cls_token", "max": "max_tokens", "lasttoken": "lasttoken"}[pooling]
    (d / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{key}": True}))


def _hf_states(model, ids) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0]  # final-normed states [T, D]


@pytest.mark.parametrize("family,pooling,normalize", [
    ("qwen3", "lasttoken", True), ("llama", "mean", False), ("mistral", "lasttoken", True),
    ("gemma2", "lasttoken", False), ("gemma3", "mean", True)])
def test_embeddings_match_transformers(tmp_path, family, pooling, normalize):
    from transformers import AutoModel

    d = add_byte_tokenizer(make_tiny_model(family, tmp_path, head="base"))
    _st_files(d, pooling, normalize)
    assert pooling_task(str(d)) == "embed"
    llm = LLM(str(d))
    got = llm.embed(TEXTS)  # one padded batch of mixed lengths (sliding windows of 8 tokens are exceeded)
    hf = AutoModel.from_pretrained(d).eval()
    for i, text in enumerate(TEXTS):
        h = _hf_states(hf, llm.tokenizer.encode(text))
        v = h[-1] if pooling == "lasttoken" else h.mean(0)
        if normalize:
            v = torch.nn.functional.normalize(v, dim=-1)
        np.testing.assert_allclose(got[i], v.numpy(), atol=2e-5, err_msg=f"{family} input {i}")
    np.testing.assert_allclose(llm.embed("hi")[0], got[1], rtol=1e-5, atol=1e-6)  # alone = in a batch


@pytest.mark.parametrize("max_len", [1024, 1000])
def test_long_inputs_attend_in_query_blocks(tmp_path, monkeypatch, max_len):
    from transformers import AutoModel

    d = add_byte_tokenizer(make_tiny_model("qwen3", tmp_path, head="base", max_position_embeddings=2048))
    # bucket 1024: 2 query blocks of 512; bucket 1000: 512 + 488 (the last block padded)
    eng = EmbeddingEngine(str(d), max_model_len=max_len, warmup=False)
    assert eng.cfg.pooling == "lasttoken" and eng.cfg.normalize  # a bare *Model: vLLM's decoder default
    text = "".join(chr(97 + (i * 7) % 26) for i in range(700))
    ids = eng.tokenizer.encode(text)
    got = eng.embed([ids, ids[:20]])
    hf = AutoModel.from_pretrained(d).eval()
    for row, x in zip(got, [ids, ids[:20]]):
        np.testing.assert_allclose(row, torch.nn.functional.normalize(_hf_states(hf, x)[-1], dim=-1).numpy(),
                                   atol=2e-5)
    assert set(eng._exe) == {(1, max_len), (1, 32)}  # the long input and the short one, each in its own bucket
    if max_len == 1000:  # the padded blocks hold one block's scores at a time, not the whole row's
        import jax

        from jaxserve.models import decoder_pooling

        def temp_bytes(chunk):
            monkeypatch.setattr(decoder_pooling, "Q_CHUNK", chunk)
            z = np.zeros((1, 1000), np.int32)
            f = jax.jit(lambda w, i, m: decoder_pooling.embed(eng.cfg, w, i, i, m))
            return f.lower(eng.weights, z, z).compile().memory_analysis().temp_size_in_bytes

        blocks, whole = temp_bytes(512), temp_bytes(4096)
        assert blocks < 0.7 * whole, (blocks, whole)


def test_sequence_classifier_matches_transformers(tmp_path):
    from transformers import AutoModelForSequenceClassification

    labels = {"0": "negative", "1": "neutral", "2": "positive"}
    d = add_byte_tokenizer(make_tiny_model("qwen2", tmp_path, head="seqcls", num_labels=3, id2label=labels,
                                           label2id={v: int(k) for k, v in labels.items()}))
    assert pooling_task(str(d)) == "classify"
    llm = LLM(str(d))
    assert llm.labels == ("negative", "neutral", "positive")
    got = llm.classify(TEXTS)
    hf = AutoModelForSequenceClassification.from_pretrained(d).eval()
    pad = hf.config.pad_token_id
    for i, text in enumerate(TEXTS):
        ids = llm.tokenizer.encode(text)
        with torch.no_grad():
            want = torch.softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()
        np.testing.assert_allclose(got[i], want, atol=2e-6, err_msg=f"input {i}")
    # transformers pools the last token that is not pad_token_id: "!" is id 0 = pad in the byte vocabulary
    assert llm.tokenizer.encode("!") == [pad] and TEXTS[-1].endswith("!")
    with pytest.raises(ValueError, match="sequence classifier"):
        llm.embed("hi")


def test_one_label_classifier_reranks(tmp_path):
    from transformers import AutoModelForSequenceClassification

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path, head="seqcls", num_labels=1))
    llm = LLM(str(d))
    got = llm.rerank(QUERY, DOCS)
    hf = AutoModelForSequenceClassification.from_pretrained(d).eval()
    for i, doc in enumerate(DOCS):  # the byte tokenizer's pair template: the two texts' tokens in a row
        ids = llm.tokenizer.encode(QUERY) + llm.tokenizer.encode(doc)
        with torch.no_grad():
            want = torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0]).item()
        assert abs(got[i] - want) < 2e-6, (i, got[i], want)
    np.testing.assert_allclose(llm.classify([QUERY + DOCS[0]])[:, 0], got[:1], atol=1e-6)


@pytest.mark.parametrize("sharded", [False, True])
def test_qwen3_reranker_overrides_match_transformers(tmp_path, sharded):
    from transformers import AutoModelForCausalLM

    # sharded: an untied LM head in the last of 3 files, the embedding in the first (its rows must not be read)
    d = add_byte_tokenizer(make_tiny_model("qwen3", tmp_path, shards=3)) if sharded else tiny_qwen3_causal()
    assert pooling_task(str(d)) is None  # a causal LM generates unless told otherwise
    assert pooling_task(str(d), hf_overrides=QWEN3_RERANKER_OVERRIDES) == "classify"
    llm = LLM(str(d), hf_overrides=QWEN3_RERANKER_OVERRIDES)
    got = llm.rerank(QUERY, DOCS)
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    no, yes = (llm.tokenizer.encode(t)[0] for t in ("n", "y"))
    for i, doc in enumerate(DOCS):
        with torch.no_grad():
            logits = hf(torch.tensor([llm.tokenizer.encode(QUERY + doc)])).logits[0, -1]
        want = torch.softmax(logits[[no, yes]], -1)[1].item()
        assert abs(got[i] - want) < 2e-6, (i, got[i], want)
    assert llm.labels == ("y",)


def test_problem_types_and_generative_loads(tmp_path):
    """/classify's scores follow problem_type; a generative load still refuses a classifier's head and a
    bare base model's names (only pooling loads accept them)."""
    from transformers import AutoModelForSequenceClassification

    from jaxserve.engine.llm_engine import load_model
    from jaxserve.loader.safetensors_loader import SafetensorsError

    d = add_byte_tokenizer(make_tiny_model("qwen2", tmp_path, head="seqcls", num_labels=2))
    hf = AutoModelForSequenceClassification.from_pretrained(d).eval()
    ids = LLM(str(d)).tokenizer.encode(TEXTS[0])
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    cfg = json.loads((d / "config.json").read_text())
    for problem, want in [("regression", logits), ("multi_label_classification", torch.sigmoid(logits)),
                          ("single_label_classification", torch.softmax(logits, -1))]:
        (d / "config.json").write_text(json.dumps({**cfg, "problem_type": problem}))
        np.testing.assert_allclose(LLM(str(d)).classify(TEXTS[0])[0], want.numpy(), atol=2e-6, err_msg=problem)
    with pytest.raises(SafetensorsError, match="score.weight"):
        load_model(str(d))
    base = add_byte_tokenizer(make_tiny_model("llama", tmp_path, head="base"))
    with pytest.raises(SafetensorsError, match="unexpected tensor"):
        load_model(str(base))
    # a reward model head is not a bare *Model: not served as an embedding model
    reward = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**reward, "architectures": ["LlamaForRewardModel"]}))
    assert pooling_task(str(base)) is None
    (base / "config.json").write_text(json.dumps({**reward, "is_causal": False}))
    with pytest.raises(DecoderPoolingError, match="is_causal"):
        LLM(str(base))


def test_refusals(tmp_path):
    d = tiny_qwen3_causal()
    with pytest.raises(DecoderPoolingError, match="unsupported key"):
        LLM(str(d), hf_overrides={**QWEN3_RERANKER_OVERRIDES, "num_hidden_layers": 1})
    with pytest.raises(DecoderPoolingError, match="not one token"):
        LLM(str(d), hf_overrides={**QWEN3_RERANKER_OVERRIDES, "classifier_from_token": ["no", "yes"]})
    with pytest.raises(DecoderPoolingError, match="two tokens"):
        LLM(str(d), hf_overrides={**QWEN3_RERANKER_OVERRIDES, "classifier_from_token": ["y"]})
    with pytest.raises(DecoderPoolingError, match="must be a list"):
        LLM(str(d), hf_overrides={**QWEN3_RERANKER_OVERRIDES, "architectures": "Qwen3ForSequenceClassification"})
    with pytest.raises(DecoderPoolingError, match="classifier_from_token"):  # a causal LM has no score head
        LLM(str(d), task="classify")
    with pytest.raises(ValueError, match="task"):
        LLM(str(d), task="pool")
    with pytest.raises(ValueError, match="pooling models"):
        LLM(str(d), task="generate", hf_overrides=QWEN3_RERANKER_OVERRIDES)
    for kw in ({"max_loras": 2}, {"lora": [str(d)]}):  # adapters change generation only
        with pytest.raises(ValueError, match="lora adapters apply to generative models only"):
            LLM(str(d), task="embed", **kw)
    # task="embed" pools a causal LM (last token, normalized)
    emb = LLM(str(d), task="embed").embed(["hello", "hi"])
    assert emb.shape == (2, 64)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    # Matryoshka: `dimensions` cuts the embedding and normalizes it again, for the sizes the config allows
    mrl = LLM(str(d), task="embed", hf_overrides={"matryoshka_dimensions": [16, 32]})
    full = mrl.embed(["hello", "hi"])
    np.testing.assert_allclose(full, emb, atol=1e-6)
    short = mrl.embed(["hello", "hi"], dimensions=16)
    np.testing.assert_allclose(short, full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True), atol=1e-6)
    with pytest.raises(ValueError, match="16, 32"):
        mrl.embed("hi", dimensions=20)
    with pytest.raises(ValueError, match="Matryoshka"):
        LLM(str(d), task="embed").embed("hi", dimensions=16)
    # a classifier head that does not match the config
    c = add_byte_tokenizer(make_tiny_model("llama", tmp_path, head="seqcls", num_labels=2))
    cfg = json.loads((c / "config.json").read_text())
    cfg["id2label"] = {"0": "a", "1": "b", "2": "c"}
    cfg.pop("label2id", None)
    (c / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DecoderPoolingError, match="score.weight"):
        LLM(str(c))


@pytest.fixture(scope="module")
def classify_server(server_factory):
    return server_factory("classify")


def test_classify_rerank_score_endpoints(classify_server):
    url = classify_server.url
    llm = LLM(str(tiny_qwen3_causal()), hf_overrides=QWEN3_RERANKER_OVERRIDES)
    want = llm.rerank(QUERY, DOCS)
    status, r = post_json(f"{url}/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert status == 200, r
    assert [x["index"] for x in r["results"]] == list(np.argsort(-want))
    np.testing.assert_allclose([x["relevance_score"] for x in r["results"]], np.sort(want)[::-1], atol=1e-6)
    status, r = post_json(f"{url}/score", {"text_1": QUERY, "text_2": DOCS})
    assert status == 200
    np.testing.assert_allclose([x["score"] for x in r["data"]], want, atol=1e-6)
    status, r = post_json(f"{url}/classify", {"input": [QUERY + d for d in DOCS]})
    assert status == 200, r
    assert [x["index"] for x in r["data"]] == list(range(len(DOCS)))
    assert all(x["label"] == "y" and x["num_classes"] == 1 for x in r["data"])
    np.testing.assert_allclose([x["probs"][0] for x in r["data"]], want, atol=1e-6)
    assert r["usage"]["prompt_tokens"] == sum(len(QUERY + d) for d in DOCS)  # one token per byte
    for path, body, param in [("/v1/classify", {"input": []}, "input"),
                              ("/v1/classify", {"input": "x" * 300}, "input"),
                              ("/v1/classify", {"input": "hi", "temperature": 1}, None),
                              ("/v1/embeddings", {"input": "hello"}, "model"),
                              ("/v1/completions", {"prompt": "hi"}, "model")]:
        status, err = post_json(f"{url}{path}", body)
        assert status == 400, (path, body, err)
        validate_schema(err, "ErrorResponse")
        if param:
            assert err["error"]["param"] == param, (path, body, err)
