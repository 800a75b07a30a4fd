"""The in-place MoE expert matmuls (kernels/moe_gemv): every implementation against an independent
per-token numpy loop (the Pallas kernel in the interpreter on CPU; on the GPU the same tests compile it),
sorted multi-row tiles with unused tiles skipped, and models/moe.py's MoE block through the kernel
against its XLA path on a tiny Qwen3-MoE-like layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import moe_gemv
from jaxserve.kernels.moe_gemv import pallas_triton, reference


@pytest.fixture
def highest_precision():
    # on a GPU the f32 matmuls of the reference and the XLA path would otherwise run in TF32
    with jax.default_matmul_precision("highest"):
        yield


def _silu(a):
    return a / (1 + np.exp(-a))


def _layer(rng, E, D, F, dtype):
    r = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), dtype)  # noqa: E731
    return r(E, D, F), r(E, D, F), r(E, F, D)


def _loop(x, ids, wts, wg, wu, wd, round_to):
    """Per (token, choice) in float64: the gate_up rows (rounded to the kernel's output dtype) and the
    weighted sum of the down rows per token."""
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    T, k = ids.shape
    rows = np.zeros((T * k, wg.shape[2]))
    out = np.zeros((T, wd.shape[2]))
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            a = _silu(x[t] @ wg[e]) * (x[t] @ wu[e])
            rows[t * k + j] = a = np.asarray(jnp.asarray(a, round_to), np.float64)
            out[t] += wts[t, j] * (a @ wd[e])
    return rows, out


# (tokens, k, experts, D, F): one token; tokens sharing experts; a full 8-of-16 step
CASES = [(1, 2, 4, 64, 96), (3, 2, 4, 64, 96), (8, 8, 16, 128, 256)]


@pytest.mark.parametrize("impl", moe_gemv.IMPLEMENTATIONS)
@pytest.mark.parametrize("T,k,E,D,F", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.usefixtures("highest_precision")
def test_pairs_match_a_per_token_loop(impl, T, k, E, D, F, dtype):
    rng = np.random.default_rng(T * 100 + E)
    dt = jnp.dtype(dtype)
    wg, wu, wd = _layer(rng, E, D, F, dt)
    x = jnp.asarray(rng.standard_normal((T, D)), dt)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    if T == 3:
        ids[1], ids[2] = ids[0], ids[0][::-1]  # the same experts for several tokens, in either order
    wts = rng.random((T, k)).astype(np.float32)
    want_rows, want = _loop(x, ids, wts, wg, wu, wd, dt)
    mod = moe_gemv.get(impl)
    # small blocks: several K steps and column tiles
    tuning = dict(block_k=32, block_n=32, min_programs=1) if impl == "pallas_triton" else {}
    row_token, tile_expert = moe_gemv.pair_layout(jnp.asarray(ids))
    rows = jax.jit(lambda x: mod.gate_up(x, row_token, tile_expert, wg, wu, act="silu", **tuning))(x)
    assert rows.shape == (T * k, F) and rows.dtype == dt
    got = jax.jit(lambda x: moe_gemv.expert_mlp(x, jnp.asarray(ids), jnp.asarray(wts), wg, wu, wd, act="silu",
                                                impl=impl, **tuning))(x)
    assert got.shape == (T, D) and got.dtype == jnp.float32
    tol = 1e-5 if dtype == "float32" else 2e-2  # bf16: one output rounding of the gate_up rows
    np.testing.assert_allclose(np.asarray(rows, np.float64), want_rows, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("tuning", [dict(mode="fma"), dict(), dict(block_k=256, block_n=128, act="gelu_tanh")])
@pytest.mark.usefixtures("highest_precision")
def test_kernel_modes_and_blocks_match_the_reference(tuning):
    """bf16 one-row tiles: the f32 multiply-add mode and the padded tensor-core mode; default blocks
    (columns narrowed to fill the grid) and blocks wider than the weights' dimensions; GELU."""
    tuning = dict(tuning)
    act = tuning.pop("act", "silu")
    rng = np.random.default_rng(5)
    E, D, F = 8, 128, 96
    wg, wu, wd = _layer(rng, E, D, F, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, D)), jnp.bfloat16)
    row_token, tile_expert = moe_gemv.pair_layout(jnp.asarray([[3, 0, 7], [7, 1, 3]], jnp.int32))
    a = pallas_triton.gate_up(x, row_token, tile_expert, wg, wu, act=act, **tuning)
    y = pallas_triton.down(a, tile_expert, wd, **tuning)
    want_a = reference.gate_up(x, row_token, tile_expert, wg, wu, act=act)
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(want_a, np.float32), rtol=1e-2, atol=1e-2)
    # down of the same bf16 rows: only the summation order differs
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference.down(a, tile_expert, wd)), rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("highest_precision")
def test_sorted_tiles_with_unused_tiles():
    """16-row tiles of one expert each (models/moe.py's layout for prompt chunks), the tile count at
    its worst case: the kernel computes the used tiles as the reference does and skips the rest."""
    from jaxserve.models import moe

    rng = np.random.default_rng(7)
    T, k, E, D, F, tile = 20, 4, 16, 64, 96, 16
    wg, wu, wd = _layer(rng, E, D, F, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(6, k, replace=False) for _ in range(T)]), jnp.int32)  # 6 experts used
    order, token, dest, tile_expert, live = moe._sorted_tiles(ids, E, tile)
    row_token = jnp.zeros((tile_expert.shape[0] * tile,), jnp.int32).at[dest].set(token)
    n_live = int(live[0])
    assert n_live < tile_expert.shape[0]
    got_a = pallas_triton.gate_up(x, row_token, tile_expert, wg, wu, act="silu", live_tiles=live, block_k=32)
    want_a = reference.gate_up(x, row_token, tile_expert, wg, wu, act="silu")
    used = slice(0, n_live * tile)
    np.testing.assert_allclose(np.asarray(got_a[used], np.float32), np.asarray(want_a[used], np.float32),
                               rtol=1e-2, atol=1e-2)
    got_y = pallas_triton.down(want_a, tile_expert, wd, live_tiles=live, block_k=32)
    np.testing.assert_allclose(np.asarray(got_y[used]), np.asarray(reference.down(want_a, tile_expert, wd)[used]),
                               rtol=1e-4, atol=1e-4)
    # the pairs' rows hold each pair's result: the per-token loop's, after the router weights
    wts = rng.random((T, k)).astype(np.float32)
    pair_rows = got_y[dest] * jnp.asarray(wts).reshape(-1)[order][:, None]
    y = np.asarray(jnp.zeros((T, D), jnp.float32).at[token].add(pair_rows))
    _, want = _loop(x, np.asarray(ids), wts, wg, wu, wd, jnp.bfloat16)
    np.testing.assert_allclose(y, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def _qwen3_moe_layer(rng, E, k, D, F, dtype):
    from jaxserve.config import ModelConfig

    cfg = ModelConfig(arch="qwen3_moe", vocab_size=10, hidden_size=D, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, num_experts=E, experts_per_token=k,
                      moe_intermediate_size=F, norm_topk_prob=True)
    wg, wu, wd = _layer(rng, E, D, F, dtype)
    w = {"router": jnp.asarray(rng.standard_normal((D, E)), dtype), "experts_gate": wg, "experts_up": wu,
         "experts_down": wd}
    return cfg, w


@pytest.mark.parametrize("dtype,tokens", [("float32", 1), ("float32", 5), ("bfloat16", 3), ("bfloat16", 24)])
@pytest.mark.usefixtures("highest_precision")
def test_moe_mlp_through_the_kernel_matches_the_xla_path(dtype, tokens):
    """moe_mlp with the expert path forced to the kernel (interpreter on CPU) against the XLA path:
    one-row tiles (1 and 5 tokens: 4 and 20 pairs) and 16-row sorted tiles (24 tokens: 96 pairs); the
    kernel path routes in kernels/moe_route's Pallas kernel, here with padding tokens in the step."""
    from jaxserve.models import moe

    rng = np.random.default_rng(tokens)
    dt = jnp.dtype(dtype)
    cfg, w = _qwen3_moe_layer(rng, 32, 4, 64, 96, dt)
    h = jnp.asarray(rng.standard_normal((tokens, 64)), dt)
    assert moe._tile(tokens * 4) == (1 if tokens < 24 else 16)
    valid = jnp.asarray(np.arange(tokens) % 4 != 1)  # token 1 (and 5, 9, ...) is padding
    run = lambda impl: np.asarray(jax.jit(  # noqa: E731
        lambda h: moe.moe_mlp(cfg, h, w, jax.nn.silu, impl=impl, valid=valid))(h), np.float64)
    got, want = run("pallas_triton"), run("xla")
    assert np.abs(want).max() > 0.1
    if tokens > 1:
        assert np.all(want[1] == 0)  # a padding token's experts weigh 0
    # bf16: the XLA path rounds g, u and act(g) * u to bf16, the kernel only act(g) * u; one bf16 output
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_the_default_path_and_fallbacks():
    """CPU keeps the XLA path; shapes the kernel does not take (F = 24: no 16-column tile) fall back to
    XLA when the kernel is forced; unknown names and tuning keys are errors."""
    from jaxserve.models import moe

    on_gpu = jax.default_backend() == "gpu"
    assert moe.experts_impl(None, 1) == ("pallas_triton" if on_gpu and moe.KERNEL_MAX_TILE else "xla")
    assert moe.experts_impl(None, 64) == "xla"
    rng = np.random.default_rng(3)
    cfg, w = _qwen3_moe_layer(rng, 8, 2, 32, 24, jnp.float32)
    assert not pallas_triton.supports(jnp.float32, w["experts_gate"], 1)
    h = jnp.asarray(rng.standard_normal((2, 32)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(moe.moe_mlp(cfg, h, w, jax.nn.silu, impl="pallas_triton"),
                                   moe.moe_mlp(cfg, h, w, jax.nn.silu, impl="xla"), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="unknown MoE expert path"):
        moe.moe_mlp(cfg, h, w, jax.nn.silu, impl="triton")
    x, wg = jnp.ones((1, 64)), jnp.ones((2, 64, 32))
    with pytest.raises(ValueError, match="unknown tuning"):
        pallas_triton.down(x, jnp.zeros((1,), jnp.int32), wg, block_m=4)
    with pytest.raises(ValueError, match="rows are not whole tiles"):
        pallas_triton.down(jnp.ones((3, 64)), jnp.zeros((2,), jnp.int32), wg)
