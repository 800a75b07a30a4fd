"""Mixture-of-experts GGUF files (Mixtral = `llama` with experts, qwen2moe, qwen3moe): our exporter's
files read back as the same model and run like transformers; quantized expert stacks come packed with
a leading expert dim and dequantize exactly to the dense load; files written here the way llama.cpp's
converter writes them (3-D `_exps` tensors, or older Mixtral's one tensor per expert; permuted q/k)
load to the safetensors loader's weights bit for bit; malformed files fail naming the tensor."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import make_tiny_model
from jaxserve.config import ConfigError
from jaxserve.loader.gguf_loader import gguf_model_config, iter_gguf_tensors, meta_get, open_gguf
from jaxserve.loader.hf_config import model_config_from_dir
from jaxserve.loader.materialize import materialize
from jaxserve.loader.safetensors_loader import iter_safetensors_tensors
from jaxserve.models.weights import iter_checked
from jaxserve.quant.qweight import QWeight, dequantize
from test_parity_hf import check_paged_parity
from tiny_tokenizer import add_byte_tokenizer

# Mixtral: no sliding window (a llama GGUF has none); Qwen2-MoE: a shared expert of a Q8_0-able width
_TINY = {"mixtral": dict(sliding_window=None), "qwen2_moe": dict(shared_expert_intermediate_size=64),
         "qwen3_moe": {}}
_MOE_FIELDS = ("arch", "num_experts", "experts_per_token", "moe_intermediate_size", "norm_topk_prob",
               "shared_expert_size", "attention_bias", "qk_norm", "num_heads", "num_kv_heads", "head_dim")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            made[family] = add_byte_tokenizer(make_tiny_model(family, tmp_path_factory.mktemp(family),
                                                              **_TINY[family]))
        return made[family]

    return get


def _export(src, out, dtype):
    from tools.convert import export

    assert export.main(["--model", str(src), "--format", "gguf", "--out", str(out), "--dtype", dtype]) == 0
    return open_gguf(out)


def _same_moe_config(cfg, want):
    assert {f: getattr(cfg, f) for f in _MOE_FIELDS} == {f: getattr(want, f) for f in _MOE_FIELDS}


@pytest.mark.parametrize("family", sorted(_TINY))
def test_exported_gguf_reads_back_and_matches_transformers(family, hf_dir, tmp_path):
    d = hf_dir(family)
    rd = _export(d, tmp_path / "m.gguf", "f32")
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[family]
    assert meta_get(rd, "general.architecture") == arch
    assert meta_get(rd, f"{arch}.expert_weights_norm") is None  # the arch's own renormalization
    types = {t.name: (t.tensor_type.name, [int(s) for s in t.shape]) for t in rd[0].tensors}
    want = model_config_from_dir(d)
    E, D, F = want.num_experts, want.hidden_size, want.moe_intermediate_size
    assert types["blk.1.ffn_gate_inp.weight"] == ("F32", [D, E])
    assert types["blk.1.ffn_down_exps.weight"] == ("F32", [F, D, E])  # ggml order: {in, out, expert}
    if want.shared_expert_size:
        assert types["blk.1.ffn_gate_inp_shexp.weight"] == ("F32", [D])  # squeezed, as llama.cpp's converter
    cfg = gguf_model_config(rd)
    _same_moe_config(cfg, want)
    check_paged_parity(d, cfg, materialize(cfg, iter_gguf_tensors(rd, cfg), jnp.float32))


def test_q8_0_experts_come_packed_per_layer_and_dequantize_to_the_dense_load(hf_dir, tmp_path):
    """Qwen2-MoE (routed and shared experts): one QWeight per (name, layer) with batch_shape (E,)."""
    rd = _export(hf_dir("qwen2_moe"), tmp_path / "q8.gguf", "q8_0")
    cfg = gguf_model_config(rd)
    types = {t.name: t.tensor_type.name for t in rd[0].tensors}
    assert types["blk.0.ffn_up_exps.weight"] == "Q8_0" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    _check_packed(rd, cfg, packed_names={"layers.experts_gate", "layers.experts_up", "layers.experts_down",
                                         "layers.shared_gate", "layers.shared_up", "layers.shared_down"})


def _check_packed(rd, cfg, packed_names):
    dense = {(n, i): a for n, i, a in iter_gguf_tensors(rd, cfg)}
    seen = set()
    for n, i, a in iter_checked(cfg, iter_gguf_tensors(rd, cfg, packed=True)):
        if n.startswith("layers.experts_"):
            assert isinstance(a, QWeight) and a.batch_shape == (cfg.num_experts,), (n, i)
        if isinstance(a, QWeight):
            seen.add(n)
            np.testing.assert_array_equal(np.asarray(dequantize(a)), dense[n, i], err_msg=f"{n}[{i}]")
        else:  # routers stay f32
            assert a.dtype == np.float32 and n not in packed_names, n
    assert packed_names <= seen


# ---- files written the way llama.cpp's converter writes them (not through our exporter) ------------

def _llama_cpp_file(d, path, arch, *, experts_type="F32", per_expert=False, drop=(), meta=None):
    """Qwen3-MoE (`qwen3moe`) or Mixtral (`llama`) from the HF checkpoint in d, under llama.cpp's
    names and keys: router ffn_gate_inp [E, D] F32, experts stacked into ffn_{gate,up,down}_exps (or,
    per_expert, older Mixtral files' ffn_gate.<e>.weight), q/k permuted for `llama`. drop: tensors to
    leave out; meta: key overrides."""
    import gguf
    from safetensors.numpy import load_file

    c = json.loads((d / "config.json").read_text())
    sd = load_file(d / "model.safetensors")
    L, H, KV = c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]
    E = c.get("num_local_experts") or c["num_experts"]
    keys = dict(block_count=L, context_length=c["max_position_embeddings"], embedding_length=c["hidden_size"],
                feed_forward_length=c["intermediate_size"], head_count=H, head_count_kv=KV,
                rope_freq_base=(c.get("rope_parameters") or c)["rope_theta"], layer_norm_rms_eps=c["rms_norm_eps"],
                expert_count=E, expert_used_count=c["num_experts_per_tok"], key_length=c["head_dim"],
                value_length=c["head_dim"])
    if arch == "qwen3moe":
        keys["expert_feed_forward_length"] = c["moe_intermediate_size"]
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in {**keys, **(meta or {})}.items():
        getattr(w, f"add_{k}")(v)

    def put(name, a, qtype="F32"):
        if name not in drop:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a, np.float32), t), raw_dtype=t)

    def permute(a, heads):  # the converter's interleaving of each head's two rotary halves
        return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"])
    projs = {"gate": "w1", "down": "w2", "up": "w3"} if arch == "llama" else \
        {"gate": "gate_proj", "down": "down_proj", "up": "up_proj"}
    for i in range(L):
        p, hf = f"blk.{i}.", f"model.layers.{i}."
        q, k = sd[hf + "self_attn.q_proj.weight"], sd[hf + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = permute(q, H), permute(k, KV)
        put(p + "attn_norm.weight", sd[hf + "input_layernorm.weight"])
        put(p + "attn_q.weight", q)
        put(p + "attn_k.weight", k)
        put(p + "attn_v.weight", sd[hf + "self_attn.v_proj.weight"])
        put(p + "attn_output.weight", sd[hf + "self_attn.o_proj.weight"])
        if arch == "qwen3moe":
            put(p + "attn_q_norm.weight", sd[hf + "self_attn.q_norm.weight"])
            put(p + "attn_k_norm.weight", sd[hf + "self_attn.k_norm.weight"])
        put(p + "ffn_norm.weight", sd[hf + "post_attention_layernorm.weight"])
        moe = hf + ("block_sparse_moe." if arch == "llama" else "mlp.")
        put(p + "ffn_gate_inp.weight", sd[moe + "gate.weight"])
        for proj, hf_proj in projs.items():
            per = [sd[f"{moe}experts.{e}.{hf_proj}.weight"] for e in range(E)]
            if per_expert:
                for e in range(E):
                    put(f"{p}ffn_{proj}.{e}.weight", per[e], experts_type)
            else:
                put(f"{p}ffn_{proj}_exps.weight", np.stack(per), experts_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_gguf(path)


@pytest.mark.parametrize("layout", ["qwen3moe", "mixtral-per-expert"])
def test_llama_cpp_layout_loads_the_checkpoint_weights(layout, hf_dir, tmp_path):
    """Names, keys, expert stacking and the q/k permutation, checked against the safetensors loader
    bit for bit; the Qwen3-MoE file also runs like transformers."""
    family, arch = ("qwen3_moe", "qwen3moe") if layout == "qwen3moe" else ("mixtral", "llama")
    d = hf_dir(family)
    rd = _llama_cpp_file(d, tmp_path / "m.gguf", arch, per_expert=layout != "qwen3moe")
    cfg, want = gguf_model_config(rd), model_config_from_dir(d)
    _same_moe_config(cfg, want)
    ours = {(n, i): a for n, i, a in iter_checked(cfg, iter_gguf_tensors(rd, cfg))}
    ref = {(n, i): np.asarray(a, np.float32) for n, i, a in iter_safetensors_tensors(d, want)}
    assert ours.keys() == ref.keys()
    for key, a in ours.items():
        np.testing.assert_array_equal(a, ref[key], err_msg=str(key))
    if layout == "qwen3moe":
        check_paged_parity(d, cfg, materialize(cfg, iter_gguf_tensors(rd, cfg), jnp.float32))


@pytest.mark.parametrize("layout", ["qwen3moe", "mixtral-per-expert"])
def test_q4_0_experts_pack_exactly(layout, hf_dir, tmp_path):
    """Q4_0 experts (gguf.quants' quantizer): packed stacks dequantize to the dense load, which is
    gguf's own dequantizer's value of each expert."""
    import gguf

    family, arch = ("qwen3_moe", "qwen3moe") if layout == "qwen3moe" else ("mixtral", "llama")
    rd = _llama_cpp_file(hf_dir(family), tmp_path / "q4.gguf", arch, experts_type="Q4_0",
                         per_expert=layout != "qwen3moe")
    cfg = gguf_model_config(rd)
    _check_packed(rd, cfg, packed_names={"layers.experts_gate", "layers.experts_up", "layers.experts_down"})
    tensors = {t.name: t for t in rd[0].tensors}
    down = next(a for n, i, a in iter_gguf_tensors(rd, cfg) if (n, i) == ("layers.experts_down", 1))
    for e in (0, cfg.num_experts - 1):
        t = tensors["blk.1.ffn_down_exps.weight" if arch == "qwen3moe" else f"blk.1.ffn_down.{e}.weight"]
        raw = t.data[e] if arch == "qwen3moe" else t.data
        theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0)  # [out, in]
        np.testing.assert_array_equal(down[e], theirs.T)


def test_malformed_moe_files_fail_naming_the_tensor(hf_dir, tmp_path):
    import gguf

    d = hf_dir("qwen3_moe")

    def config(name, arch="qwen3moe", **kw):
        src = d if arch == "qwen3moe" else hf_dir("mixtral")
        return gguf_model_config(_llama_cpp_file(src, tmp_path / f"{name}.gguf", arch, **kw))

    with pytest.raises(ConfigError, match=r"missing tensor\(s\) blk\.1\.ffn_up_exps\.weight"):
        config("missing", drop={"blk.1.ffn_up_exps.weight"})
    with pytest.raises(ConfigError, match=r"expert_count is 4, but tensor\(s\) blk\.0\.ffn_gate_inp\.weight"):
        config("count", meta={"expert_count": 4})  # the tensors hold 8
    with pytest.raises(ConfigError, match=r"expert_gating_func 2 \(sigmoid\) is not supported"):
        config("sigmoid", meta={"expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID})
    with pytest.raises(ConfigError, match=r"expert_weights_scale 2.5"):
        config("scale", meta={"expert_weights_scale": 2.5})
    rd = _llama_cpp_file(d, tmp_path / "width.gguf", "qwen3moe", meta={"expert_feed_forward_length": 16})
    cfg = gguf_model_config(rd)
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.ffn_gate_exps\.weight' has ggml shape \[64, 32, 8\]"):
        list(iter_gguf_tensors(rd, cfg))
    # older per-expert Mixtral files: each missing expert is named
    with pytest.raises(ConfigError, match=r"missing tensor\(s\) blk\.0\.ffn_down\.3\.weight"):
        config("per-expert", arch="llama", per_expert=True, drop={"blk.0.ffn_down.3.weight"})


def test_export_keeps_a_renormalization_llama_cpp_would_not_do(tmp_path, caplog):
    """A Qwen2-MoE that renormalizes its top-k weights: llama.cpp's qwen2moe graph never does, so the
    exporter writes expert_weights_norm (with a warning), and our loader follows it."""
    d = add_byte_tokenizer(make_tiny_model("qwen2_moe", tmp_path, norm_topk_prob=True,
                                           shared_expert_intermediate_size=64))
    rd = _export(d, tmp_path / "n.gguf", "f32")
    assert meta_get(rd, "qwen2moe.expert_weights_norm") is True
    assert "llama.cpp ignores" in caplog.text
    assert gguf_model_config(rd).norm_topk_prob


@pytest.mark.parametrize("packed", [None, True])
def test_quantized_moe_gguf_runs_packed_like_dequantized(packed, hf_dir, tmp_path):
    """A Q8_0 Qwen2-MoE GGUF through `LLM`: experts packed on the native CPU kernel (packed None, the
    CPU default) or as QWeights on the jnp reference (True) give the dense load's tokens and prompt
    logprobs (the native kernel rounds activations to 16 bits)."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.kernels.quant_matmul import cpu_native

    path = tmp_path / "q8.gguf"
    _export(hf_dir("qwen2_moe"), path, "q8_0")
    kw = dict(max_model_len=64, num_blocks=32, max_num_seqs=1, prefill_chunk_size=32, token_buckets=(32,),
              seq_buckets=(1,))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    runs = {}
    for p in (False, packed):
        llm = LLM(str(path), packed_weights=p, **kw)
        layers = llm.engine.runner.weights["layers"]
        up = (layers[0] if isinstance(layers, list) else layers)["experts_up"]
        want = (cpu_native.CpuQWeight if cpu_native.available() else jnp.ndarray) if p is None else \
            QWeight if p else jnp.ndarray
        assert isinstance(up, want), (p, type(up))
        o = llm.generate(["experts in a file"], params)[0]
        runs[p] = (o.outputs[0].token_ids, np.array([v for v, _ in o.prompt_logprobs[1:]]))
    assert runs[packed][0] == runs[False][0]
    np.testing.assert_allclose(runs[packed][1], runs[False][1], atol=5e-3 if packed is None else 1e-4)
