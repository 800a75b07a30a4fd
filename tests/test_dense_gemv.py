"""Shared test base of the dense decode GEMV (kernels/dense_gemv): every implementation against the jnp
oracle (the Pallas kernel in the interpreter on CPU; on the GPU the same tests run it for real), then the
engine's use of it: the same function as the plain decoder, through the whole engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import dense_gemv
from jaxserve.kernels.dense_gemv import pallas_triton, reference
from jaxserve.kernels.split_sum import SplitSum, total


@pytest.fixture
def highest_precision():
    # on a GPU the reference's f32 dot would otherwise run in TF32
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("impl", dense_gemv.IMPLEMENTATIONS)
@pytest.mark.parametrize("M,K,N", [(1, 256, 192), (2, 576, 960), (1, 1024, 48), (9, 128, 64), (32, 256, 128)])
@pytest.mark.parametrize("act", [None, "silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.usefixtures("highest_precision")
def test_gemv_matches_oracle(impl, M, K, N, act, dtype):
    rng = np.random.default_rng(M * K + N)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((M, 2 * K if act else K)), dt)
    w = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), dt)
    if impl == "pallas_triton" and not pallas_triton.supports(x, w, act):
        assert dtype == "float32" and M > pallas_triton.MAX_M  # f32 runs 'fma' mode: at most MAX_M rows
        pytest.skip("f32 weights take at most MAX_M rows")
    # independent oracle: numpy f64 of the rounded matmul input
    xin = np.asarray(reference.gemv_input(x, act), np.float64)
    want = xin @ np.asarray(w, np.float64)
    for split_out in (False, True):
        got = jax.jit(lambda x, w: dense_gemv.get(impl)(x, w, act=act, split_out=split_out,
                                                        block_k=64, block_n=64))(x, w)
        y = total(got)
        assert y.shape == (M, N) and y.dtype == dt
        tol = 1e-5 if dtype == "float32" else 1.6e-2
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol)


def test_split_out_gives_partials_and_one_split_gives_the_output():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 128)) / 20, jnp.bfloat16)
    y = pallas_triton.gemv(x, w, split_out=True, block_k=64, block_n=64, max_splits=4)
    assert isinstance(y, SplitSum) and y.parts.shape == (4, 1, 128) and y.parts.dtype == jnp.float32
    assert y.dtype == jnp.bfloat16
    one = pallas_triton.gemv(x, w, split_out=True, block_k=64, block_n=64, max_splits=1)
    assert not isinstance(one, SplitSum) and one.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y.total(), np.float32), np.asarray(one, np.float32),
                               rtol=1e-2, atol=1e-2)


def test_bad_arguments_are_clear_errors():
    x, w = jnp.ones((1, 64)), jnp.ones((64, 32))
    with pytest.raises(ValueError, match="unknown tuning"):
        pallas_triton.gemv(x, w, block_m=4)
    with pytest.raises(ValueError, match="mode must be"):
        pallas_triton.gemv(x, w, mode="mma")
    with pytest.raises(ValueError, match="unsupported"):
        pallas_triton.gemv(jnp.ones((8, 64)), w)  # f32: 'fma' mode, at most MAX_M rows
    with pytest.raises(ValueError, match="unsupported"):
        pallas_triton.gemv(jnp.ones((33, 64), jnp.bfloat16), w.astype(jnp.bfloat16))  # more than MAX_M_DOT
    with pytest.raises(ValueError, match="unknown activation"):
        reference.gemv(jnp.ones((1, 128)), w, act="relu6")
    assert not pallas_triton.supports(jnp.ones((1, 60)), jnp.ones((60, 32)))  # K without a 16-row tile


def test_engine_matmul_routes_each_call():
    """engine_matmul: the kernel only for calls whose consumer takes partials or the activation, and
    only for few rows; x @ w otherwise — each the same function as the plain matmul."""
    mm = dense_gemv.engine_matmul()
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
    x1 = jnp.asarray(rng.standard_normal((1, 128)), jnp.float32)
    x8 = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
    assert isinstance(mm(x1, w, split_out=True), SplitSum)
    assert not isinstance(mm(x8, w, split_out=True), SplitSum)  # a prompt step: XLA's matmul
    np.testing.assert_allclose(np.asarray(total(mm(x1, w, split_out=True))), np.asarray(x1 @ w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mm(x8, w, split_out=True)), np.asarray(x8 @ w), rtol=1e-6)
    gu = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
    np.testing.assert_allclose(np.asarray(mm(gu, w, act="silu")),
                               np.asarray(dense_gemv.act_mul("silu", gu) @ w), rtol=1e-6)


def test_engine_matmul_narrow_mode():
    """The engine's default on one GPU (max_n): every one-row call with at most max_n output columns
    takes the kernel, split_out or not (a plain call gets the plain output); wider weights and
    prompt-sized steps stay x @ w."""
    mm = dense_gemv.engine_matmul(max_n=64)
    rng = np.random.default_rng(3)
    narrow = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
    wide = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
    x1 = jnp.asarray(rng.standard_normal((1, 128)), jnp.float32)
    x8 = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
    calls = []
    real = pallas_triton.gemv
    try:
        pallas_triton.gemv = lambda *a, **k: calls.append(a[1].shape) or real(*a, **k)
        got = mm(x1, narrow)
        assert not isinstance(got, SplitSum)
        np.testing.assert_allclose(np.asarray(got), np.asarray(x1 @ narrow), rtol=1e-5, atol=1e-5)
        assert isinstance(mm(x1, narrow, split_out=True), SplitSum)
        assert not isinstance(mm(x1, wide, split_out=True), SplitSum)  # wide: XLA's GEMM
        np.testing.assert_allclose(np.asarray(mm(x8, narrow)), np.asarray(x8 @ narrow), rtol=1e-6)
    finally:
        pallas_triton.gemv = real
    assert calls == [(128, 64), (128, 64)]


def test_moe_router_takes_the_runner_matmul(monkeypatch):
    """A MoE block given the runner's dense matmul runs its router (E = 32 columns) through the GEMV;
    the block is the same function."""
    from test_moe_gemv import _qwen3_moe_layer

    from jaxserve.models import moe

    rng = np.random.default_rng(5)
    cfg, w = _qwen3_moe_layer(rng, 32, 4, 64, 96, jnp.float32)
    h = jnp.asarray(rng.standard_normal((1, 64)), jnp.float32)
    calls = []
    real = pallas_triton.gemv
    monkeypatch.setattr(pallas_triton, "gemv", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    mm = dense_gemv.engine_matmul(max_n=dense_gemv.AUTO_MAX_N)
    got = moe.moe_mlp(cfg, h, w, jax.nn.silu, impl="xla", qmm=mm)
    want = moe.moe_mlp(cfg, h, w, jax.nn.silu, impl="xla")
    assert calls == [(64, 32)]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _tiny(arch="llama"):
    from jaxserve.config import ModelConfig

    kw = dict(hidden_act="gelu_tanh") if arch == "gemma" else {}
    return ModelConfig(arch="llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, **kw)


@pytest.mark.parametrize("act,dtype,ntok", [("silu", "float32", 2), ("gelu_tanh", "float32", 2),
                                             ("silu", "bfloat16", 6)])
def test_decoder_with_dense_gemv_is_the_same_function(act, dtype, ntok, monkeypatch):
    """Decode tokens through the unrolled decoder with the GEMV (interpreted) and its partials fed
    to the interpreted RoPE/K-V and add+RMSNorm kernels = the decoder's own jnp path (bf16 at 6 rows:
    'dot' mode with x padded to a 16-row tile and the padded output rows sliced off)."""
    import functools

    from jaxserve.kernels.rms_norm import pallas_triton as norm_pt
    from jaxserve.kernels.rope_kv import pallas_triton as rope_pt
    from jaxserve.loader.materialize import random_weights
    from jaxserve.models import transformer as tf

    cfg = _tiny("gemma" if act == "gelu_tanh" else "llama")
    dt = jnp.dtype(dtype)
    w = tf.fuse_projections(tf.unstack_layers(random_weights(cfg, dt, jax.random.PRNGKey(0), 0.2)))
    consts = {k: jnp.asarray(v) for k, v in tf.layer_constants(cfg).items()}
    BS = 4
    shape = (cfg.num_layers, 8 * ntok, BS, cfg.num_kv_heads, cfg.head_dim)
    # one decode token per sequence, each sequence with two blocks of its own
    batch = {"token_ids": jnp.asarray([5, 250, 17, 99, 3, 180][:ntok], jnp.int32),
             "positions": jnp.asarray([3, 6, 1, 7, 4, 5][:ntok], jnp.int32),
             "token_seq": jnp.arange(ntok, dtype=jnp.int32),
             "slots": jnp.asarray([(2 * i + 1) * BS + p for i, p in enumerate([3, 6, 1, 7, 4, 5][:ntok])], jnp.int32),
             "block_tables": jnp.asarray([[2 * i + 1, 2 * i + 2] for i in range(ntok)] + [[0, 0]], jnp.int32)}
    rng = np.random.default_rng(0)
    kv0 = (jnp.asarray(rng.standard_normal(shape), dt), jnp.asarray(rng.standard_normal(shape), dt))
    kernels = dict(rope_kv=functools.partial(rope_pt.rope_write_kv, interpret=True),
                   add_norm=functools.partial(norm_pt.add_rms_norm, interpret=True))
    outs = []
    calls = []
    real = pallas_triton.gemv
    monkeypatch.setattr(pallas_triton, "gemv", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    for qmm in (None, dense_gemv.engine_matmul(max_m=ntok, block_k=16, block_n=16, max_splits=2)):
        fn = jax.jit(lambda w, kv: tf.forward_hidden(cfg, w, consts, kv, batch, scan_layers=False, qmm=qmm,
                                                     **kernels))
        outs.append(fn(w, kv0))
    # the GEMV's activation is its own f32 formula: with f32 weights both paths agree to rounding; with bf16
    # the GEMV's partials are added in f32 where XLA rounds its dot to bf16 first
    assert calls and set(calls) == {ntok}  # q/k/v, o and down of each layer took the GEMV
    tol = 2e-5 if dtype == "float32" else 6e-2
    np.testing.assert_allclose(np.asarray(outs[1][0], np.float32), np.asarray(outs[0][0], np.float32),
                               rtol=tol, atol=tol)
    for a, b in zip(outs[1][1], outs[0][1]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


def test_engine_option_generates_the_same_tokens(tmp_path, monkeypatch):
    """EngineConfig.dense_gemv through the whole engine (decode loop, sampler; the kernels interpreted on
    CPU, unrolled layers): the same greedy tokens and logprobs as without it."""
    from hf_tiny import greedy_outputs, make_tiny_model
    from jaxserve import LLM, SamplingParams
    from tiny_tokenizer import add_byte_tokenizer

    calls = []
    real = pallas_triton.gemv
    monkeypatch.setattr(pallas_triton, "gemv", lambda *a, **k: calls.append(k.get("act")) or real(*a, **k))
    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    prompts = [[5 + i for i in range(12)], [200, 100, 50]]
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    res = []
    for on in (False, True):
        llm = LLM(str(d), max_model_len=32, max_num_seqs=2, prefill_chunk_size=16, block_size=4,
                  num_blocks=24, scan_layers=False, dense_gemv=on, fused_rope_kv=on,
                  compile_cache_dir=str(tmp_path / f"cache{on}"))  # traced, not loaded from a store
        assert (getattr(llm.engine.runner.qmatmul, "takes_dense", False)) == on
        res.append(greedy_outputs(llm, prompts, p))
    # traced per layer: q/k/v, o (no act) and down (act) of the decode programs
    assert calls.count("silu") >= 1 and calls.count(None) >= 2
    assert res[0][0] == res[1][0]
    np.testing.assert_allclose(res[0][1], res[1][1], atol=1e-4)


def test_engine_option_errors():
    from jaxserve.cli import build_parser, engine_config_from_args
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    parse = lambda *a: engine_config_from_args(build_parser().parse_args(["run", *a]))  # noqa: E731
    assert parse().dense_gemv is None and parse("--dense-gemv", "on").dense_gemv is True
    with pytest.raises(ValueError, match="dense_gemv needs a single device"):
        LLMEngine("nonexistent/model", engine_config=EngineConfig(dense_gemv=True), tp=2)
