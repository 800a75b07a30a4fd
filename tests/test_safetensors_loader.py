"""HF config mapping, safetensors -> canonical tensors, and materialize onto the device."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hf_tiny import FAMILIES, make_tiny_model
from jaxserve.config import ConfigError, RopeScaling
from jaxserve.loader.hf_config import model_config_from_dir, model_config_from_hf
from jaxserve.loader.safetensors_loader import SafetensorsError, iter_safetensors_tensors, read_header

os.environ.setdefault("JAXSERVE_NO_PROGRESS", "1")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def _state_dict(model_dir: Path) -> dict[str, np.ndarray]:
    """The checkpoint as float32 numpy, read by the reference implementation (safetensors + torch)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    return out


def _expected(sd: dict[str, np.ndarray], cfg, gemma: bool) -> dict[tuple[str, int | None], np.ndarray]:
    """Canonical tensors written out by hand from the HF state dict (independent of the loader's tables)."""
    norm = (lambda w: w + 1.0) if gemma else (lambda w: w)
    exp = {("embed", None): sd["model.embed_tokens.weight"], ("final_norm", None): norm(sd["model.norm.weight"])}
    if not cfg.tie_word_embeddings:
        exp[("lm_head", None)] = sd["lm_head.weight"].T
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for hf, canon in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o")):
            exp[(f"layers.{canon}", i)] = sd[p + f"self_attn.{hf}.weight"].T
        for hf in ("gate", "up", "down"):
            exp[(f"layers.{hf}", i)] = sd[p + f"mlp.{hf}_proj.weight"].T
        exp[("layers.attn_norm", i)] = norm(sd[p + "input_layernorm.weight"])
        if gemma:
            exp[("layers.post_attn_norm", i)] = norm(sd[p + "post_attention_layernorm.weight"])
            exp[("layers.ffn_norm", i)] = norm(sd[p + "pre_feedforward_layernorm.weight"])
            exp[("layers.post_ffn_norm", i)] = norm(sd[p + "post_feedforward_layernorm.weight"])
        else:
            exp[("layers.ffn_norm", i)] = sd[p + "post_attention_layernorm.weight"]
        if cfg.attention_bias:
            for c in "qkv":
                exp[(f"layers.{c}_bias", i)] = sd[p + f"self_attn.{c}_proj.bias"]
        if cfg.qk_norm:
            exp[("layers.q_norm", i)] = norm(sd[p + "self_attn.q_norm.weight"])
            exp[("layers.k_norm", i)] = norm(sd[p + "self_attn.k_norm.weight"])
    return exp


def _collect(model_dir, cfg):
    got = {}
    for name, layer, arr in iter_safetensors_tensors(model_dir, cfg):
        assert (name, layer) not in got
        got[(name, layer)] = np.array(arr, dtype=np.float32)
    return got


@pytest.mark.parametrize("family", FAMILIES)
def test_canonical_tensors_match_hf_state_dict(family, tiny_dir):
    d = make_tiny_model(family, tiny_dir)
    cfg = model_config_from_dir(d)
    exp = _expected(_state_dict(d), cfg, family.startswith("gemma"))
    got = _collect(d, cfg)
    assert sorted(got, key=str) == sorted(exp, key=str)
    for k, v in exp.items():
        np.testing.assert_array_equal(got[k], v, err_msg=str(k))

    from jaxserve.loader.materialize import materialize
    from jaxserve.models.weights import flat_from_tree, weight_specs

    flat = flat_from_tree(materialize(cfg, iter_safetensors_tensors(d, cfg), "float32"))
    specs = weight_specs(cfg)
    assert set(flat) == set(specs)
    for (name, layer), v in exp.items():
        dev = np.asarray(flat[name] if layer is None else flat[name][layer])
        np.testing.assert_array_equal(dev, v, err_msg=f"{name}[{layer}]")


