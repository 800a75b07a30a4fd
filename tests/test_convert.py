"""tools/convert: pre-quantized jaxserve checkpoints, and export to GGUF / Hugging Face safetensors.

Tiny random models (hf_tiny) throughout: a checkpoint runs exactly like ISQ at load (packed or
dequantized) without quantizing anything; an exported GGUF holds our weights bit for bit and
transformers reads it; an exported HF directory round-trips its config and transformers runs it.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_tiny import make_tiny_model
from paged_model import PagedModel
from tiny_tokenizer import add_byte_tokenizer

REPO = Path(__file__).resolve().parents[1]
IDS = [5, 77, 3, 200, 13, 9, 100, 42, 7, 7, 150, 31]


def _tiny(family, tmp_path, **kw):
    return add_byte_tokenizer(make_tiny_model(family, tmp_path, **kw))


def _generate(model, **kw):
    """Greedy tokens and prompt logprobs through the engine (compiling only the shapes used)."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.quant.qweight import QWeight

    ecfg = EngineConfig(max_model_len=64, max_num_seqs=1, kv_mem_mb=8, decode_steps=1, prefill_chunk_size=32, **kw)
    llm = LLM.from_engine(LLMEngine(model, engine_config=ecfg, warmup=False))
    layers = llm.engine.runner.weights["layers"]
    packed = any(isinstance(w, QWeight) for w in (layers[0] if isinstance(layers, list) else layers).values())
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    o = llm.generate("hello quantized world", sp, use_tqdm=False)[0]
    return o.outputs[0].token_ids, np.array([lp for lp, _ in o.prompt_logprobs[1:]]), packed


def _ours(model, ids=IDS):
    from jaxserve.engine.llm_engine import load_model

    lm = load_model(str(model), packed=False)
    return PagedModel(lm.cfg, lm.weights).step([(0, ids, 0)])[0], lm


def _theirs(model_dir, gguf_file=None, ids=IDS):
    import torch
    import transformers

    torch.set_num_threads(1)
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    m = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return torch.log_softmax(m(torch.tensor([ids])).logits[0].double(), -1).numpy()


# ---------------------------------------------------------------------------------- checkpoints
def test_quantized_checkpoint_runs_like_isq_without_quantizing(tmp_path, monkeypatch):
    import jaxserve.quant.isq as isq
    from jaxserve.loader.source import resolve_model
    from safetensors import safe_open
    from tools.convert import quantize

    src = _tiny("llama", tmp_path)
    ck = tmp_path / "ck"
    assert quantize.main(["--model", str(src), "--isq", "q4k", "--out", str(ck)]) == 0
    assert resolve_model(str(ck)).kind == "jaxserve"
    index = json.loads((ck / "jaxserve_checkpoint.json").read_text())
    assert index["version"] == 1 and index["tensors"]["layers.1.q"]["qmeta"]["fmt"] == "q4k"
    with safe_open(str(ck / "model.safetensors"), "np") as f:  # any safetensors reader opens it
        assert {"layers.1.q.q0", "layers.1.q.d", "layers.1.q.sc", "embed"} <= set(f.keys())
        assert f.get_tensor("layers.1.q.q0").dtype == np.uint8

    # The reference: ISQ at load, dequantized to f32 (the exact function of the q4k weights).
    ref_tokens, ref_lps, ref_packed = _generate(str(src), isq="q4k", packed_weights=False)
    assert not ref_packed

    def no_quantizing(*a, **k):
        raise AssertionError("quantized at load")

    monkeypatch.setattr(isq, "quantize", no_quantizing)
    for packed in (False, True):
        tokens, lps, is_packed = _generate(str(ck), packed_weights=packed)
        assert is_packed == packed
        assert tokens == ref_tokens
        assert np.abs(lps - ref_lps).max() <= 1e-4
    # The CPU default (native quantized kernel, ~16-bit activations; measured 7e-4 here) is close too.
    tokens, lps, _ = _generate(str(ck))
    assert tokens == ref_tokens
    assert np.abs(lps - ref_lps).max() <= 5e-3


