"""Shared test base of the fused residual add + RMSNorm: every implementation against the jnp oracle
(on CPU the Pallas kernel runs in the interpreter; bench/kernels_gpu.py runs it on the GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import rms_norm

IMPLS = rms_norm.IMPLEMENTATIONS


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T,D", [(1, 64), (5, 576), (33, 128), (2, 512)])
@pytest.mark.parametrize("with_r", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_add_rms_norm_matches_oracle(impl, T, D, with_r, dtype):
    rng = np.random.default_rng(T * D)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((T, D)) * 3, dt)
    r = jnp.asarray(rng.standard_normal((T, D)), dt) if with_r else None
    w = jnp.asarray(1 + 0.3 * rng.standard_normal(D), dt)
    fn = jax.jit(lambda x, r, w: rms_norm.get(impl)(x, r, w, 1e-6))
    s, h = fn(x, r, w)
    # Oracle in f64 on the same (dtype-rounded) sum.
    s_ref = np.asarray(x, np.float64) + (np.asarray(r, np.float64) if with_r else 0)
    s_ref = np.asarray(jnp.asarray(s_ref, dt), np.float64)
    h_ref = s_ref / np.sqrt(np.mean(s_ref ** 2, axis=-1, keepdims=True) + 1e-6) * np.asarray(w, np.float64)
    assert s.dtype == dt and h.dtype == dt and s.shape == (T, D) and h.shape == (T, D)
    assert np.array_equal(np.asarray(s, np.float64), s_ref)  # the residual stream is exact
    tol = 1e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(h, np.float64), h_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("P,T,D", [(3, 1, 4096), (2, 5, 576), (9, 2, 576), (2, 3, 256)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_add_rms_norm_takes_split_sums(impl, P, T, D, dtype):
    """r given as a SplitSum (a split-K matmul's f32 partials, kernels/split_sum.py): the kernel adds
    the parts itself and computes the same function as with r = their total (rounded to the dtype)."""
    from jaxserve.kernels.split_sum import SplitSum

    rng = np.random.default_rng(P * T * D)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((T, D)) * 3, dt)
    parts = jnp.asarray(rng.standard_normal((P, T, D)), jnp.float32)
    w = jnp.asarray(1 + 0.3 * rng.standard_normal(D), dt)
    fn = jax.jit(lambda x, r, w: rms_norm.get(impl)(x, r, w, 1e-6))
    s, h = fn(x, SplitSum(parts, dt), w)
    s_want, h_want = fn(x, SplitSum(parts, dt).total(), w)
    assert s.dtype == dt and h.shape == (T, D)
    # f32: the same values (the parts are added in one order everywhere, split_sum.add_parts); bf16: XLA
    # may keep the rounded total in f32 (excess precision), 1 ulp
    tol = 1e-7 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(s, np.float32), np.asarray(s_want, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(h_want, np.float32), rtol=tol, atol=tol)