def test_sharded_index(tiny_dir):
    one = make_tiny_model("qwen3", tiny_dir)
    sharded = make_tiny_model("qwen3", tiny_dir, shards=2)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    cfg = model_config_from_dir(sharded)
    a, b = _collect(one, cfg), _collect(sharded, cfg)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_files(dtype, tiny_dir):
    import jax.numpy as jnp

    from jaxserve.loader.materialize import materialize
    from jaxserve.models.weights import flat_from_tree

    d = make_tiny_model("gemma3", tiny_dir, dtype=dtype)
    cfg = model_config_from_dir(d)
    assert read_header(d / "model.safetensors")[1]["model.embed_tokens.weight"]["dtype"] == {
        "bfloat16": "BF16", "float16": "F16"}[dtype]
    exp = _expected(_state_dict(d), cfg, gemma=True)
    dtypes = {}
    for name, layer, arr in iter_safetensors_tensors(d, cfg):
        dtypes[name] = str(arr.dtype)
        np.testing.assert_array_equal(np.asarray(arr, np.float32), exp[(name, layer)], err_msg=name)
    assert dtypes["layers.q"] == dtype and dtypes["embed"] == dtype
    assert dtypes["layers.attn_norm"] == "float32"  # 1 + w computed in float32
    tree = flat_from_tree(materialize(cfg, iter_safetensors_tensors(d, cfg), jnp.bfloat16))
    assert tree["layers.q"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(tree["layers.q"][1], np.float32),
                                  exp[("layers.q", 1)].astype(jnp.bfloat16).astype(np.float32))


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a float32 checkpoint with its state dict edited by `edit(dict)`."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    edit(sd)
    save_file(sd, dst / "model.safetensors")
    return dst


def test_missing_and_unexpected_tensors(tiny_dir):
    from jaxserve.loader.materialize import materialize

    src = make_tiny_model("llama", tiny_dir)
    cfg = model_config_from_dir(src)
    d = _rewrite(src, tiny_dir / "missing", lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): layers\.k\[1\]"):
        materialize(cfg, iter_safetensors_tensors(d, cfg), "float32")

    d = _rewrite(src, tiny_dir / "extra",
                 lambda sd: sd.update({"model.layers.0.mlp.extra.weight": np.ones(3, np.float32)}))
    with pytest.raises(SafetensorsError, match="model.layers.0.mlp.extra.weight"):
        list(iter_safetensors_tensors(d, cfg))

    def transpose_k(sd):
        k = "model.layers.0.self_attn.k_proj.weight"
        sd[k] = np.ascontiguousarray(sd[k].T)

    d = _rewrite(src, tiny_dir / "bad_shape", transpose_k)
    with pytest.raises(SafetensorsError, match=r"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape "
                                               r"\[64, 32\], but config\.json implies \[32, 64\]"):
        materialize(cfg, iter_safetensors_tensors(d, cfg), "float32")

    # A truncated download is caught from the header, before any tensor is read.
    d = tiny_dir / "truncated"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    data = (src / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(SafetensorsError, match="outside the file"):
        list(iter_safetensors_tensors(d, cfg))


def test_tied_checkpoint_with_lm_head_present(tiny_dir):
    src = make_tiny_model("qwen2", tiny_dir)
    cfg = model_config_from_dir(src)
    assert cfg.tie_word_embeddings
    d = _rewrite(src, tiny_dir / "tied_lm_head",
                 lambda sd: sd.update({"lm_head.weight": sd["model.embed_tokens.weight"].copy()}))
    assert "lm_head" not in {n for n, _, _ in iter_safetensors_tensors(d, cfg)}


def test_gemma3_multimodal_prefixes(tiny_dir):
    src = make_tiny_model("gemma3", tiny_dir)
    text = json.loads((src / "config.json").read_text())
    mm = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
          "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": [1, 106]}
    text.pop("eos_token_id")
    exp = _collect(src, model_config_from_dir(src))
    for i, (prefix, lm_head) in enumerate([("model.language_model.", "lm_head.weight"),
                                           ("language_model.model.", "language_model.lm_head.weight")]):

        def edit(sd):
            for k in list(sd):
                sd[prefix + k[len("model."):]] = sd.pop(k)
            sd[lm_head] = sd[prefix + "embed_tokens.weight"].copy()
            sd["vision_tower.vision_model.post_layernorm.weight"] = np.ones(4, np.float32)
            sd["model.multi_modal_projector.mm_soft_emb_norm.weight"] = np.ones(4, np.float32)

        d = _rewrite(src, tiny_dir / f"mm{i}", edit)
        (d / "config.json").write_text(json.dumps(mm))
        cfg = model_config_from_dir(d)
        assert cfg.arch == "gemma3" and cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings
        got = _collect(d, cfg)
        assert got.keys() == exp.keys()
        for k in exp:
            np.testing.assert_array_equal(got[k], exp[k])


