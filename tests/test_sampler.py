"""Sampler tests: every behaviour is checked against a plain numpy implementation of the same semantics.

Shapes are reused (a handful of compiled programs) to keep the file fast on CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxserve.engine.sampler import NUM_CANDIDATES, block_argmax, block_top_k, sample
from jaxserve.engine.sampling_params import SamplingParams as SP
from jaxserve.engine.sampling_tensors import (
    SAMPLING_TENSOR_KEYS,
    build_sampling_tensors,
    seed_to_u32,
)

_sample = jax.jit(sample, static_argnames=("num_top", "num_candidates", "return_processed"))
NUM_TOP = 5


def run(logits, params, seeds=None, positions=None, counts=None, prompt_mask=None, *, num_top=NUM_TOP,
        num_candidates=NUM_CANDIDATES, output_lens=None, eos=(), processed=True):
    logits = np.asarray(logits, np.float32)
    S, V = logits.shape
    n = len(params)
    seeds = list(range(n)) if seeds is None else list(seeds)
    st = build_sampling_tensors(params, S, seeds, output_lens=output_lens, eos_token_ids=eos)
    positions = np.zeros(S, np.int32) if positions is None else np.asarray(positions, np.int32)
    counts = np.zeros((S, V), np.int32) if counts is None else np.asarray(counts, np.int32)
    prompt_mask = np.zeros((S, V), bool) if prompt_mask is None else np.asarray(prompt_mask, bool)
    out = _sample(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in st.items()}, jnp.asarray(positions),
                  jnp.asarray(counts), jnp.asarray(prompt_mask), num_top=num_top,
                  num_candidates=num_candidates, return_processed=processed)
    return {k: np.asarray(v) for k, v in out.items()}


# ----------------------------------------------------------------------------- numpy reference

def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_process(logits, p: SP, counts, prompt_mask, suppress=()):
    """Bias, suppression, repetition (HF), frequency / presence (OpenAI) on one row."""
    x = np.asarray(logits, np.float32).copy()
    for t, b in p.logit_bias.items():
        x[t] += np.float32(b)
    for t in suppress:
        x[t] = -np.inf
    r = np.float32(p.repetition_penalty)
    seen = counts > 0
    pen = seen | prompt_mask
    x = np.where(pen, np.where(x > 0, x / r, x * r), x)
    return (x - np.float32(p.frequency_penalty) * counts.astype(np.float32)
            - np.float32(p.presence_penalty) * seen.astype(np.float32)).astype(np.float32)


def np_filter(x, p: SP):
    """Allowed mask and sampling probabilities (float64) for one processed row."""
    z = np.asarray(x, np.float32) * np.float32(1.0 / np.float32(p.temperature))
    z64 = z.astype(np.float64)
    keep = np.isfinite(z64)
    V = len(z)
    if p.top_k > 0:
        kth = np.sort(z64)[::-1][min(p.top_k, V) - 1]
        keep &= z64 >= kth
    if p.top_p < 1:
        zs = np.sort(z64[keep])[::-1]
        pr = np.exp(zs - zs[0])
        cum = np.cumsum(pr / pr.sum())
        idx = min(int(np.searchsorted(cum, p.top_p)), len(zs) - 1)
        keep &= z64 >= zs[idx]
    if p.min_p > 0:
        keep &= z64 >= z64.max() + np.log(p.min_p)
    pr = np.where(keep, np.exp(z64 - z64[keep].max()), 0.0)
    return keep, pr / pr.sum()


def chi2_ok(tokens, probs):
    counts = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    assert counts[probs == 0].sum() == 0, "drew a filtered-out token"
    e = probs * len(tokens)
    big = e >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(e[big], e[~big].sum())
    m = exp > 0
    stat = ((obs[m] - exp[m]) ** 2 / exp[m]).sum()
    df = max(int(m.sum()) - 1, 1)
    # ~1e-5 tail for these df; the seeds are fixed, so this is deterministic anyway
    assert stat < df + 6 * np.sqrt(2 * df) + 5, (stat, df)


RNG = np.random.default_rng(1234)
S, V = 8, 64
LOGITS = (RNG.standard_normal((S, V)) * 2).astype(np.float32)


# ----------------------------------------------------------------------------- host half

def test_tensors_fixed_shapes_and_padding():
    a = build_sampling_tensors([], 4, [])
    b = build_sampling_tensors([SP(temperature=0.7, top_k=3, top_p=0.5, min_p=0.1, logit_bias={5: 2.0},
                                   min_tokens=2, stop_token_ids=[9])], 4, [2 ** 40 + 7],
                               output_lens=[0], eos_token_ids=[1, 9])
    assert set(a) == set(SAMPLING_TENSOR_KEYS) == set(b)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
    assert a["bias_ids"].shape == (4, 64) and a["eos_ids"].shape == (4, 8)
    assert a["seed"].dtype == np.uint32 and a["top_k"].dtype == np.int32 and a["suppress_eos"].dtype == bool
    # padding rows are neutral greedy rows
    assert (a["temperature"] == 0).all() and (a["top_p"] == 1).all() and (a["repetition"] == 1).all()
    assert (a["bias_ids"] == -1).all() and not a["suppress_eos"].any()
    assert b["seed"][0] == seed_to_u32(2 ** 40 + 7) != seed_to_u32(7)
    assert list(b["eos_ids"][0, :3]) == [9, 1, -1] and b["suppress_eos"][0] and b["min_tokens_left"][0] == 2
    assert b["bias_ids"][0, 0] == 5 and b["bias_vals"][0, 0] == 2.0
    assert b["temperature"][1:].max() == 0
    # tiny temperatures are greedy; min_tokens reached: nothing suppressed; ignore_eos keeps only stop ids
    c = build_sampling_tensors([SP(temperature=1e-7), SP(min_tokens=2), SP(min_tokens=5, ignore_eos=True,
                                                                        stop_token_ids=[3])],
                               3, [0, 0, 0], output_lens=[0, 2, 1], eos_token_ids=[1])
    assert c["temperature"][0] == 0 and not c["suppress_eos"][1] and c["min_tokens_left"][2] == 4
    assert list(c["eos_ids"][2, :2]) == [3, -1]


def test_tensors_limits():
    with pytest.raises(ValueError):
        build_sampling_tensors([SP(logit_bias={i: 1.0 for i in range(65)})], 2, [0])
    build_sampling_tensors([SP(logit_bias={i: 1.0 for i in range(65)})], 2, [0], max_bias=65)
    with pytest.raises(ValueError):
        build_sampling_tensors([SP(min_tokens=1, stop_token_ids=list(range(8)))], 2, [0], eos_token_ids=[99])
    with pytest.raises(ValueError):
        build_sampling_tensors([SP()] * 3, 2, [0, 0, 0])


# ----------------------------------------------------------------------------- device half

def test_block_reductions_match_numpy():
    x = RNG.standard_normal((3, 1000)).astype(np.float32)  # 1000: padded, not a multiple of a block
    assert (np.asarray(block_argmax(jnp.asarray(x))) == x.argmax(-1)).all()
    vals, ids = block_top_k(jnp.asarray(x), 37)
    ref = np.argsort(-x, axis=-1, kind="stable")[:, :37]
    assert (np.asarray(ids) == ref).all()
    np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(x, ref, -1))


def test_greedy_is_argmax_and_logprobs_are_raw():
    ps = [SP(temperature=0.0, repetition_penalty=1.3, logit_bias={3: 5.0})] * 4 + [SP(temperature=0.0)] * 4
    counts = (RNG.random((S, V)) < 0.1).astype(np.int32) * 2
    out = run(LOGITS, ps, counts=counts)
    for i, p in enumerate(ps):
        assert out["tokens"][i] == np_process(LOGITS[i], p, counts[i], np.zeros(V, bool)).argmax()
    ref = np_log_softmax(LOGITS)
    np.testing.assert_allclose(out["logprob"], ref[np.arange(S), out["tokens"]], atol=1e-5)
    top = np.argsort(-LOGITS, axis=-1, kind="stable")[:, :NUM_TOP]
    assert (out["top_ids"] == top).all()
    np.testing.assert_allclose(out["top_logprobs"], np.take_along_axis(ref, top, -1), atol=1e-5)
    # greedy rows see the processed logits unfiltered
    np.testing.assert_array_equal(out["filtered"], out["processed"])


def test_top_k_1_is_argmax_at_any_temperature():
    for t in (0.3, 1.0, 5.0, 100.0):
        out = run(LOGITS, [SP(temperature=t, top_k=1)] * S, seeds=range(100, 100 + S))
        assert (out["tokens"] == LOGITS.argmax(-1)).all(), t


FILTER_CASES = [
    SP(temperature=1.0, top_k=5),
    SP(temperature=0.8, top_p=0.6),
    SP(temperature=1.5, min_p=0.2),
    SP(temperature=2.0, top_k=20, top_p=0.7),
    SP(temperature=0.7, top_k=30, top_p=0.9, min_p=0.05),
    SP(temperature=3.0, top_p=0.95),
    SP(temperature=1.0, top_k=100),  # top_k > V keeps everything
    SP(temperature=0.5, top_k=10, top_p=0.3),  # with 4 candidates: exact top-k, then a tiny nucleus
]


@pytest.mark.parametrize("num_candidates", [NUM_CANDIDATES, 4])
def test_filtered_sets_equal_numpy(num_candidates):
    # 4 candidates forces the exact bisection fallback for most cases; both must agree with numpy
    out = run(LOGITS, FILTER_CASES, num_candidates=num_candidates)
    for i, p in enumerate(FILTER_CASES):
        keep, _ = np_filter(LOGITS[i], p)
        got = np.isfinite(out["filtered"][i])
        assert (got == keep).all(), (p, np.flatnonzero(got != keep))
        z = LOGITS[i] * np.float32(1 / np.float32(p.temperature))
        np.testing.assert_allclose(out["filtered"][i][keep], z[keep], rtol=1e-6)


def test_sampled_tokens_stay_in_allowed_set_over_many_seeds():
    for p in FILTER_CASES[:6] + FILTER_CASES[7:]:
        keep, _ = np_filter(LOGITS[0], p)
        logits = np.repeat(LOGITS[:1], S, 0)
        for rep in range(25):
            out = run(logits, [p] * S, seeds=range(rep * S, rep * S + S), positions=np.full(S, rep))
            assert keep[out["tokens"]].all(), p


NS = 4096  # draws per distribution check: one call, one row per draw (distinct seeds)
VS = 48  # several blocks of the two-level draw
LOGITS_SMALL = (np.random.default_rng(7).standard_normal(VS) * 1.5).astype(np.float32)


# (params, num_candidates): rows whose kept set lies inside the candidates draw among them; the
# others (no top-k/top-p, or 4 candidates forcing the exact fallback) use the two-level dense draw
@pytest.mark.parametrize("p,nc", [
    (SP(temperature=1.0), NUM_CANDIDATES),
    (SP(temperature=0.6), NUM_CANDIDATES),
    (SP(temperature=1.0, top_k=4), NUM_CANDIDATES),
    (SP(temperature=1.2, top_p=0.8), NUM_CANDIDATES),
    (SP(temperature=1.2, top_p=0.8), 4),
    (SP(temperature=1.0, top_k=12), 4),
    (SP(temperature=1.0, min_p=0.15), NUM_CANDIDATES),
    (SP(temperature=1.4, top_k=8, top_p=0.9, min_p=0.05), NUM_CANDIDATES),
    (SP(temperature=0.9, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3,
        logit_bias={0: 1.5}), NUM_CANDIDATES),
], ids=lambda v: f"C{v}" if isinstance(v, int) else
   f"T{v.temperature}-k{v.top_k}-p{v.top_p}-m{v.min_p}-pen{v.presence_penalty}")
def test_empirical_distribution_matches_numpy(p, nc):
    logits = np.repeat(LOGITS_SMALL[None], NS, 0)
    counts = np.zeros((NS, VS), np.int32)
    counts[:, [1, 2, 5]] = [1, 3, 2]
    pm = np.zeros((NS, VS), bool)
    pm[:, 7] = True
    out = run(logits, [p] * NS, seeds=range(NS), counts=counts, prompt_mask=pm, num_top=0, num_candidates=nc)
    x = np_process(LOGITS_SMALL, p, counts[0], pm[0])
    np.testing.assert_allclose(out["processed"][0], x, rtol=1e-6)
    _, probs = np_filter(x, p)
    chi2_ok(out["tokens"], probs)


def test_penalties_match_numpy_and_flip_greedy():
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 3, (S, V)).astype(np.int32) * (rng.random((S, V)) < 0.3)
    pm = rng.random((S, V)) < 0.2
    ps = [SP(temperature=float(rng.choice([0.0, 0.8])), repetition_penalty=float(rng.uniform(0.5, 2.0)),
             frequency_penalty=float(rng.uniform(-2, 2)), presence_penalty=float(rng.uniform(-2, 2)),
             logit_bias={int(rng.integers(V)): float(rng.uniform(-100, 100))}) for _ in range(S)]
    out = run(LOGITS, ps, counts=counts, prompt_mask=pm)
    for i, p in enumerate(ps):
        np.testing.assert_allclose(out["processed"][i], np_process(LOGITS[i], p, counts[i], pm[i]), rtol=1e-6,
                                   atol=1e-5)

    # greedy flips: token 0 leads token 1 by 0.5
    base = np.zeros((S, V), np.float32)
    base[:, 0], base[:, 1] = 2.0, 1.5
    c = np.zeros((S, V), np.int32)
    c[:, 0] = 1
    cases = [
        (SP(temperature=0, frequency_penalty=0.6), c, None, 1),  # 2 - 0.6 < 1.5
        (SP(temperature=0, frequency_penalty=0.4), c, None, 0),
        (SP(temperature=0, presence_penalty=0.6), c, None, 1),
        (SP(temperature=0, repetition_penalty=1.5), c, None, 1),  # 2 / 1.5 < 1.5
        (SP(temperature=0, repetition_penalty=1.2), c, None, 0),
        (SP(temperature=0, repetition_penalty=1.5), None, "prompt", 1),  # prompt tokens count too
        (SP(temperature=0, frequency_penalty=2.0), None, "prompt", 0),  # frequency: outputs only
        (SP(temperature=0), c, None, 0),
    ]
    pm0 = np.zeros((S, V), bool)
    pm0[:, 0] = True
    out = run(base, [p for p, *_ in cases],
              counts=np.where(np.array([cc is not None for _, cc, _, _ in cases])[:, None], c, 0),
              prompt_mask=np.where(np.array([m == "prompt" for _, _, m, _ in cases])[:, None], pm0, False))
    assert list(out["tokens"]) == [want for *_, want in cases]
    # repetition on a negative logit multiplies it: -1 * 2 = -2
    neg = np.full((S, V), -3.0, np.float32)
    neg[:, 4], neg[:, 5] = -1.0, -1.5
    cc = np.zeros((S, V), np.int32)
    cc[:, 4] = 1
    out = run(neg, [SP(temperature=0, repetition_penalty=2.0)] * S, counts=cc)
    assert (out["tokens"] == 5).all() and np.allclose(out["processed"][:, 4], -2.0)


def test_logit_bias_bans_and_forces():
    top = int(LOGITS[0].argmax())
    logits = np.repeat(LOGITS[:1], S, 0)
    for rep in range(10):
        seeds = range(rep * S, rep * S + S)
        ban = {top: -100.0}
        out = run(logits, [SP(temperature=0.0, logit_bias=ban)] + [SP(temperature=1.5, logit_bias=ban)] * 7,
                  seeds=seeds)
        assert (out["tokens"] != top).all()
        fb = {17: 100.0}
        force = run(logits, [SP(temperature=0.0, logit_bias=fb)] + [SP(temperature=1.5, top_p=0.9, logit_bias=fb)] * 7,
                    seeds=seeds)
        assert (force["tokens"] == 17).all()
        # logprobs stay those of the raw logits
        np.testing.assert_allclose(force["logprob"], np_log_softmax(LOGITS[0])[17], atol=1e-5)


def random_params(rng, n):
    ps = []
    for _ in range(n):
        ps.append(SP(
            temperature=float(rng.choice([0.0, 0.5, 1.0, 2.0])),
            top_k=int(rng.choice([0, 1, 5, 40])),
            top_p=float(rng.choice([1.0, 0.9, 0.5])),
            min_p=float(rng.choice([0.0, 0.1])),
            presence_penalty=float(rng.choice([0.0, 0.5])),
            frequency_penalty=float(rng.choice([0.0, -0.3])),
            repetition_penalty=float(rng.choice([1.0, 1.2])),
            logit_bias={int(rng.integers(V)): float(rng.uniform(-5, 5))} if rng.random() < 0.5 else {},
            min_tokens=int(rng.choice([0, 2])),
        ))
    return ps


def test_rows_are_independent_of_batch():
    rng = np.random.default_rng(11)
    for trial in range(4):
        ps = random_params(rng, S)
        logits = (rng.standard_normal((S, V)) * 2).astype(np.float32)
        counts = (rng.integers(0, 3, (S, V)) * (rng.random((S, V)) < 0.2)).astype(np.int32)
        pm = rng.random((S, V)) < 0.1
        seeds = rng.integers(0, 2 ** 63, S).tolist()
        pos = rng.integers(0, 4096, S)
        lens = rng.integers(0, 3, S).tolist()
        full = run(logits, ps, seeds, pos, counts, pm, output_lens=lens, eos=[2])
        perm = rng.permutation(S)
        shuf = run(logits[perm], [ps[j] for j in perm], [seeds[j] for j in perm], pos[perm], counts[perm], pm[perm],
                   output_lens=[lens[j] for j in perm], eos=[2])
        for i in range(S):
            one = run(logits[i:i + 1], [ps[i]], [seeds[i]], pos[i:i + 1], counts[i:i + 1], pm[i:i + 1],
                      output_lens=[lens[i]], eos=[2])
            j = int(np.flatnonzero(perm == i)[0])
            assert full["tokens"][i] == one["tokens"][0] == shuf["tokens"][j], (trial, i, ps[i])
            np.testing.assert_allclose(full["logprob"][i], one["logprob"][0], atol=1e-6)


def test_seed_and_position_determine_noise():
    flat = np.zeros((S, V), np.float32)  # uniform: the token is pure noise
    p = [SP(temperature=1.0)] * S
    a = run(flat, p, seeds=[5] * S, positions=np.arange(S))
    b = run(flat, p, seeds=[5] * S, positions=np.arange(S))
    assert (a["tokens"] == b["tokens"]).all()
    assert len(set(a["tokens"].tolist())) >= S // 2  # different positions, different draws
    c = run(flat, p, seeds=range(S), positions=np.zeros(S))
    assert len(set(c["tokens"].tolist())) >= S // 2  # different seeds, different draws
    d = run(flat, p, seeds=[5] * S, positions=np.full(S, 3))
    assert (d["tokens"] == a["tokens"][3]).all()  # same seed + position: same token on every row
    # a 64-bit seed is not truncated to its low 32 bits
    e = run(flat, p, seeds=[5 + (1 << 40)] * S, positions=np.arange(S))
    assert (e["tokens"] != a["tokens"]).any()


def test_suppress_eos_until_min_tokens():
    logits = np.repeat(LOGITS[:1], S, 0).copy()
    eos, stop = 7, 9
    logits[:, eos] = 20.0
    logits[:, stop] = 19.0
    ps = [SP(temperature=0.0, min_tokens=3, stop_token_ids=[stop]),
          SP(temperature=1.0, min_tokens=3, stop_token_ids=[stop]),
          SP(temperature=0.0, min_tokens=3), SP(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[stop]),
          SP(temperature=0.0, min_tokens=3, logit_bias={eos: 100}), SP(temperature=0.0, min_tokens=1),
          SP(temperature=0.0), SP(temperature=0.0, min_tokens=3, stop_token_ids=[stop])]
    lens = [0, 1, 2, 0, 0, 1, 0, 3]
    for rep in range(5):
        out = run(logits, ps, seeds=range(rep * S, rep * S + S), output_lens=lens, eos=[eos])
        t = out["tokens"]
        assert t[0] not in (eos, stop) and t[1] not in (eos, stop)
        assert t[2] == stop  # only EOS suppressed (stop ids are not set)
        assert t[3] == eos  # ignore_eos: EOS is not a stop token, but the stop id is suppressed
        assert t[4] != eos  # suppression beats a +100 bias
        assert t[5] == eos and t[6] == eos and t[7] == eos  # min_tokens reached


def test_compiled_once_runs_any_parameters_without_recompiling():
    from jax import monitoring

    Sx, Vx = 4, 48
    rng = np.random.default_rng(5)
    def step(*a, num_top):  # own function: jit caches are shared between wrappers of one function
        return sample(*a, num_top)

    f = jax.jit(step, static_argnames=("num_top",))

    def args(ps, seeds):
        st = build_sampling_tensors(ps, Sx, seeds, output_lens=[0] * len(ps), eos_token_ids=[1])
        return (jnp.asarray(rng.standard_normal((Sx, Vx)).astype(np.float32)),
                {k: jnp.asarray(v) for k, v in st.items()}, jnp.asarray(rng.integers(0, 99, Sx).astype(np.int32)),
                jnp.asarray(rng.integers(0, 2, (Sx, Vx)).astype(np.int32)), jnp.asarray(rng.random((Sx, Vx)) < 0.1))

    variants = [
        ([SP(temperature=0.0)] * Sx, [0] * Sx),
        ([SP(temperature=1.0, top_p=0.5)] * 2, [1, 2]),
        ([SP(temperature=0.7, top_k=3, min_p=0.1, repetition_penalty=1.3, logit_bias={4: 3.0}, min_tokens=2)], [3]),
        ([SP(temperature=2.0, top_k=300)] * Sx, [9, 8, 7, 6]),
        ([SP(temperature=1.0, presence_penalty=1.0, frequency_penalty=-1.0)] * 3, [1 << 50, 2, 3]),
    ]
    compiled = f.lower(*args(*variants[0]), num_top=3).compile()
    f(*args(*variants[0]), num_top=3)  # the jitted function's own cache entry
    events = []
    listener = lambda name, *a, **k: events.append(name)  # noqa: E731
    monitoring.register_event_duration_secs_listener(listener)
    try:
        for ps, seeds in variants:
            a = args(ps, seeds)
            r1 = compiled(*a)
            r2 = f(*a, num_top=3)
            assert (np.asarray(r1["tokens"]) == np.asarray(r2["tokens"])).all()
            assert r1["top_ids"].shape == (Sx, 3)
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert not [e for e in events if "compile" in e], events
    assert f._cache_size() == 1


def test_full_gemma_vocabulary_smoke():
    Vg = 262144
    rng = np.random.default_rng(9)
    logits = (rng.standard_normal((2, Vg)) * 3).astype(np.float32)
    logits[1] *= 0.5  # flat: the 0.9 nucleus has tens of thousands of tokens (exact fallback)
    ps = [SP(temperature=0.0), SP(temperature=1.0, top_p=0.9, top_k=0)]
    out = run(logits, ps, seeds=[1, 2], num_top=4, processed=False)
    assert out["tokens"][0] == logits[0].argmax()
    keep, _ = np_filter(logits[1], ps[1])
    assert keep[out["tokens"][1]] and 1000 < keep.sum() < Vg
    ref = np_log_softmax(logits)
    np.testing.assert_allclose(out["logprob"], ref[[0, 1], out["tokens"]], atol=1e-4)
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :4]
    assert (out["top_ids"] == top).all()


def test_logprobs_off_keeps_tokens():
    ps = [SP(temperature=0.0), SP(temperature=1.0, top_p=0.8)] * 4
    a = run(LOGITS, ps, num_top=0, processed=False)
    st = {k: jnp.asarray(v) for k, v in build_sampling_tensors(ps, S, list(range(S))).items()}
    b = jax.jit(sample, static_argnames=("num_top", "logprobs"))(
        jnp.asarray(LOGITS), st, jnp.zeros(S, jnp.int32), jnp.zeros((S, V), jnp.int32), jnp.zeros((S, V), bool),
        num_top=0, logprobs=False)
    assert (np.asarray(b["tokens"]) == a["tokens"]).all() and not np.asarray(b["logprob"]).any()
