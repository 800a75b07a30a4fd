"""GGUF config mapping and canonical weights agree with transformers' GGUF loader.

Real files (SmolLM2 = llama arch with permuted q/k, Gemma 3 with 1+w norms) and tiny synthetic files
for the other architectures (gemma2, qwen2, qwen3), a split checkpoint and rope scaling.
"""

import math

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from jaxserve.loader.gguf_loader import gguf_model_config, iter_gguf_tensors, open_gguf, shard_paths
from jaxserve.models.weights import iter_checked
from model_files import gemma3_gguf, readers, smollm2_gguf, transformers_reuses_readers

# canonical per-layer name -> HF module path (gemma's pre-FFN norm is `pre_feedforward_layernorm`)
_HF_LAYER = {
    "layers.q": "self_attn.q_proj.weight", "layers.k": "self_attn.k_proj.weight",
    "layers.v": "self_attn.v_proj.weight", "layers.o": "self_attn.o_proj.weight",
    "layers.q_bias": "self_attn.q_proj.bias", "layers.k_bias": "self_attn.k_proj.bias",
    "layers.v_bias": "self_attn.v_proj.bias",
    "layers.q_norm": "self_attn.q_norm.weight", "layers.k_norm": "self_attn.k_norm.weight",
    "layers.gate": "mlp.gate_proj.weight", "layers.up": "mlp.up_proj.weight", "layers.down": "mlp.down_proj.weight",
    "layers.attn_norm": "input_layernorm.weight",
}


def _hf_name(name, layer, gemma):
    if layer is None:
        return {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}[name]
    if name in _HF_LAYER:
        suffix = _HF_LAYER[name]
    elif gemma:
        suffix = {"layers.post_attn_norm": "post_attention_layernorm.weight",
                  "layers.ffn_norm": "pre_feedforward_layernorm.weight",
                  "layers.post_ffn_norm": "post_feedforward_layernorm.weight"}[name]
    else:
        suffix = {"layers.ffn_norm": "post_attention_layernorm.weight"}[name]
    return f"model.layers.{layer}.{suffix}"


def _compare_weights(rd, cfg, sd):
    gemma = cfg.arch.startswith("gemma")
    used = set()
    for name, layer, ours in iter_checked(cfg, iter_gguf_tensors(rd, cfg)):
        key = _hf_name(name, layer, gemma)
        theirs = sd[key]
        used.add(key)
        assert ours.dtype == np.float32 and ours.flags.c_contiguous, key
        if ours.ndim == 2 and name != "embed":
            theirs = theirs.T  # HF Linear weights are [out, in]
        if gemma and name.endswith("norm"):
            # GGUF holds 1 + w (our effective multiplier); transformers subtracts 1 and its RMSNorm adds it back
            ours = ours - np.float32(1)
        if not np.array_equal(ours, theirs):  # (assert_array_equal is slow on the 168M-entry embedding)
            np.testing.assert_array_equal(ours, theirs, err_msg=key)
    missing = {k for k in sd if k not in used and not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert not missing, sorted(missing)[:5]


def _check_config(cfg, hf):
    assert cfg.vocab_size == hf.vocab_size
    assert cfg.hidden_size == hf.hidden_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_layers == hf.num_hidden_layers
    assert cfg.num_heads == hf.num_attention_heads
    assert cfg.num_kv_heads == hf.num_key_value_heads
    assert cfg.head_dim == getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.bos_token_id == hf.bos_token_id
    assert cfg.pad_token_id == hf.pad_token_id
    hf_eos = hf.eos_token_id if isinstance(hf.eos_token_id, list) else [hf.eos_token_id]
    assert cfg.eos_token_ids[: len(hf_eos)] == tuple(hf_eos)
    rope = hf.rope_parameters
    if "full_attention" in rope:  # gemma3: per layer-type rope
        assert cfg.rope_theta == rope["full_attention"]["rope_theta"]
        assert cfg.rope_local_theta == rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    else:
        assert cfg.rope_theta == rope["rope_theta"]
    rt = rope.get("rope_type", "default")
    assert (cfg.rope_scaling.rope_type if cfg.rope_scaling else "default") == rt
    if rt != "default":
        assert cfg.rope_scaling.factor == rope["factor"]
    if cfg.arch.startswith("gemma"):
        assert cfg.hidden_act == "gelu_tanh" and hf.hidden_activation == "gelu_pytorch_tanh"
        assert cfg.sandwich_norms and cfg.embed_scale == math.sqrt(hf.hidden_size)
        assert cfg.sliding_window == hf.sliding_window
        assert cfg.layer_types == tuple(t.split("_")[0] for t in hf.layer_types)
        # transformers keeps its class default (256) here; llama.cpp scales by head_dim. They agree on
        # real Gemma files (head_dim 256), not on the tiny synthetic ones.
        assert cfg.query_pre_attn_scalar == (hf.query_pre_attn_scalar if cfg.head_dim == 256 else cfg.head_dim)
        assert cfg.attn_logit_softcap == hf.attn_logit_softcapping
        assert cfg.final_logit_softcap == hf.final_logit_softcapping
    else:
        assert cfg.hidden_act == hf.hidden_act == "silu"
        assert set(cfg.layer_types) == {"full"}
    assert cfg.attention_bias == bool(getattr(hf, "attention_bias", cfg.arch == "qwen2"))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real(request):
    path = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}[request.param]()
    with transformers_reuses_readers():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    yield request.param, readers(request.param), model.config, sd
    del model, sd


