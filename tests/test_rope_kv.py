"""Shared test base of the fused RoPE + K/V cache write: every implementation against the jnp oracle
(the Pallas kernel runs in the interpreter on CPU; on the GPU in bench/kernels_gpu.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import rope_kv
from jaxserve.kernels.rope_kv import reference


@pytest.mark.parametrize("impl", rope_kv.IMPLEMENTATIONS)
@pytest.mark.parametrize("H,KV,hd", [(4, 2, 16), (3, 1, 64)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_kv_matches_oracle(impl, H, KV, hd, dtype, qk_norm):
    rng = np.random.default_rng(H * hd)
    dt = jnp.dtype(dtype)
    T, L, NB, BS = 5, 3, 9, 4
    qkv = jnp.asarray(rng.standard_normal((T, (H + 2 * KV) * hd)), dt)
    positions = jnp.asarray([0, 7, 130, 4095, 3], jnp.int32)
    slots = jnp.asarray(rng.permutation(NB * BS)[:T], jnp.int32)  # distinct slots
    inv_freq = jnp.asarray(1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd)), jnp.float32)
    k_cache = jnp.asarray(rng.standard_normal((L, NB, BS, KV, hd)), dt)
    v_cache = jnp.asarray(rng.standard_normal((L, NB, BS, KV, hd)), dt)
    kw = dict(num_heads=H, num_kv_heads=KV, head_dim=hd)
    if qk_norm:  # Qwen3 / Gemma 3: each q and k head RMS-normed before RoPE (weights far from 1)
        kw["qk_norm"] = (jnp.asarray(rng.uniform(0.2, 3.0, hd), jnp.float32),
                         jnp.asarray(rng.uniform(0.2, 3.0, hd), jnp.float32), 1e-6)
    want = reference.rope_write_kv(qkv, positions, inv_freq, 1.25, k_cache, v_cache, 1, slots, **kw)
    fn = jax.jit(lambda *a: rope_kv.get(impl)(*a, **kw), donate_argnums=(4, 5))
    got = fn(qkv, positions, inv_freq, jnp.float32(1.25), jnp.array(k_cache), jnp.array(v_cache),
             jnp.int32(1), slots)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
    # Only the T slots of layer 1 changed.
    changed = np.any(np.asarray(got[1] != k_cache), axis=(3, 4))
    assert changed.sum() <= T and not changed[[0, 2]].any()


@pytest.mark.parametrize("impl", rope_kv.IMPLEMENTATIONS)
def test_rope_write_kv_fp8_cache(impl):
    """bf16 q/k/v into an fp8 cache: k rounded to bf16 (as the reference's RoPE output), then to e4m3."""
    rng = np.random.default_rng(3)
    H, KV, hd, T, L, NB, BS = 4, 2, 16, 3, 2, 5, 4
    qkv = jnp.asarray(8 * rng.standard_normal((T, (H + 2 * KV) * hd)), jnp.bfloat16)
    positions = jnp.asarray([0, 9, 300], jnp.int32)
    slots = jnp.asarray([3, 17, 8], jnp.int32)
    inv_freq = jnp.asarray(1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd)), jnp.float32)
    k_cache = jnp.zeros((L, NB, BS, KV, hd), jnp.float8_e4m3fn)
    v_cache = jnp.zeros((L, NB, BS, KV, hd), jnp.float8_e4m3fn)
    kw = dict(num_heads=H, num_kv_heads=KV, head_dim=hd)
    want = reference.rope_write_kv(qkv, positions, inv_freq, 1.0, k_cache, v_cache, 1, slots, **kw)
    got = jax.jit(lambda *a: rope_kv.get(impl)(*a, **kw))(qkv, positions, inv_freq, jnp.float32(1.0),
                                                          k_cache, v_cache, jnp.int32(1), slots)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        # one e4m3 step (1/8 relative) where the kernel's f32 RoPE rounds across a boundary
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=0.13, atol=2e-2)
    assert np.mean(np.asarray(got[1], np.float32) == np.asarray(want[1], np.float32)) > 0.97


