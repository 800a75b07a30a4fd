"""LoRA adapters merged at load (loader/lora.py) against PEFT's own merge_and_unload in transformers:
a tiny random Llama with an adapter on attention and MLP projections (per-module rank and alpha
patterns, rsLoRA), every position's log_softmax through the paged cache; the real SmolLM2 GGUF with an
adapter on packed weights (dequantized, merged, kept dense) against the dequantized model plus the
update; and the refusals."""

import json

import numpy as np
import pytest

from hf_tiny import make_tiny_model
from jaxserve.engine.llm_engine import load_model
from jaxserve.loader.lora import LoraError
from test_parity_hf import check_paged_parity
from tiny_tokenizer import add_byte_tokenizer


def _adapter(model, out, **kw):
    """A PEFT LoRA adapter of `model` with random A and B (PEFT would start B at zero), saved to `out`."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    conf = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kw)
    pm = get_peft_model(model, conf)
    pm.save_pretrained(out)
    return pm


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_adapter_matches_peft(tmp_path, rslora):
    import transformers

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    base = transformers.AutoModelForCausalLM.from_pretrained(d)
    pm = _adapter(base, tmp_path / "adapter", r=4, lora_alpha=8, use_rslora=rslora,
                  target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
                  rank_pattern={"down_proj": 2}, alpha_pattern={"layers.1.self_attn.q_proj": 3})
    merged = tmp_path / "merged"
    pm.merge_and_unload().save_pretrained(merged)  # transformers' reference: the merged model
    lm = load_model(str(d), lora=(str(tmp_path / "adapter"),))
    check_paged_parity(merged, lm.cfg, lm.weights)


def test_gguf_adapter_matches_peft(tmp_path):
    """A llama.cpp LoRA GGUF (tests/gguf_adapter.py: the PEFT adapter converted as convert_lora_to_gguf.py
    does, q/k rows permuted) merges to the same model as PEFT's merge_and_unload (per-module ranks:
    alpha / r per tensor, as llama.cpp scales); an f16 file reads within f16 rounding; a base-model GGUF
    or a token-embedding adapter is refused by name."""
    import gguf
    import transformers

    from gguf_adapter import write_gguf_adapter
    from jaxserve.loader.lora import open_adapter

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    base = transformers.AutoModelForCausalLM.from_pretrained(d)
    pm = _adapter(base, tmp_path / "adapter", r=4, lora_alpha=8, rank_pattern={"down_proj": 2},
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    pm.merge_and_unload().save_pretrained(tmp_path / "merged")
    heads = (base.config.num_attention_heads, base.config.num_key_value_heads)
    f32 = write_gguf_adapter(tmp_path / "adapter", tmp_path / "a32.gguf", *heads)
    lm = load_model(str(d), lora=(str(f32),))
    check_paged_parity(tmp_path / "merged", lm.cfg, lm.weights)
    peft = open_adapter(tmp_path / "adapter", lm.cfg).deltas
    f16 = open_adapter(write_gguf_adapter(tmp_path / "adapter", tmp_path / "a16.gguf", *heads, np.float16),
                       lm.cfg).deltas
    assert set(f16) == set(peft) and len(peft) == 2 * 7
    for k, (a, b, scale) in peft.items():
        np.testing.assert_allclose(f16[k][0], a, rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(f16[k][1], b, rtol=1e-3, atol=1e-4)
        assert f16[k][2] == scale
    w = gguf.GGUFWriter(str(tmp_path / "emb.gguf"), "llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_tensor("token_embd.weight.lora_a", np.zeros((2, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(LoraError, match="'token_embd.weight.lora_a' is not a LoRA A/B of a linear layer"):
        load_model(str(d), lora=(str(tmp_path / "emb.gguf"),))
    from model_files import smollm2_gguf

    with pytest.raises(LoraError, match="general.type 'model'.*not a LoRA adapter"):
        load_model(str(d), lora=(str(smollm2_gguf()),))


def test_adapter_on_packed_gguf_weights(tmp_path):
    """SmolLM2's Q4_1 GGUF: targets arrive packed, are dequantized and merged; the rest stays packed."""
    import jax

    from model_files import smollm2_gguf
    from safetensors.numpy import save_file

    cfg = load_model(str(smollm2_gguf()), packed=False).cfg
    rng = np.random.default_rng(0)
    D, Q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    a = (rng.standard_normal((2, D)) * 0.05).astype(np.float32)
    b = (rng.standard_normal((Q, 2)) * 0.05).astype(np.float32)
    ad = tmp_path / "adapter"
    ad.mkdir()
    save_file({"base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight": a,
               "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight": b}, str(ad / "adapter_model.safetensors"))
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                       "target_modules": ["q_proj"]}))
    dense = load_model(str(smollm2_gguf()), packed=False)
    merged = load_model(str(smollm2_gguf()), lora=(str(ad),))  # packed (native CPU kernel) elsewhere
    layers = merged.weights["layers"]
    q3 = layers[3]["q"] if isinstance(layers, list) else layers["q"][3]
    want = np.asarray(dense.weights["layers"]["q"][3]) + 2.0 * (a.T @ b.T)
    np.testing.assert_allclose(np.asarray(q3), want, atol=1e-5)
    if isinstance(layers, list):  # the other layers' q stay packed
        assert not isinstance(layers[2]["q"], jax.Array)


def test_refusals(tmp_path):
    import transformers

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    base = transformers.AutoModelForCausalLM.from_pretrained(d)
    _adapter(base, tmp_path / "a", r=2, lora_alpha=2, target_modules=["q_proj"])
    conf = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    for change, match in [({"use_dora": True}, "use_dora"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                          ({"bias": "all"}, "biases"), ({"peft_type": "IA3"}, "LORA")]:
        (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**conf, **change}))
        with pytest.raises(LoraError, match=match):
            load_model(str(d), lora=(str(tmp_path / "a"),))
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(LoraError, match="adapter_config.json"):
        load_model(str(d), lora=(str(tmp_path),))
    other = add_byte_tokenizer(make_tiny_model("llama", tmp_path / "wide", hidden_size=96))
    with pytest.raises(LoraError, match="adapter"):  # an adapter made for another model's shapes
        load_model(str(other), lora=(str(tmp_path / "a"),))
    from jaxserve.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="lora"):
        EngineConfig(lora="path")
    assert EngineConfig(lora=["x"]).lora == ("x",)