def test_real_config_and_weights(real):
    which, rd, hf_cfg, sd = real
    cfg = gguf_model_config(rd)
    assert cfg.arch == {"smollm2": "llama", "gemma3": "gemma3"}[which]
    _check_config(cfg, hf_cfg)
    if which == "gemma3":
        assert cfg.eos_token_ids == (1, 106)  # <eos> and <end_of_turn>
        assert cfg.qk_norm and cfg.layer_types[5] == "full" and cfg.layer_types[4] == "sliding"
    _compare_weights(rd, cfg, sd)


# ---- synthetic files for the other architectures ----------------------------------------------------

def _write_tiny(path, arch, *, bias=False, qk_norm=False, sandwich=False, untied=False, extra=None, split=0, hd=16,
                tensors=None, replace=None, skip=(), skip_meta=()):
    """replace: tensor name -> (raw bytes [rows, row bytes], ggml type) written instead; skip: tensor names
    left out; skip_meta: GGUFWriter add_* methods not called."""
    import gguf

    L, D, F, H, KV, V = 2, 64, 96, 4, 2, 128
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split)
    for fn, value in (("add_block_count", L), ("add_embedding_length", D), ("add_feed_forward_length", F),
                      ("add_head_count", H)):
        if fn not in skip_meta:
            getattr(w, fn)(value)
    w.add_context_length(2048)
    w.add_head_count_kv(KV)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    if "add_rope_freq_base" not in (extra or {}):
        w.add_rope_freq_base(50000.0)
    w.add_vocab_size(V)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    for fn, value in (extra or {}).items():
        getattr(w, fn)(value)
    rng = np.random.default_rng(0)

    def t(name, *shape):
        a = rng.standard_normal(shape).astype(np.float32)
        if name in (replace or {}):
            w.add_tensor(name, replace[name][0], raw_dtype=replace[name][1])
        elif name not in skip:
            w.add_tensor(name, a)

    for name, value in (tensors or {}).items():
        w.add_tensor(name, value)
    t("token_embd.weight", V, D)
    t("output_norm.weight", D)
    if untied:
        t("output.weight", V, D)
    for i in range(L):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", D)
        t(p + "attn_q.weight", H * hd, D)
        t(p + "attn_k.weight", KV * hd, D)
        t(p + "attn_v.weight", KV * hd, D)
        t(p + "attn_output.weight", D, H * hd)
        if bias:
            t(p + "attn_q.bias", H * hd), t(p + "attn_k.bias", KV * hd), t(p + "attn_v.bias", KV * hd)
        if qk_norm:
            t(p + "attn_q_norm.weight", hd), t(p + "attn_k_norm.weight", hd)
        if sandwich:
            t(p + "post_attention_norm.weight", D), t(p + "post_ffw_norm.weight", D)
        t(p + "ffn_norm.weight", D)
        t(p + "ffn_gate.weight", F, D)
        t(p + "ffn_up.weight", F, D)
        t(p + "ffn_down.weight", D, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_TINY = {
    "llama": dict(untied=True),
    "qwen2": dict(bias=True),
    "qwen3": dict(qk_norm=True, hd=128),  # transformers ignores key_length for qwen3 (its default is 128)
    "gemma2": dict(sandwich=True, extra={"add_sliding_window": 32, "add_attn_logit_softcapping": 50.0,
                                         "add_final_logit_softcapping": 30.0}),
}


@pytest.mark.parametrize("arch", sorted(_TINY))
def test_tiny_arch_matches_transformers(arch, tmp_path):
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_tiny(path, arch, **_TINY[arch])
    rd = open_gguf(path)
    cfg = gguf_model_config(rd)
    assert cfg.arch == arch
    hf_cfg = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    _check_config(cfg, hf_cfg)
    if arch == "gemma2":
        assert cfg.layer_types == ("sliding", "full") and cfg.attn_logit_softcap == 50.0
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    _compare_weights(rd, cfg, {k: v.detach().numpy() for k, v in model.state_dict().items()})


def test_split_checkpoint(tmp_path):
    _write_tiny(tmp_path / "m.gguf", "llama", split=5)
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(shards) > 2
    whole = tmp_path / "whole"
    whole.mkdir()
    _write_tiny(whole / "m.gguf", "llama")
    ref = {(n, layer): a for n, layer, a in iter_gguf_tensors(open_gguf(whole / "m.gguf"), gguf_model_config(open_gguf(whole / "m.gguf")))}
    rd = open_gguf(shards[1])  # any shard finds the rest, in order
    assert [r.data.filename for r in rd] == [str(p) for p in shards]
    cfg = gguf_model_config(rd)
    got = {(n, layer): a for n, layer, a in iter_checked(cfg, iter_gguf_tensors(rd, cfg))}
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k])
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1].name):
        shard_paths(shards[0])


