"""Shared test base for every paged-attention implementation against the dense oracle.

On CPU this runs the jnp reference (and any implementation the Pallas interpreter can run, once they
exist); on the GPU `bench/kernels_gpu.py` runs the same cases for all of them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.paged_attention import reference as ref

IMPLS = {"reference": ref.paged_attention,
         "reference_1blk": lambda *a, **k: ref.paged_attention(*a, blocks_per_iter=1, **k)}


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
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_long_context_decode_is_exact(impl):
    rng = np.random.default_rng(1)
    c = _case(rng, lens=[200, 77], new=[1, 1], BS=8, num_blocks=64)
    got = IMPLS[impl](c["q"], c["k_cache"], c["v_cache"], c["layer"], c["tables"], c["token_seq"],
                      c["positions"], scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_oracle(c, 0.25, 0, None)), atol=2e-5)


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
