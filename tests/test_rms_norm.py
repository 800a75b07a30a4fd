"""Shared test base of the fused residual add + RMSNorm: every implementation against the jnp oracle
(on CPU the Pallas kernel runs in the interpreter; bench/kernels_gpu.py runs it on the GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import rms_norm

IMPLS = rms_norm.IMPLEMENTATIONS


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T,D", [(1, 64), (5, 576), (33, 128)])
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
