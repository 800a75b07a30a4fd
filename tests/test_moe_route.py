"""Shared test base of the MoE routing: every implementation against the model's jnp ops (the Pallas
kernel runs in the interpreter on CPU, compiled on the GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import moe_route
from jaxserve.kernels.moe_route import reference


def _same(got, want):
    ids, w = got
    assert ids.shape == want[0].shape and ids.dtype == jnp.int32 and w.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(w), np.asarray(want[1]), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("impl", moe_route.IMPLEMENTATIONS)
@pytest.mark.parametrize("T,E,k,normalize", [(1, 128, 8, True), (5, 60, 4, False), (3, 8, 2, True),
                                             (2, 256, 8, True), (4, 64, 1, False)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_oracle(impl, T, E, k, normalize, dtype):
    rng = np.random.default_rng(T * E + k)
    logits = jnp.asarray(3 * rng.standard_normal((T, E)), dtype)
    want = reference.route(logits, k=k, normalize=normalize)
    got = jax.jit(lambda x: moe_route.get(impl)(x, k=k, normalize=normalize))(logits)
    _same(got, want)
    # ids are distinct per token and ordered by probability (the top-k's order)
    p = np.asarray(jax.nn.softmax(logits.astype(jnp.float32), axis=-1))
    ids = np.asarray(got[0])
    for t in range(T):
        assert len(set(ids[t])) == k
        assert np.all(np.diff(p[t, ids[t]]) <= 0)


@pytest.mark.parametrize("impl", moe_route.IMPLEMENTATIONS)
def test_ties_go_to_the_lower_id(impl):
    """Equal logits (bf16 routers tie often): the lower expert id first, as lax.top_k."""
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0, 2.0, -1.0]] * 2, jnp.float32)
    got = moe_route.get(impl)(logits, k=4, normalize=True)
    np.testing.assert_array_equal(np.asarray(got[0]), [[1, 2, 4, 5]] * 2)
    _same(got, reference.route(logits, k=4, normalize=True))


@pytest.mark.parametrize("impl", moe_route.IMPLEMENTATIONS)
@pytest.mark.parametrize("valid", [[True, False, True, False], [False, False, True, True], [False] * 4])
def test_padding_tokens_take_the_first_valid_tokens_experts(impl, valid):
    rng = np.random.default_rng(sum(valid))
    logits = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    v = jnp.asarray(valid)
    got = jax.jit(lambda x, v: moe_route.get(impl)(x, v, k=3, normalize=True))(logits, v)
    _same(got, reference.route(logits, v, k=3, normalize=True))
    w = np.asarray(got[1])
    assert np.all(w[~np.asarray(valid)] == 0)
    if any(valid):
        first = valid.index(True)
        for t in range(4):
            assert list(np.asarray(got[0])[t]) == list(np.asarray(got[0])[first])  or valid[t]


def test_bad_k():
    from jaxserve.kernels.moe_route import pallas_triton

    with pytest.raises(ValueError, match="k=9 must be between 1 and the 8 experts"):
        pallas_triton.route(jnp.zeros((1, 8)), k=9, normalize=True)