def test_rope_scaling_metadata(tmp_path):
    import gguf

    path = tmp_path / "yarn.gguf"
    _write_tiny(path, "qwen3", qk_norm=True, extra={
        "add_rope_scaling_type": gguf.RopeScalingType.YARN, "add_rope_scaling_factor": 4.0,
        "add_rope_scaling_orig_ctx_len": 32768})
    rs = gguf_model_config(open_gguf(path)).rope_scaling
    assert (rs.rope_type, rs.factor, rs.original_max_position_embeddings) == ("yarn", 4.0, 32768)
    path = tmp_path / "linear.gguf"
    _write_tiny(path, "llama", extra={"add_rope_scaling_type": gguf.RopeScalingType.LINEAR,
                                      "add_rope_scaling_factor": 2.0})
    rs = gguf_model_config(open_gguf(path)).rope_scaling
    assert (rs.rope_type, rs.factor) == ("linear", 2.0)


def test_llama3_rope_freqs(tmp_path):
    """Llama 3.1-style files carry llama3 RoPE scaling only as a `rope_freqs` tensor."""
    hd, theta, factor, old = 16, 50000.0, 8.0, 8192
    inv = theta ** -(np.arange(0, hd, 2) / hd)
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
    freqs = np.where(wavelen < old / 4, 1.0, np.where(wavelen > old, factor, 1 / ((1 - smooth) / factor + smooth)))
    assert freqs.min() == 1.0 and freqs.max() == factor and ((freqs > 1) & (freqs < factor)).any()
    path = tmp_path / "llama31.gguf"
    _write_tiny(path, "llama", extra={"add_rope_freq_base": theta},
                tensors={"rope_freqs.weight": freqs.astype(np.float32)})
    rd = open_gguf(path)
    cfg = gguf_model_config(rd)
    rs = cfg.rope_scaling
    assert (rs.rope_type, rs.factor, rs.low_freq_factor, rs.high_freq_factor) == ("llama3", factor, 1.0, 4.0)
    assert rs.original_max_position_embeddings == old
    assert len(list(iter_checked(cfg, iter_gguf_tensors(rd, cfg)))) == 1 + 1 + 2 * 9  # rope_freqs is not a weight


def test_progress_bar_switch(monkeypatch):
    from jaxserve.loader import gguf_loader

    monkeypatch.setenv("JAXSERVE_NO_PROGRESS", "1")
    assert gguf_loader._progress_disabled()
    monkeypatch.delenv("JAXSERVE_NO_PROGRESS")
    monkeypatch.setattr(gguf_loader.sys.stderr, "isatty", lambda: True, raising=False)
    assert not gguf_loader._progress_disabled()