def test_hub_repo_holding_a_checkpoint():
    from jaxserve.loader.source import _plan

    listing = ["README.md", "jaxserve_checkpoint.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "tokenizer.json", "tokenizer_config.json"]
    kind, required, optional = _plan("org/m-q4k", listing, None, None)
    assert kind == "jaxserve" and required == listing[1:4] and optional == listing[4:]


def test_scripts_help_and_format_lists():
    from jaxserve.quant.isq import ISQ_FORMATS
    from tools.convert import quantize

    assert quantize.ISQ_FORMATS == ISQ_FORMATS  # spelt out there so --help imports no JAX
    for script, flag in (("quantize", "--isq"), ("export", "--format")):
        r = subprocess.run([sys.executable, "-m", f"tools.convert.{script}", "--help"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and flag in r.stdout and "--model" in r.stdout, r.stderr


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    from jaxserve.engine.llm_engine import load_model
    from jaxserve.loader.checkpoint import CheckpointError
    from tools.convert import export, quantize

    src = _tiny("llama", tmp_path)
    assert quantize.main(["--model", str(src), "--isq", "q9k", "--out", str(tmp_path / "x")]) == 2
    assert "unknown --isq format 'q9k'" in capsys.readouterr().err
    ck = tmp_path / "ck"
    assert quantize.main(["--model", str(src), "--isq", "q4_0", "--out", str(ck)]) == 0
    assert quantize.main(["--model", str(src), "--isq", "q4_0", "--out", str(ck)]) == 2  # not empty

    marker = ck / "jaxserve_checkpoint.json"
    good = marker.read_text()
    marker.write_text(good.replace('"version": 1', '"version": 99'))
    with pytest.raises(CheckpointError, match="format version 99 is not supported"):
        load_model(str(ck), packed=False)
    marker.write_text(good)

    tensors = load_file(str(ck / "model.safetensors"))
    del tensors["layers.1.down.scale"]
    save_file(tensors, str(ck / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'layers.1.down': leaf 'scale' \(layers.1.down.scale\) "
                                              r"is missing from model.safetensors"):
        load_model(str(ck), packed=True)

    # Gemma 2 with a query scale GGUF metadata cannot carry: refused, naming it.
    g = _tiny("gemma2", tmp_path)
    assert export.main(["--model", str(g), "--format", "gguf", "--out", str(tmp_path / "g.gguf")]) == 2
    assert "query_pre_attn_scalar 32.0" in capsys.readouterr().err


# -------------------------------------------------------------------------------------- export
def test_export_gguf_is_our_model_and_transformers_reads_it(tmp_path):
    from tools.convert import export

    src = _tiny("llama", tmp_path)
    out = tmp_path / "gguf" / "tiny.gguf"
    out.parent.mkdir()
    assert export.main(["--model", str(src), "--format", "gguf", "--out", str(out), "--dtype", "f32"]) == 0
    ref, ref_lm = _ours(src)
    got, lm = _ours(out)
    assert lm.cfg.num_heads == ref_lm.cfg.num_heads and lm.cfg.rope_theta == ref_lm.cfg.rope_theta
    assert lm.tokenizer.encode("Hi there!") == ref_lm.tokenizer.encode("Hi there!")
    assert np.abs(got - ref).max() <= 1e-5
    theirs = _theirs(out.parent, out.name)  # q/k permuted as llama.cpp expects: transformers undoes it
    assert np.abs(theirs - ref).max() <= 1e-4

    # Q8_0 blocks (gguf's quantizer): every matrix within half a step of its f32 value, and transformers
    # (gguf's dequantizer) runs the same quantized model as we do
    from jaxserve.loader.gguf_loader import gguf_model_config, iter_gguf_tensors, open_gguf

    q8 = tmp_path / "gguf" / "tiny-q8.gguf"
    assert export.main(["--model", str(src), "--format", "gguf", "--out", str(q8), "--dtype", "q8_0"]) == 0
    rf, rq = open_gguf(out), open_gguf(q8)
    exact = {(n, i): a for n, i, a in iter_gguf_tensors(rf, gguf_model_config(rf))}
    for n, i, a in iter_gguf_tensors(rq, gguf_model_config(rq)):
        w = exact[n, i]
        assert np.abs(a - w).max() <= (np.abs(w).max() / 127 * 0.51 if a.ndim == 2 else 0), (n, i)
    types = {t.name: t.tensor_type.name for t in rq[0].tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    got, _ = _ours(q8)
    assert np.abs(_theirs(q8.parent, q8.name) - got).max() <= 1e-4


_GGUF_FAMILIES = {  # tiny configs GGUF metadata can carry (Gemma: llama.cpp's query scale is head_dim)
    "qwen2": {}, "qwen3": {}, "gemma2": dict(query_pre_attn_scalar=16), "gemma3": dict(query_pre_attn_scalar=16),
    "yarn": {}, "llama3_rope": dict(max_position_embeddings=65536, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


@pytest.mark.parametrize("family", sorted(_GGUF_FAMILIES))
def test_export_gguf_other_families_read_back_the_same(family, tmp_path):
    """Biases, q/k norms, sandwich norms, sliding windows, soft-caps, yarn and llama3 (a rope_freqs
    tensor) survive the trip through GGUF metadata."""
    from tools.convert import export

    src = _tiny(family, tmp_path, **_GGUF_FAMILIES[family])
    out = tmp_path / "m.gguf"
    assert export.main(["--model", str(src), "--format", "gguf", "--out", str(out), "--dtype", "f32"]) == 0
    ref, ref_lm = _ours(src)
    got, lm = _ours(out)
    assert (lm.cfg.layer_types, lm.cfg.rope_scaling, lm.cfg.qk_norm, lm.cfg.attention_bias) == \
        (ref_lm.cfg.layer_types, ref_lm.cfg.rope_scaling, ref_lm.cfg.qk_norm, ref_lm.cfg.attention_bias)
    assert np.abs(got - ref).max() <= 1e-5


def test_gguf_tokenizer_metadata_round_trips_smollm2(tmp_path):
    """SmolLM2's byte-level BPE (merges, `smollm` digit splitting, control tokens, chat template)
    rebuilt into tokenizer.ggml.* reads back as the same tokenizer."""
    import gguf

    from jaxserve.loader.gguf_loader import gguf_model_config, meta_get, open_gguf
    from jaxserve.loader.tokenizer import Tokenizer
    from model_files import readers
    from tools.convert.gguf_export import tokenizer_metadata

    r = readers("smollm2")
    tok = Tokenizer.from_gguf(r)
    w = gguf.GGUFWriter(tmp_path / "tok.gguf", "llama")
    tokenizer_metadata(w, tok, gguf_model_config(r))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r2 = open_gguf(tmp_path / "tok.gguf")
    back = Tokenizer.from_gguf(r2)
    assert meta_get(r2, "tokenizer.ggml.pre") == "smollm"
    text = "<|im_start|>user\nIn 1969, Apollo 11 landed;  def f(x):\n    return x**2<|im_end|>"
    assert back.encode(text) == tok.encode(text) and len(tok.encode(text)) > 20
    assert (back.bos_token_id, back.eos_token_ids, back.add_bos, back.special_ids, back.chat_template) == \
        (tok.bos_token_id, tok.eos_token_ids, tok.add_bos, tok.special_ids, tok.chat_template)


@pytest.mark.parametrize("family", ["llama-from-gguf", "llama-from-checkpoint", "qwen2", "gemma3"])
def test_export_safetensors_transformers_matches_ours(family, tmp_path):
    from jaxserve.loader.hf_config import model_config_from_dir
    from tools.convert import export, quantize

    shards = []
    if family == "llama-from-gguf":  # a source without config.json: written from the ModelConfig
        src = tmp_path / "tiny.gguf"
        assert export.main(["--model", str(_tiny("llama", tmp_path)), "--format", "gguf", "--out", str(src),
                            "--dtype", "f32"]) == 0
    elif family == "llama-from-checkpoint":  # sharded both ways; written dequantized
        src, shards = tmp_path / "ck", ["--shard-size", "0.0001"]
        tiny = _tiny("llama", tmp_path)
        assert quantize.main(["--model", str(tiny), "--isq", "q6k", "--out", str(src)] + shards) == 0
        assert len(list(src.glob("model-*-of-*.safetensors"))) > 1
    else:
        src = _tiny(family, tmp_path)
    out = tmp_path / "hf"
    assert export.main(["--model", str(src), "--format", "safetensors", "--out", str(out), "--dtype", "f32"]
                       + shards) == 0
    assert (out / "model.safetensors.index.json").is_file() == bool(shards)
    ours, lm = _ours(src)
    assert model_config_from_dir(out) == lm.cfg
    theirs = _theirs(out)
    assert np.abs(theirs - ours).max() <= 1e-4
    again, lm2 = _ours(out)  # and jaxserve reads its own export
    assert np.abs(again - ours).max() <= 1e-5
    assert lm2.tokenizer.encode("Hi there!") == lm.tokenizer.encode("Hi there!")