# ------------------------------------------------------------------------------------------- config


def test_config_of_each_tiny_family(tiny_dir):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                max_position_embeddings=256, bos_token_id=1, pad_token_id=0)
    gemma = dict(hidden_act="gelu_tanh", sandwich_norms=True, embed_scale=8.0, query_pre_attn_scalar=32.0,
                 tie_word_embeddings=True, rms_norm_eps=1e-6, sliding_window=8)
    expect = {
        "llama": dict(arch="llama", num_layers=2, rope_theta=10000.0, rms_norm_eps=1e-5, eos_token_ids=(2,)),
        "llama3_rope": dict(arch="llama", rope_theta=500000.0, rope_scaling=RopeScaling(
            "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)),
        "yarn": dict(rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64)),
        "linear_rope": dict(rope_scaling=RopeScaling("linear", factor=2.0, original_max_position_embeddings=256)),
        "mistral": dict(arch="mistral", sliding_window=8, layer_types=("sliding",) * 2),
        "qwen2": dict(arch="qwen2", attention_bias=True, tie_word_embeddings=True, eos_token_ids=(2, 3),
                      rope_theta=1e6, sliding_window=None, layer_types=("full",) * 2, qk_norm=False),
        "qwen3": dict(arch="qwen3", qk_norm=True, attention_bias=False, rope_theta=1e6),
        "gemma2": dict(arch="gemma2", num_layers=4, layer_types=("sliding", "full") * 2, attn_logit_softcap=50.0,
                       final_logit_softcap=30.0, qk_norm=False, rope_theta=10000.0, rope_local_theta=None, **gemma),
        "gemma3": dict(arch="gemma3", num_layers=6, layer_types=("sliding",) * 5 + ("full",), qk_norm=True,
                       rope_theta=1e6, rope_local_theta=1e4, attn_logit_softcap=None, final_logit_softcap=None,
                       rope_scaling=RopeScaling("linear", factor=2.0, original_max_position_embeddings=256), **gemma),
    }
    for family in FAMILIES:
        cfg = model_config_from_dir(make_tiny_model(family, tiny_dir)).to_dict()
        want = {**base, **expect[family]}
        if isinstance(want.get("rope_scaling"), RopeScaling):
            want["rope_scaling"] = want["rope_scaling"].__dict__
        assert {k: cfg[k] for k in want} == want, family


def test_config_hub_style_dicts():
    # Llama 3.1 (legacy rope_theta/rope_scaling fields, eos list).
    llama31 = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                   max_position_embeddings=131072, rope_theta=500000.0, bos_token_id=128000,
                   eos_token_id=[128001, 128008, 128009], tie_word_embeddings=False,
                   rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    c = model_config_from_hf(llama31)
    assert c.head_dim == 128 and c.rope_theta == 500000.0 and c.eos_token_ids == (128001, 128008, 128009)
    assert c.rope_scaling == RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192)

    # Gemma 3 4B multimodal: text_config omits fields equal to transformers' defaults.
    g3 = dict(model_type="gemma3", eos_token_id=[1, 106], text_config=dict(
        model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024))
    c = model_config_from_hf(g3)
    assert (c.arch, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == ("gemma3", 8, 4, 256, 262208)
    assert c.rope_theta == 1e6 and c.rope_local_theta == 1e4 and c.rope_scaling.factor == 8.0
    assert c.layer_types[:6] == ("sliding",) * 5 + ("full",) and c.layer_types.count("full") == 5
    assert c.embed_scale == math.sqrt(2560) and c.query_pre_attn_scalar == 256 and c.eos_token_ids == (1, 106)
    assert c.tie_word_embeddings and c.qk_norm and c.sandwich_norms and c.final_logit_softcap is None

    # Gemma 3 1B (legacy fields: rope_local_base_freq, sliding_window_pattern).
    g31b = dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512, sliding_window_pattern=6,
                rope_scaling=None, query_pre_attn_scalar=256, final_logit_softcapping=None,
                hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768)
    c = model_config_from_hf(g31b)
    assert c.rope_scaling is None and c.rope_local_theta == 10000.0 and c.sliding_window == 512
    assert c.layer_types[5] == "full" and c.layer_types[11] == "full" and c.layer_types[4] == "sliding"

    # Gemma 2: alternating, sliding first; softcaps default on.
    c = model_config_from_hf(dict(model_type="gemma2", hidden_size=2304, num_hidden_layers=4))
    assert c.layer_types == ("sliding", "full", "sliding", "full") and c.attn_logit_softcap == 50.0
    assert c.final_logit_softcap == 30.0 and c.sliding_window == 4096

    # Qwen2: the window only with use_sliding_window, from max_window_layers on.
    q = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
             num_attention_heads=14, num_key_value_heads=2, sliding_window=32768, max_window_layers=2,
             tie_word_embeddings=True, eos_token_id=151645, rope_theta=1e6)
    c = model_config_from_hf(q)
    assert c.sliding_window is None and c.layer_types == ("full",) * 4 and c.head_dim == 64 and c.attention_bias
    c = model_config_from_hf({**q, "use_sliding_window": True})
    assert c.layer_types == ("full", "full", "sliding", "sliding") and c.sliding_window == 32768

    # Mistral: v0.1 slides on every layer; v0.2+ has sliding_window null.
    m = dict(model_type="mistral", hidden_size=4096, num_hidden_layers=2, sliding_window=4096)
    assert model_config_from_hf(m).layer_types == ("sliding", "sliding")
    assert model_config_from_hf({**m, "sliding_window": None}).sliding_window is None

    # transformers 5 rope_parameters with yarn.
    y = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
             rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                              "original_max_position_embeddings": 32768})
    c = model_config_from_hf(y)
    assert c.rope_theta == 1e6 and c.rope_scaling == RopeScaling("yarn", factor=4.0,
                                                                 original_max_position_embeddings=32768)


