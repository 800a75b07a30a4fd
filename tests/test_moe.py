"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) against Hugging
Face transformers on tiny random checkpoints: every position's log_softmax through the paged KV cache
(a ragged batch, chunked continuation, decodes; scanned and unrolled layers), greedy generation through
`LLM`, the routing itself against an independent per-token loop, and the refusals (missing experts,
HF config and GGUF export; GGUF files: tests/test_moe_gguf.py; packed experts: tests/test_moe_quant.py)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import MOE_FAMILIES, make_tiny_model
from jaxserve.loader.hf_config import model_config_from_dir
from jaxserve.loader.materialize import materialize
from jaxserve.loader.safetensors_loader import SafetensorsError, iter_safetensors_tensors
from test_parity_hf import check_paged_parity


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_parity_ragged_and_paged_decode(family, tmp_path):
    d = make_tiny_model(family, tmp_path)
    cfg = model_config_from_dir(d)
    assert cfg.is_moe and cfg.arch == family
    weights = materialize(cfg, iter_safetensors_tensors(d, cfg), jnp.float32)
    assert weights["layers"]["experts_gate"].shape == (cfg.num_layers, cfg.num_experts, cfg.hidden_size,
                                                       cfg.moe_intermediate_size)
    check_paged_parity(d, cfg, weights)


@pytest.mark.parametrize("experts,k,tokens", [(8, 2, 1), (8, 2, 300), (32, 4, 3), (32, 4, 70), (32, 4, 400),
                                               (32, 4, 4500)])
def test_routing_matches_a_per_token_loop(experts, k, tokens):
    """moe_mlp against the plain definition (each token through its k experts, plus Qwen2-MoE's gated
    shared expert) on every path: one-row tiles (decode), 16-, 64- and 256-row tiles (prompt chunks) and
    all experts on every token (few experts, many pairs)."""
    from jaxserve.config import ModelConfig
    from jaxserve.models import moe

    D, F, S = 32, 24, 40
    cfg = ModelConfig(arch="qwen2_moe", vocab_size=10, hidden_size=D, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, num_experts=experts, experts_per_token=k,
                      moe_intermediate_size=F, norm_topk_prob=False, shared_expert_size=S)
    rng = np.random.default_rng(experts + tokens)
    r = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.3)
    w = {"router": r(D, experts), "experts_gate": r(experts, D, F), "experts_up": r(experts, D, F),
         "experts_down": r(experts, F, D), "shared_gate": r(D, S), "shared_up": r(D, S), "shared_down": r(S, D),
         "shared_expert_gate": r(D, 1)}
    h = rng.standard_normal((tokens, D)).astype(np.float32)
    # full f32 matmuls: a GPU's default TF32 would flip near-tied router choices (measured on the H200)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(lambda x: moe.moe_mlp(cfg, x, w, jax.nn.silu))(h))
    w = {n: np.asarray(a) for n, a in w.items()}
    silu = lambda a: a / (1 + np.exp(-a))
    want = np.zeros_like(h)
    for t in range(tokens):
        logits = h[t] @ w["router"]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        for e in np.argsort(-p)[:k]:  # qwen2_moe: no renormalisation of the chosen weights
            want[t] += p[e] * (silu(h[t] @ w["experts_gate"][e]) * (h[t] @ w["experts_up"][e])) @ w["experts_down"][e]
        shared = (silu(h[t] @ w["shared_gate"]) * (h[t] @ w["shared_up"])) @ w["shared_down"]
        want[t] += shared / (1 + np.exp(-(h[t] @ w["shared_expert_gate"])))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_generate_matches_transformers(tmp_path):
    import torch
    import transformers

    from jaxserve import LLM, SamplingParams
    from tiny_tokenizer import add_byte_tokenizer

    d = add_byte_tokenizer(make_tiny_model("qwen3_moe", tmp_path))
    llm = LLM(str(d), max_model_len=128, num_blocks=64)
    prompts = ["hello there", "mixture of experts"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: an EOS token is generated and passed over
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
        assert out.outputs[0].token_ids == want.tolist(), prompt


def test_refusals(tmp_path):
    from jaxserve.config import ConfigError
    from jaxserve.loader.hf_config import hf_config_from_model_config
    from jaxserve.parallel.mesh import check_tp

    d = make_tiny_model("mixtral", tmp_path)
    cfg = model_config_from_dir(d)
    with pytest.raises(ValueError, match=f"moe_intermediate_size {cfg.moe_intermediate_size}"):
        check_tp(cfg, 3)  # tensor parallelism splits each expert's hidden size (tests/test_tensor_parallel.py)
    assert check_tp(cfg, 2)["moe_mlp"] == "model"
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        hf_config_from_model_config(cfg)
    # an expert missing from the checkpoint
    from safetensors.numpy import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SafetensorsError, match=r"experts \[2\] are missing"):
        materialize(cfg, iter_safetensors_tensors(d, cfg), jnp.float32)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "model_type": "qwen3_moe", "mlp_only_layers": [0]}))
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        model_config_from_dir(d)
    # GGUF export: a shared expert only where llama.cpp's arch has one (qwen2moe, gated)
    import dataclasses

    from tiny_tokenizer import add_byte_tokenizer
    from tools.convert.gguf_export import ExportError, _check

    q = add_byte_tokenizer(make_tiny_model("qwen3_moe", tmp_path / "q"))
    with pytest.raises(ExportError, match="a shared expert"):
        _check(dataclasses.replace(model_config_from_dir(q), shared_expert_size=16))


def test_config_mapping_edge_cases():
    """Layer types and expert counts as transformers reads them from configs the tiny models do not use."""
    import transformers

    from jaxserve.loader.hf_config import model_config_from_hf

    for cls, want in ((transformers.Qwen2MoeConfig, ("sliding", "full", "full", "full")),
                      (transformers.Qwen3MoeConfig, ("sliding",) * 4)):
        hf = cls(num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2).to_dict()
        hf.pop("layer_types", None)  # as older config.json files: the rule decides
        assert model_config_from_hf(hf).layer_types == want, cls.__name__
    mixtral = dict(model_type="mixtral", num_experts=16, num_experts_per_tok=2, vocab_size=10, hidden_size=32,
                   intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    assert model_config_from_hf(mixtral).num_experts == 16  # transformers' alias of num_local_experts
