"""Shared test base for every paged-attention implementation against the dense oracle.

On CPU this runs the jnp reference and the Pallas Triton-backend kernels in the Pallas interpreter
(each pallas case compiles an interpreted program: ~1-3 s); on the GPU `bench/kernels_gpu.py` checks
all implementations at real shapes in bf16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.paged_attention import pallas_triton as ptri
from jaxserve.kernels.paged_attention import reference as ref

IMPLS = {"reference": ref.paged_attention,
         "reference_1blk": lambda *a, **k: ref.paged_attention(*a, blocks_per_iter=1, **k),
         # Pallas Triton-backend kernels; on CPU they run in the Pallas interpreter (small shapes only).
         "pallas_triton_decode": lambda *a, **k: _jit(ptri.paged_attention, a, k, mode="decode",
                                                      num_splits=3, block_k=16, split_min_tiles=1),
         "pallas_triton_prefill": lambda *a, **k: _jit(ptri.paged_attention, a, k, mode="prefill",
                                                       block_q=4, block_k=16)}
if jax.devices()[0].platform == "cpu":  # the native CPU kernel (an XLA FFI call built at first use)
    from jaxserve.kernels.paged_attention import cpu_native

    IMPLS["cpu_native"] = lambda *a, **k: _jit(cpu_native.paged_attention, a, k)


# f32 tolerance: on a GPU the Pallas kernels' f32 dots run in TF32 (10-bit mantissa), as every
# Triton flash kernel does; the model runs them in bf16 (bench/kernels_gpu.py checks that).
TOL = 2e-5 if jax.devices()[0].platform == "cpu" else 3e-3


def _jit(fn, args, kwargs, **fixed):
    """One compiled program per call (eager dispatch of the wrapper's small ops costs more)."""
    q, kc, vc, layer, *rest = args
    f = jax.jit(lambda q, kc, vc, *rest: fn(q, kc, vc, layer, *rest, **kwargs, **fixed))
    return f(q, kc, vc, *rest)


def _case(rng, lens, new, *, H=6, KV=2, D=16, BS=4, num_blocks=64, L=2, layer=1):
    """Build a paged cache holding `lens[i]` tokens of sequence i (the last new[i] are this step's)."""
    S = len(lens)
    MB = max(-(-n // BS) for n in lens) + 1
    k_cache = jnp.asarray(rng.standard_normal((L, num_blocks, BS, KV, D)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((L, num_blocks, BS, KV, D)), jnp.float32)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((S + 1, MB), np.int32)
    for i, n in enumerate(lens):
        for j in range(-(-n // BS)):
            tables[i, j] = free.pop()
    toks_seq, toks_pos = [], []
    for i, (n, m) in enumerate(zip(lens, new)):
        toks_seq += [i] * m
        toks_pos += list(range(n - m, n))
    T = len(toks_seq)
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, layer=layer, tables=jnp.asarray(tables),
                token_seq=jnp.asarray(toks_seq, jnp.int32), positions=jnp.asarray(toks_pos, jnp.int32),
                lens=lens, new=new, BS=BS)


def _oracle(c, scale, window, softcap):
    outs = []
    t = 0
    for i, (n, m) in enumerate(zip(c["lens"], c["new"])):
        blocks = c["tables"][i, : -(-n // c["BS"])]
        k = c["k_cache"][c["layer"], blocks].reshape(-1, *c["k_cache"].shape[3:])[:n]
        v = c["v_cache"][c["layer"], blocks].reshape(-1, *c["v_cache"].shape[3:])[:n]
        outs.append(ref.dense_attention(c["q"][t:t + m], k, v, scale=scale, window=window,
                                        softcap=softcap, q_offset=n - m))
        t += m
    return jnp.concatenate(outs)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("window,softcap", [(0, None), (5, None), (0, 30.0), (7, 50.0)])
def test_mixed_prefill_and_decode(impl, window, softcap):
    rng = np.random.default_rng(0)
    # Ragged: a fresh prompt, a chunk continuing a cached prefix, and decodes of several lengths.
    c = _case(rng, lens=[13, 21, 1, 9, 33], new=[13, 6, 1, 1, 1])
    scale = 0.3
    got = IMPLS[impl](c["q"], c["k_cache"], c["v_cache"], c["layer"], c["tables"], c["token_seq"],
                      c["positions"], scale=scale, window=window, softcap=softcap)
    want = _oracle(c, scale, window, softcap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_long_context_decode_is_exact(impl):
    rng = np.random.default_rng(1)
    c = _case(rng, lens=[200, 77], new=[1, 1], BS=8, num_blocks=64)
    got = IMPLS[impl](c["q"], c["k_cache"], c["v_cache"], c["layer"], c["tables"], c["token_seq"],
                      c["positions"], scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_oracle(c, 0.25, 0, None)), atol=TOL)


def test_write_kv_then_read():
    rng = np.random.default_rng(2)
    L, NB, BS, KV, D = 2, 8, 4, 2, 8
    kc = jnp.zeros((L, NB, BS, KV, D))
    vc = jnp.zeros((L, NB, BS, KV, D))
    k = jnp.asarray(rng.standard_normal((3, KV, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, KV, D)), jnp.float32)
    slots = jnp.asarray([5, 6, 13])  # block 1 offsets 1,2 and block 3 offset 1
    kc, vc = ref.write_kv(kc, vc, 1, k, v, slots)
    np.testing.assert_array_equal(np.asarray(kc[1, 1, 1]), np.asarray(k[0]))
    np.testing.assert_array_equal(np.asarray(vc[1, 3, 1]), np.asarray(v[2]))
    assert float(jnp.abs(kc[0]).sum()) == 0.0  # other layer untouched


def test_memory_is_bounded_by_chunking():
    """The reference never materialises a [T, context] score matrix: its largest temporary at a long
    context stays proportional to blocks_per_iter, not to the context length."""
    rng = np.random.default_rng(3)
    c = _case(rng, lens=[1024], new=[256], BS=16, num_blocks=80, H=4, KV=1, D=16)
    f = jax.jit(lambda q, kc, vc, t, s, p: ref.paged_attention(q, kc, vc, 1, t, s, p, scale=0.1,
                                                               blocks_per_iter=2))
    exe = f.lower(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["token_seq"], c["positions"]).compile()
    temp = exe.memory_analysis().temp_size_in_bytes
    full_scores = 256 * 4 * 1024 * 4  # what a dense [T, H, context] f32 score matrix would take
    assert temp < full_scores, (temp, full_scores)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_odd_shapes_and_padding_tokens(impl):
    """head_dim not a power of two, one query head per KV head, and runner-style padding tokens (they
    point at the spare block-table row S with position 0): real rows must still be exact."""
    rng = np.random.default_rng(4)
    c = _case(rng, lens=[10, 3, 18], new=[4, 1, 1], H=2, KV=2, D=24, BS=4, num_blocks=24)
    S = len(c["lens"])
    pad = 3
    q = jnp.concatenate([c["q"], jnp.asarray(rng.standard_normal((pad, 2, 24)), jnp.float32)])
    seq = jnp.concatenate([c["token_seq"], jnp.full((pad,), S, jnp.int32)])
    pos = jnp.concatenate([c["positions"], jnp.zeros((pad,), jnp.int32)])
    got = IMPLS[impl](q, c["k_cache"], c["v_cache"], c["layer"], c["tables"], seq, pos, scale=0.2,
                      window=6)
    T = c["q"].shape[0]
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got[:T]), np.asarray(_oracle(c, 0.2, 6, None)), atol=TOL)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_pallas_bf16_traced_layer_and_window(mode):
    """bf16 cache and q, layer and window as traced values inside jit (the scanned-layers path)."""
    rng = np.random.default_rng(5)
    c = _case(rng, lens=[40, 9], new=[5, 1], H=8, KV=2, D=32, BS=8, num_blocks=16)
    qb, kb, vb = (c[n].astype(jnp.bfloat16) for n in ("q", "k_cache", "v_cache"))
    f = jax.jit(lambda q, kc, vc, layer, w: ptri.paged_attention(
        q, kc, vc, layer, c["tables"], c["token_seq"], c["positions"], scale=0.17, window=w,
        softcap=20.0, mode=mode, block_k=16))
    got = f(qb, kb, vb, jnp.int32(1), jnp.int32(11))
    c32 = dict(c, q=qb.astype(jnp.float32), k_cache=kb.astype(jnp.float32), v_cache=vb.astype(jnp.float32))
    want = np.asarray(_oracle(c32, 0.17, 11, 20.0))
    err = np.linalg.norm(np.asarray(got, np.float32) - want) / np.linalg.norm(want)
    assert got.dtype == jnp.bfloat16 and err < 1e-2, err


@pytest.mark.parametrize("window,softcap", [(0, None), (6, 30.0)])
def test_tiled_prefill_region_matches_oracle(window, softcap):
    """The runner's prompt-chunk region: chunks start on tiles of 8, padding tokens (pad row, position
    0) fill each chunk's last tile and whole empty tiles at the end."""
    rng = np.random.default_rng(4)
    c = _case(rng, lens=[13, 21, 30], new=[13, 6, 11])
    tile, S = 8, 3
    seq, pos, where = [], [], []
    t = 0
    for i, (n, m) in enumerate(zip(c["lens"], c["new"])):
        pad = -(-m // tile) * tile
        seq += [i] * m + [S] * (pad - m)
        pos += list(range(n - m, n)) + [0] * (pad - m)
        where += list(range(t, t + m))
        t += pad
    seq += [S] * tile
    pos += [0] * tile
    q = jnp.zeros((len(seq),) + c["q"].shape[1:], jnp.float32).at[jnp.asarray(where)].set(c["q"])
    got = ref.paged_attention_tiled(q, c["k_cache"], c["v_cache"], c["layer"], c["tables"],
                                    jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32), scale=0.3,
                                    window=window, softcap=softcap, tile=tile, blocks_per_iter=2)
    want = _oracle(c, 0.3, window, softcap)
    np.testing.assert_allclose(np.asarray(got)[np.asarray(where)], np.asarray(want), atol=TOL, rtol=TOL)
    assert np.isfinite(np.asarray(got)).all()


LIMIT_IMPLS = {"reference": lambda *a, **k: ref.paged_attention(*a, **k),
               "reference_tiled": lambda *a, **k: ref.paged_attention_tiled(*a, tile=1, blocks_per_iter=2, **k),
               "pallas_triton_prefill": IMPLS["pallas_triton_prefill"]}


@pytest.mark.parametrize("impl", sorted(LIMIT_IMPLS))
@pytest.mark.parametrize("window", [0, 5])
def test_image_rows_see_their_whole_run(impl, window):
    """Per-token key limits (Gemma 3's image rows): rows of a run see every key up to the run's last one,
    the sliding window still counted from their own position; other tokens stay causal."""
    rng = np.random.default_rng(6)
    c = _case(rng, lens=[30, 19, 9], new=[20, 12, 1])
    runs = [(0, 14, 22), (1, 9, 13)]  # (sequence, first, last position of an image run)
    lim = np.asarray(c["positions"]).copy()
    for i, lo, hi in runs:
        rows = (np.asarray(c["token_seq"]) == i) & (lim >= lo) & (lim <= hi)
        lim[rows] = hi
    got = LIMIT_IMPLS[impl](c["q"], c["k_cache"], c["v_cache"], c["layer"], c["tables"], c["token_seq"],
                            c["positions"], scale=0.3, window=window, limits=jnp.asarray(lim, jnp.int32))
    outs, t = [], 0
    for i, (n, m) in enumerate(zip(c["lens"], c["new"])):
        blocks = c["tables"][i, : -(-n // c["BS"])]
        k = c["k_cache"][c["layer"], blocks].reshape(-1, *c["k_cache"].shape[3:])[:n]
        v = c["v_cache"][c["layer"], blocks].reshape(-1, *c["v_cache"].shape[3:])[:n]
        outs.append(ref.dense_attention(c["q"][t:t + m], k, v, scale=0.3, window=window, q_offset=n - m,
                                        limits=lim[t:t + m]))
        t += m
    want = np.asarray(jnp.concatenate(outs))
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL, rtol=TOL)
    causal = np.asarray(_oracle(c, 0.3, window, None))
    assert np.abs(causal - want).max() > 0.1  # the limits change the image rows


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="CPU kernel")
def test_cpu_native_is_the_custom_call_not_the_fallback():
    import shutil

    from jaxserve.kernels.quant_matmul import cpu_native as lib

    if shutil.which(lib.compiler()) is None:
        pytest.skip("no C++ compiler: the reference fallback is what runs")
    target = lib.attention_target()
    assert target is not None
    from jaxserve.kernels import paged_attention as pa

    # the runner's choice: the native kernel on one CPU device, the reference over a mesh
    assert pa.default_for("cpu") == "cpu_native" and pa.default_for("cpu", one_device=False) == "reference"
    rng = np.random.default_rng(1)
    c = _case(rng, lens=[9, 4], new=[1, 1])
    f = jax.jit(lambda q, kc, vc, t, s, p: cpu_native.paged_attention(q, kc, vc, 1, t, s, p, scale=0.5))
    args = (c["q"], c["k_cache"], c["v_cache"], c["tables"], c["token_seq"], c["positions"])
    assert target in f.lower(*args).as_text()
    np.testing.assert_allclose(np.asarray(f(*args)), np.asarray(_oracle(c, 0.5, 0, None)), atol=TOL)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_fp8_cache(impl):
    """An fp8 (e4m3) cache is read widened: every implementation computes the oracle's function of the
    same fp8 values (the oracle reads them as f32)."""
    rng = np.random.default_rng(5)
    c = _case(rng, lens=[13, 21, 1, 40], new=[13, 6, 1, 1])
    c["k_cache"] = ref.to_cache(3 * c["k_cache"], jnp.float8_e4m3fn)
    c["v_cache"] = ref.to_cache(c["v_cache"], jnp.float8_e4m3fn)
    got = IMPLS[impl](c["q"], c["k_cache"], c["v_cache"], c["layer"], c["tables"], c["token_seq"],
                      c["positions"], scale=0.3, window=0, softcap=None)
    want = _oracle(dict(c, k_cache=c["k_cache"].astype(jnp.float32),
                        v_cache=c["v_cache"].astype(jnp.float32)), 0.3, 0, None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)


def test_fp8_writes_saturate():
    """Values past e4m3's range are written as +-448 (a plain cast gives NaN), others rounded."""
    kc = vc = jnp.zeros((1, 2, 4, 1, 4), jnp.float8_e4m3fn)
    k = jnp.asarray([[[1000.0, -1e6, 0.3, 447.0]]])
    kc, vc = ref.write_kv(kc, vc, 0, k, -k, jnp.asarray([5]))
    np.testing.assert_array_equal(np.asarray(kc[0, 1, 1, 0], np.float32), [448, -448, 0.3125, 448])
    np.testing.assert_array_equal(np.asarray(vc[0, 1, 1, 0], np.float32), [-448, 448, -0.3125, -448])