def test_yarn_override_and_errors():
    q = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rope_theta=1e6)
    c = model_config_from_hf(q, yarn_scaling_factor=4.0)
    assert c.rope_scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=32768)
    assert c.max_position_embeddings == 131072
    with pytest.raises(ConfigError, match="unsupported model_type 'phi3'.*llama.*gemma3_text"):
        model_config_from_hf({"model_type": "phi3"})
    with pytest.raises(ConfigError, match="dynamic"):
        model_config_from_hf({**q, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match="partial"):
        model_config_from_hf({**q, "partial_rotary_factor": 0.5})


# --------------------------------------------------------------------------------------- materialize


def test_random_weights():
    import jax

    from jaxserve.loader.materialize import random_weights
    from jaxserve.models.weights import flat_from_tree, weight_specs

    cfg = model_config_from_hf(dict(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    flat = flat_from_tree(random_weights(cfg, "bfloat16", jax.random.key(0), scale=0.05))
    specs = weight_specs(cfg)
    assert set(flat) == set(specs) and "layers.q_bias" in flat
    for name, arr in flat.items():
        assert arr.shape == specs[name].shape and str(arr.dtype) == "bfloat16"
        a = np.asarray(arr, np.float32)
        if name.endswith("norm"):
            assert (a == 1).all()
        else:
            assert 0.04 < a.std() < 0.06, name
    again = flat_from_tree(random_weights(cfg, "bfloat16", jax.random.key(0), scale=0.05))
    np.testing.assert_array_equal(np.asarray(again["layers.up"], np.float32), np.asarray(flat["layers.up"], np.float32))


def test_materialize_sharded_on_two_devices(tiny_dir):
    """Shardings are honoured (in a fresh interpreter: the device count must be set before JAX starts)."""
    d = make_tiny_model("qwen2", tiny_dir)
    script = textwrap.dedent(f"""
        import numpy as np, jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from jaxserve.loader.hf_config import model_config_from_dir
        from jaxserve.loader.safetensors_loader import iter_safetensors_tensors
        from jaxserve.loader.materialize import materialize
        from jaxserve.models.weights import flat_from_tree
        d = {str(d)!r}
        cfg = model_config_from_dir(d)
        mesh = Mesh(np.array(jax.devices()), ("tp",))
        sh = {{"layers.q": NamedSharding(mesh, P(None, None, "tp")), "layers.o": NamedSharding(mesh, P(None, "tp")),
              "embed": NamedSharding(mesh, P("tp"))}}
        sharded = flat_from_tree(materialize(cfg, iter_safetensors_tensors(d, cfg), "float32", sh))
        plain = flat_from_tree(materialize(cfg, iter_safetensors_tensors(d, cfg), "float32"))
        for name, s in sh.items():
            assert sharded[name].sharding.is_equivalent_to(s, sharded[name].ndim), name
            shard = sharded[name].addressable_shards[1]
            assert shard.data.shape != sharded[name].shape, name
            np.testing.assert_array_equal(np.asarray(sharded[name]), np.asarray(plain[name]))
        from jaxserve.loader.materialize import random_weights
        rnd = flat_from_tree(random_weights(cfg, "float32", jax.random.key(1), shardings=sh))
        assert all(rnd[n].sharding.is_equivalent_to(s, rnd[n].ndim) for n, s in sh.items())
        print("OK")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def _header_file(path: Path, header, body: bytes = b"") -> Path:
    import struct

    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return path


def test_malformed_safetensors_headers_are_named(tmp_path):
    """A header gguf-style tools or a bad download can leave: not JSON, not an object, an entry without
    offsets, negative dims, offsets that are not numbers: a SafetensorsError naming the file and tensor."""
    from jaxserve.loader.safetensors_loader import read_header

    ok = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    body = bytes(16)
    cases = [
        (b"{not json", r"bad\.safetensors: the header is not valid JSON"),
        ([1, 2], r"bad\.safetensors: the header is not a JSON object"),
        ({"w": {"dtype": "F32", "shape": [2, 2]}}, r"tensor 'w' has a malformed header entry"),
        ({"w": dict(ok, shape=[-2, -2])}, r"tensor 'w' has a malformed header entry"),
        ({"w": dict(ok, data_offsets="0-16")}, r"tensor 'w' has a malformed header entry"),
        ({"w": dict(ok, data_offsets=[16, 0])}, r"tensor 'w' has a malformed header entry"),
        ({"w": dict(ok, data_offsets=[0, 1 << 40])}, r"tensor 'w' lies outside the file"),
    ]
    for header, match in cases:
        with pytest.raises(SafetensorsError, match=match):
            read_header(_header_file(tmp_path / "bad.safetensors", header, body))
    assert read_header(_header_file(tmp_path / "good.safetensors", {"w": ok}, body))[1] == {"w": ok}


def test_bad_shard_index_is_named(tiny_dir):
    import shutil

    from jaxserve.loader.safetensors_loader import checkpoint_files

    src = make_tiny_model("llama", tiny_dir, shards=2)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for name, text, match in [
        ("idx_json", "{bad", r"model\.safetensors\.index\.json is not a JSON object"),
        ("idx_list", json.dumps({"weight_map": ["a", "b"]}), r"weight_map must map tensor names to file names"),
        ("idx_out", json.dumps({"weight_map": dict(index["weight_map"], x="../other/model.safetensors")}),
         r"names shard\(s\) outside .*: \.\./other/model\.safetensors"),
        ("idx_missing", json.dumps({"weight_map": dict(index["weight_map"], x="model-00009-of-00009.safetensors")}),
         r"missing: model-00009-of-00009\.safetensors"),
    ]:
        d = tiny_dir / name
        shutil.copytree(src, d)
        (d / "model.safetensors.index.json").write_text(text)
        with pytest.raises(SafetensorsError, match=match):
            checkpoint_files(d)


def test_bad_config_json_is_a_config_error(tiny_dir):
    from jaxserve.config import ConfigError

    src = make_tiny_model("llama", tiny_dir)
    good = json.loads((src / "config.json").read_text())
    for name, text, match in [
        ("cfg_json", "{oops", r"config\.json is not valid JSON"),
        ("cfg_list", "[1]", r"config\.json must hold a JSON object, not list"),
        ("cfg_null", json.dumps(dict(good, num_attention_heads=None)), r"num_attention_heads = None is not an integer"),
        ("cfg_str", json.dumps(dict(good, hidden_size="sixty-four")), r"hidden_size = 'sixty-four' is not an integer"),
        ("cfg_zero", json.dumps(dict(good, num_attention_heads=0)), r"num_attention_heads = 0 must be positive"),
    ]:
        d = tiny_dir / name
        d.mkdir()
        (d / "config.json").write_text(text)
        with pytest.raises(ConfigError, match=match):
            model_config_from_dir(d)