def test_fast_reader_builds_the_same_fields(tmp_path):
    """loader/gguf_reader.FastGGUFReader (long metadata arrays read with struct) against gguf's own
    GGUFReader on a file with long and short arrays of strings (empty and multi-byte ones), of every
    scalar type, scalars and a tensor: the same fields (parts, data, types, contents) and tensors."""
    import gguf

    from jaxserve.loader.gguf_reader import FastGGUFReader

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    toks = [f"tok{i}" for i in range(300)] + ["", "é ▁x", "<|im_end|>"]
    w.add_token_list(toks)
    w.add_token_scores([float(i) / 7 for i in range(len(toks))])
    w.add_token_types([i % 6 for i in range(len(toks))])
    w.add_array("test.short", ["a", "bc"])
    w.add_array("test.ints", list(range(-50, 150)))
    w.add_array("test.bools", [bool(i % 3) for i in range(100)])
    w.add_array("test.empty", [])
    w.add_uint32("test.u32", 7)
    w.add_string("test.s", "hello")
    w.add_tensor("t", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    base_cls = FastGGUFReader.__mro__[1]  # gguf's own (conftest points gguf.GGUFReader at the subclass)
    assert base_cls.__module__ == "gguf.gguf_reader" and base_cls.__name__ == "GGUFReader"
    fast, base = FastGGUFReader(str(path)), base_cls(str(path))
    assert list(fast.fields) == list(base.fields)
    for k, fb in base.fields.items():
        ff = fast.fields[k]
        assert (ff.offset, ff.name, ff.data, ff.types) == (fb.offset, fb.name, fb.data, fb.types), k
        assert len(ff.parts) == len(fb.parts), k
        for a, b in zip(ff.parts, fb.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), k
        assert ff.contents() == fb.contents(), k
    assert fast.fields["tokenizer.ggml.tokens"].contents() == toks
    assert fast.fields["tokenizer.ggml.tokens"].contents(301) == "é ▁x"
    (tf,), (tb,) = fast.tensors, base.tensors
    assert tf.name == tb.name and np.array_equal(tf.data, tb.data) and tf.data_offset == tb.data_offset


# ---- bad files: clear errors naming the file, tensor, type or key ------------------------------------

def test_truncated_or_corrupt_gguf_fails_naming_the_file_and_tensor(tmp_path):
    from jaxserve.loader.gguf_reader import GGUFError

    path = tmp_path / "m.gguf"
    _write_tiny(path, "llama")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])  # cut in the middle of the tensor data
    with pytest.raises(GGUFError, match=r"cut\.gguf: tensor 'blk\.\d\.\w+\.weight' \(F32 \[\d+, \d+\]\) lies at "
                                        r"bytes \d+\.\.\d+, past the end of the file .* truncated"):
        open_gguf(cut)
    for name, raw, match in (("empty.gguf", b"", "is empty"),
                             ("text.gguf", b"not a gguf file " * 8, "GGUF magic invalid"),
                             ("header.gguf", data[:200], r"header is truncated or corrupt")):
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(GGUFError, match=rf"{name}.*{match}|{match}.*{name}"):
            open_gguf(tmp_path / name)


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "TQ1_0", "IQ4_NL"])
def test_unsupported_tensor_type_fails_before_any_tensor_is_read(tmp_path, qtype):
    """A type the loader cannot decode is named with its tensor at the start of the load (not after every
    tensor before it has been read), packed or not."""
    import gguf

    T = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[T]
    raw = np.zeros((64, 512 // block * size), np.uint8)  # blk.1.attn_output [64, 512]: whole blocks per row
    path = tmp_path / "m.gguf"
    _write_tiny(path, "llama", hd=128, replace={"blk.1.attn_output.weight": (raw, T)})
    rd = open_gguf(path)
    cfg = gguf_model_config(rd)
    for packed in (False, True):
        with pytest.raises(ValueError, match=rf"blk\.1\.attn_output\.weight \({qtype}\): ggml type not supported"):
            next(iter_gguf_tensors(rd, cfg, packed=packed))


def test_missing_tensor_is_named_before_any_tensor_is_read(tmp_path):
    path = tmp_path / "m.gguf"
    _write_tiny(path, "llama", untied=True, skip={"blk.1.attn_k.weight", "output_norm.weight"})
    rd = open_gguf(path)
    with pytest.raises(ValueError, match=r"missing tensor\(s\) output_norm\.weight, blk\.1\.attn_k\.weight"):
        next(iter_gguf_tensors(rd, gguf_model_config(rd)))


@pytest.mark.parametrize("fn,key", [("add_embedding_length", "llama.embedding_length"),
                                    ("add_block_count", "llama.block_count"),
                                    ("add_head_count", "llama.attention.head_count"),
                                    ("add_feed_forward_length", "llama.feed_forward_length")])
def test_missing_metadata_key_is_named(tmp_path, fn, key):
    from jaxserve.config import ConfigError

    path = tmp_path / "m.gguf"
    _write_tiny(path, "llama", skip_meta=(fn,))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        gguf_model_config(open_gguf(path))