@pytest.mark.parametrize("impl", rope_kv.IMPLEMENTATIONS)
@pytest.mark.parametrize("P", [2, 3])
def test_rope_write_kv_takes_split_sums(impl, P):
    """qkv given as a SplitSum (f32 partials of a split-K matmul): the kernel adds the parts itself;
    the result equals the reference on their total (rounded to bf16, as the matmul's output)."""
    from jaxserve.kernels.split_sum import SplitSum

    rng = np.random.default_rng(P)
    H, KV, hd, T, L, NB, BS = 4, 2, 16, 3, 2, 5, 4
    parts = jnp.asarray(rng.standard_normal((P, T, (H + 2 * KV) * hd)), jnp.float32)
    qkv = SplitSum(parts, jnp.bfloat16)
    positions = jnp.asarray([0, 9, 300], jnp.int32)
    slots = jnp.asarray([3, 17, 8], jnp.int32)
    inv_freq = jnp.asarray(1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd)), jnp.float32)
    k_cache = jnp.asarray(rng.standard_normal((L, NB, BS, KV, hd)), jnp.bfloat16)
    v_cache = jnp.asarray(rng.standard_normal((L, NB, BS, KV, hd)), jnp.bfloat16)
    kw = dict(num_heads=H, num_kv_heads=KV, head_dim=hd)
    want = reference.rope_write_kv(qkv.total(), positions, inv_freq, 1.0, k_cache, v_cache, 1, slots, **kw)
    got = jax.jit(lambda q, *a: rope_kv.get(impl)(q, *a, **kw))(qkv, positions, inv_freq, jnp.float32(1.0),
                                                              k_cache, v_cache, jnp.int32(1), slots)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_with_fused_rope_kv_is_the_same_function(arch):
    """The decoder with the Pallas kernel (interpreted) = the decoder's own jnp path (Qwen3: with its
    q/k norms inside the kernel)."""
    import functools

    from jaxserve.config import ModelConfig
    from jaxserve.kernels.rope_kv import pallas_triton
    from jaxserve.loader.materialize import random_weights
    from jaxserve.models import transformer as tf

    cfg = ModelConfig(arch=arch, vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, qk_norm=arch == "qwen3")
    w = tf.fuse_projections(tf.unstack_layers(random_weights(cfg, jnp.float32, jax.random.PRNGKey(0), 0.2)))
    if cfg.qk_norm:  # norm weights far from 1 (random_weights makes them ones)
        rng = np.random.default_rng(1)
        for lw in w["layers"]:
            lw["q_norm"], lw["k_norm"] = (jnp.asarray(rng.uniform(0.2, 3.0, 16), jnp.float32) for _ in "qk")
    consts = {k: jnp.asarray(v) for k, v in tf.layer_constants(cfg).items()}
    T, BS = 6, 4
    shape = (cfg.num_layers, 8, BS, cfg.num_kv_heads, cfg.head_dim)
    batch = {"token_ids": jnp.asarray([5, 17, 250, 3, 99, 42], jnp.int32),
             "positions": jnp.arange(T, dtype=jnp.int32), "token_seq": jnp.zeros(T, jnp.int32),
             "slots": jnp.arange(T, dtype=jnp.int32) + BS, "block_tables": jnp.asarray([[1, 2, 0], [0, 0, 0]])}
    outs = []
    for rk in (None, functools.partial(pallas_triton.rope_write_kv, interpret=True)):
        kv = (jnp.zeros(shape), jnp.zeros(shape))
        h, kv = jax.jit(lambda w, kv: tf.forward_hidden(cfg, w, consts, kv, batch, scan_layers=False,
                                                        rope_kv=rk))(w, kv)
        outs.append((h, kv))
    np.testing.assert_allclose(np.asarray(outs[1][0]), np.asarray(outs[0][0]), rtol=1e-5, atol=1e-5)
    for a, b in zip(outs[1][1], outs[0][1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
