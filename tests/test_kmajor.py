"""models/kmajor: the small dense matmul weights held [N, K]. The weight type against x @ W, which weights
the conversion takes, and the whole engine with it (dense, tied/untied LM head, MoE router and shared
expert, with the dense GEMV on): the same tokens and logprobs as the [K, N] layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import kmajor
from jaxserve.models.kmajor import KMajor


@pytest.fixture
def highest_precision():
    with jax.default_matmul_precision("highest"):  # on a GPU an f32 dot would otherwise be TF32
        yield


def test_matmul_is_x_at_w(highest_precision):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((48, 80)), jnp.float32)
    kw = KMajor(jnp.asarray(np.asarray(w).T))
    assert kw.shape == (48, 80) and kw.ndim == 2 and kw.dtype == jnp.float32
    for xshape in [(1, 48), (5, 48), (2, 3, 48)]:
        x = jnp.asarray(rng.standard_normal(xshape), jnp.float32)
        got = jax.jit(kmajor.matmul)(x, kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(kw.dense()), np.asarray(w))
    # a pytree node: through jit and tree maps, cast, indexed by layer when stacked
    leaves, tree = jax.tree.flatten(kw)
    assert len(leaves) == 1 and isinstance(jax.tree.unflatten(tree, leaves), KMajor)
    assert kw.astype(jnp.bfloat16).dtype == jnp.bfloat16
    stacked = KMajor(jnp.stack([kw.wt, 2 * kw.wt]))
    assert stacked.shape == (2, 48, 80) and stacked[1].shape == (48, 80)
    np.testing.assert_array_equal(np.asarray(stacked[1].wt), 2 * np.asarray(kw.wt))
    with pytest.raises(ValueError, match="one layer"):
        kmajor.matmul(x, stacked)


def test_one_row_above_the_threshold_is_a_row_reduction(monkeypatch, highest_precision):
    """Weights above XLA's threshold: one row goes through the explicit f32 multiply + reduction, more
    rows through the dot; both are x @ W (bf16 weights: to bf16 rounding)."""
    monkeypatch.setattr(kmajor, "XLA_SMALL_DOT", 1)  # every weight counts as large
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16)
    kw = KMajor(jnp.asarray(w.T))
    for xshape in [(1, 64), (1, 1, 64), (3, 64)]:
        x = jnp.asarray(rng.standard_normal(xshape), jnp.bfloat16)
        want = x.astype(jnp.float32) @ w.astype(jnp.float32)
        got = jax.jit(kmajor.matmul)(x, kw)
        assert got.dtype == jnp.bfloat16 and got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)
    jaxpr = str(jax.make_jaxpr(kmajor.matmul)(jnp.ones((1, 64), jnp.bfloat16), kw))
    assert "reduce_sum" in jaxpr and "dot_general" not in jaxpr
    assert "dot_general" in str(jax.make_jaxpr(kmajor.matmul)(jnp.ones((2, 64), jnp.bfloat16), kw))


def test_small_is_xlas_strength_reduction_rule():
    """The shapes measured in bench/RESULTS.md sessions 27-28: reduced (2,048 x 2,048, the MoE model's
    4,096 x 2,048 o projection and 2,048 x 128 router), GEMMs (4,096 x 4,096, 8,192 x 2,048)."""
    assert kmajor.is_small(2048, 2048) and kmajor.is_small(4096, 2048) and kmajor.is_small(2048, 128)
    assert not kmajor.is_small(4096, 4096) and not kmajor.is_small(8192, 2048)
    assert not kmajor.is_small(4096, 6144) and not kmajor.is_small(576, 49152)  # a q/k/v; a vocabulary


@pytest.mark.parametrize("stacked", [False, True])
def test_to_kmajor_takes_the_small_dense_matmul_weights(monkeypatch, stacked):
    from jaxserve.quant.qweight import QWeight

    monkeypatch.setattr(kmajor, "XLA_SMALL_DOT", 64 * 16 + 16 * 40 + 1)  # K=16: N <= 40 is small
    rng = np.random.default_rng(1)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    layer = {"qkv": arr(16, 40), "o": arr(16, 16), "gate_up": arr(16, 64), "attn_norm": arr(16),
             "router": arr(16, 4), "experts_gate": arr(4, 16, 8), "q_norm": arr(16, 16)}
    if stacked:
        layers = {k: jnp.stack([v, v + 1]) for k, v in layer.items()}
    else:
        layers = [dict(layer), {k: v + 1 for k, v in layer.items()}]
    qw = object.__new__(QWeight)
    weights = {"embed": arr(50, 16), "lm_head": arr(16, 8), "layers": layers, "packed": qw}
    out = kmajor.to_kmajor(weights, free=False)
    one = out["layers"] if stacked else out["layers"][1]
    for name in ("qkv", "o", "router"):  # small, named
        assert isinstance(one[name], KMajor), name
        want = (layers[name] if stacked else layers[1][name])
        np.testing.assert_array_equal(np.asarray(one[name].dense()), np.asarray(want))
    assert not isinstance(one["gate_up"], KMajor)  # 16 x 64: over the limit
    assert not isinstance(one["q_norm"], KMajor)  # not a matmul weight (not in NAMES)
    assert out["lm_head"] is weights["lm_head"] and out["packed"] is qw and out["embed"] is weights["embed"]
    assert one["experts_gate"].ndim == 4 if stacked else one["experts_gate"].ndim == 3


def test_fusing_kmajor_parts_keeps_them_kmajor():
    """A model an earlier engine left [N, K] and unfused (fuse_projections off) fuses in the next one:
    q/k/v and gate/up concatenate along N; a mix of layouts is left unfused."""
    from jaxserve.models import transformer as tf

    rng = np.random.default_rng(2)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    layer = {"q": arr(16, 16), "k": arr(16, 8), "v": arr(16, 8), "gate": arr(16, 32), "up": arr(16, 32)}
    dense = tf.fuse_projections({"layers": [dict(layer)]}, free=False)["layers"][0]
    km = kmajor.to_kmajor({"layers": [dict(layer)]})["layers"][0]
    fused = tf.fuse_projections({"layers": [km]}, free=False)["layers"][0]
    for name in ("qkv", "gate_up"):
        assert isinstance(fused[name], KMajor)
        np.testing.assert_array_equal(np.asarray(fused[name].dense()), np.asarray(dense[name]))
    mixed = tf.fuse_projections({"layers": [dict(km, q=layer["q"])]}, free=False)["layers"][0]
    assert "qkv" not in mixed and isinstance(mixed["k"], KMajor) and "gate_up" in mixed


def test_to_kmajor_frees_what_it_converts():
    w = jnp.ones((8, 8), jnp.float32)
    big = jnp.ones((8, 8), jnp.float32)
    out = kmajor.to_kmajor({"layers": [{"o": w, "attn_norm": big}]}, free=True)
    assert w.is_deleted() and not big.is_deleted()
    assert isinstance(out["layers"][0]["o"], KMajor)


def test_set_layout_keeps_what_is_already_right(monkeypatch):
    """set_layout with free=True relays only what its mode changes: a weight already in the wanted layout
    (KMajor or [K, N]) is the same object afterwards and is not deleted; switching modes moves exactly
    the weights the rule names, with the same values."""
    monkeypatch.setattr(kmajor, "XLA_SMALL_DOT", 64 * 16 + 16 * 40 + 1)  # K=16: N <= 40 is small
    rng = np.random.default_rng(3)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    small, large = arr(2, 16, 8), arr(2, 16, 64)  # stacked [L, K, N]
    ref = {"o": np.asarray(small), "down": np.asarray(large)}
    w = {"layers": {"o": small, "down": large}}
    dense = lambda v: np.asarray(v.dense() if isinstance(v, KMajor) else v)  # noqa: E731
    for mode, kinds in ((True, (True, False)), (True, (True, False)), ("all", (True, True)),
                        ("all", (True, True)), (True, (True, False)), (False, (False, False))):
        before = dict(w["layers"])
        w = kmajor.set_layout(w, mode, free=True)
        for name, want_km in zip(("o", "down"), kinds):
            now = w["layers"][name]
            assert isinstance(now, KMajor) == want_km, (mode, name)
            np.testing.assert_array_equal(dense(now), ref[name])
            if isinstance(before[name], KMajor) == want_km:  # unchanged: the very same, live array
                assert now is before[name]
                assert not (now.wt if want_km else now).is_deleted()
            else:  # relaid: the source is freed
                assert (before[name].wt if isinstance(before[name], KMajor) else before[name]).is_deleted()


@pytest.mark.parametrize("family,extra", [("llama", {}), ("llama", {"tie_word_embeddings": False}),
                                          ("qwen2_moe", {})])
def test_engine_with_kmajor_weights_generates_the_same(tmp_path, family, extra):
    """EngineConfig.kmajor_weights through the whole engine (prefill chunks, the decode loop, the sampler):
    the same greedy tokens and logprobs as the weights held [K, N]. qwen2_moe: its router and shared
    expert go [N, K] too (its experts are 3-D: never)."""
    from hf_tiny import greedy_outputs, make_tiny_model
    from jaxserve import LLM, SamplingParams
    from tiny_tokenizer import add_byte_tokenizer

    d = add_byte_tokenizer(make_tiny_model(family, tmp_path, **extra))
    prompts = [[5 + i for i in range(12)], [200, 100, 50]]
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    res = []
    for on in (False, True):
        llm = LLM(str(d), max_model_len=32, max_num_seqs=2, prefill_chunk_size=16, block_size=4,
                  num_blocks=24, scan_layers=on, dtype="float32", kmajor_weights=on,
                  compile_cache_dir=str(tmp_path / f"cache{on}"))
        layers = llm.engine.runner.weights["layers"]
        layer0 = layers[0] if isinstance(layers, list) else layers
        names = {n for n, v in layer0.items() if isinstance(v, KMajor)}
        if on:
            assert {"qkv", "o"} <= names and ("router" in names) == (family == "qwen2_moe")
            assert ("shared_down" in names) == (family == "qwen2_moe")
        else:
            assert not names
        res.append(greedy_outputs(llm, prompts, p))
    assert res[0][0] == res[1][0]
    np.testing.assert_allclose(res[0][1], res[1][1], atol=1e-4)


def test_engine_with_every_weight_kmajor(tmp_path, monkeypatch):
    """kmajor_weights='all': every dense layer weight [N, K] (not only the small ones), one-sequence
    decode steps through the row reduction (the tiny model's weights counted as large): the same tokens
    and logprobs."""
    monkeypatch.setattr(kmajor, "XLA_SMALL_DOT", 1)
    from hf_tiny import greedy_outputs, make_tiny_model
    from jaxserve import LLM, SamplingParams
    from tiny_tokenizer import add_byte_tokenizer

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    res = []
    for mode in (False, "all"):
        llm = LLM(str(d), max_model_len=32, max_num_seqs=1, prefill_chunk_size=16, block_size=4,
                  num_blocks=24, scan_layers=False, dtype="float32", kmajor_weights=mode,
                  compile_cache_dir=str(tmp_path / f"cache{mode}"))
        layer0 = llm.engine.runner.weights["layers"][0]
        assert all(isinstance(layer0[n], KMajor) for n in ("qkv", "o", "gate_up", "down")) == (mode == "all")
        res.append(greedy_outputs(llm, [[5 + i for i in range(12)]], p))
    assert res[0][0] == res[1][0]
    np.testing.assert_allclose(res[0][1], res[1][1], atol=1e-4)


def test_auto_mode():
    """kmajor_weights=None: off but on one GPU; every weight [N, K] only when every decode matmul has one
    row (one sequence at a time, no drafts to verify)."""
    assert kmajor.auto_mode("cpu", True, 1, 0) is False
    assert kmajor.auto_mode("gpu", False, 1, 0) is False  # a mesh
    assert kmajor.auto_mode("gpu", True, 1, 0) == "all"
    assert kmajor.auto_mode("gpu", True, 2, 0) is True
    assert kmajor.auto_mode("gpu", True, 1, 3) is True


@pytest.mark.parametrize("seqs,spec,every", [(1, 0, True), (2, 0, False), (1, 2, False)])
def test_engine_default_layout_follows_the_batch(tmp_path, monkeypatch, seqs, spec, every):
    """The runner's default (kmajor_weights=None) as it is on a GPU: the large weights go [N, K] only for
    a one-sequence engine without speculation (the tiny model's weights counted as large)."""
    from hf_tiny import make_tiny_model
    from jaxserve import LLM
    from tiny_tokenizer import add_byte_tokenizer

    monkeypatch.setattr(kmajor, "XLA_SMALL_DOT", 1)
    real = kmajor.auto_mode
    monkeypatch.setattr(kmajor, "auto_mode", lambda platform, *a: real("gpu", *a))
    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    llm = LLM(str(d), max_model_len=32, max_num_seqs=seqs, prefill_chunk_size=16, block_size=4, num_blocks=24,
              scan_layers=False, dtype="float32", num_speculative_tokens=spec,
              compile_cache_dir=str(tmp_path / "cache"))
    layer0 = llm.engine.runner.weights["layers"][0]
    assert {n for n in ("qkv", "o", "gate_up", "down") if isinstance(layer0[n], KMajor)} == (
        {"qkv", "o", "gate_up", "down"} if every else set())


def test_layout_follows_the_engine_not_the_model(tmp_path, monkeypatch):
    """Engines built one after another on one LoadedModel: each holds the layout its own config asks for
    (an engine with kmajor_weights off after one with 'all' gets [K, N] back), same outputs."""
    monkeypatch.setattr(kmajor, "XLA_SMALL_DOT", 1)
    from hf_tiny import greedy_outputs, make_tiny_model
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from tiny_tokenizer import add_byte_tokenizer

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    lm, res = str(d), []
    for mode in ("all", False, "all", True):
        ecfg = EngineConfig(max_model_len=32, max_num_seqs=1, prefill_chunk_size=16, block_size=4, num_blocks=24,
                            scan_layers=False, dtype="float32", kmajor_weights=mode,
                            compile_cache_dir=str(tmp_path / f"cache{mode}"))
        engine = LLMEngine(lm, engine_config=ecfg)
        lm = engine.model  # the next engine starts from whatever this one left
        layer0 = engine.runner.weights["layers"][0]
        kinds = {isinstance(layer0[n], KMajor) for n in ("qkv", "o", "gate_up", "down")}
        assert kinds == {mode == "all"}, (mode, kinds)  # True: nothing is small here
        res.append(greedy_outputs(LLM.from_engine(engine), [[5 + i for i in range(12)]], p))
        del engine
    for r in res[1:]:
        assert r[0] == res[0][0]
        np.testing.assert_allclose(r[1], res[0][1], atol=1e-4)


def test_engine_with_kmajor_weights_and_the_dense_gemv(tmp_path, monkeypatch):
    """Both options on (the dense GEMV forced on): the GEMV's engine matmul hands the [N, K] weights to
    XLA (the down projection with its activation too), the same tokens as neither."""
    from hf_tiny import greedy_outputs, make_tiny_model
    from jaxserve import LLM, SamplingParams
    from jaxserve.kernels.dense_gemv import pallas_triton
    from tiny_tokenizer import add_byte_tokenizer

    calls = []
    real = pallas_triton.gemv
    monkeypatch.setattr(pallas_triton, "gemv", lambda *a, **k: calls.append(k.get("act")) or real(*a, **k))
    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    prompts = [[5 + i for i in range(12)], [200, 100, 50]]
    p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    res = []
    for on in (False, True):
        llm = LLM(str(d), max_model_len=32, max_num_seqs=2, prefill_chunk_size=16, block_size=4,
                  num_blocks=24, scan_layers=False, dtype="float32", dense_gemv=on, kmajor_weights=on,
                  compile_cache_dir=str(tmp_path / f"cache{on}"))
        res.append(greedy_outputs(llm, prompts, p))
    assert calls == []  # every dense matmul weight of the tiny model is small: [N, K], XLA's
    assert res[0][0] == res[1][0]
    np.testing.assert_allclose(res[0][1], res[1][1], atol=1e-4)


def test_option_parsing_and_errors():
    from jaxserve.cli import build_parser, engine_config_from_args
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    parse = lambda *a: engine_config_from_args(build_parser().parse_args(["run", *a]))  # noqa: E731
    assert parse().kmajor_weights is None
    assert parse("--kmajor-weights", "on").kmajor_weights is True
    assert parse("--kmajor-weights", "off").kmajor_weights is False
    assert parse("--kmajor-weights", "all").kmajor_weights == "all"
    with pytest.raises(ValueError, match="kmajor_weights must be"):
        EngineConfig(kmajor_weights="some")
    with pytest.raises(ValueError, match="kmajor_weights needs a single device"):
        LLMEngine("nonexistent/model", engine_config=EngineConfig(kmajor_weights=True), tp=2)
