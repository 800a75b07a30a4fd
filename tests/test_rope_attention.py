"""Shared test base of the fused RoPE + K/V write + decode attention: every implementation against
the oracle (rope_kv's reference, then paged attention's); the Pallas kernel runs in the interpreter on
CPU and compiled on the GPU (bench/gpu_suite.sh tests-attn)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import rope_attention
from jaxserve.kernels.rope_attention import reference
from jaxserve.kernels.split_sum import SplitSum

ON_CPU = jax.devices()[0].platform == "cpu"


def _case(rng, lens, *, H, KV, D, dtype, BS=4, L=2, parts=0, cache_dtype=None):
    """One decode token per sequence at position lens[i] - 1; caches hold random earlier keys (and
    random stale values in the token's own slot, which the step overwrites)."""
    S = len(lens)
    MB = max(-(-n // BS) for n in lens) + 1
    NB = S * MB + 2
    dt = jnp.dtype(dtype)
    cdt = jnp.dtype(cache_dtype or dtype)
    k_cache = jnp.asarray(rng.standard_normal((L, NB, BS, KV, D)), jnp.float32).astype(cdt)
    v_cache = jnp.asarray(rng.standard_normal((L, NB, BS, KV, D)), jnp.float32).astype(cdt)
    free = list(rng.permutation(np.arange(1, NB)))
    tables = np.zeros((S, MB), np.int32)
    for i, n in enumerate(lens):
        for j in range(-(-n // BS)):
            tables[i, j] = free.pop()
    pos = np.asarray(lens, np.int32) - 1
    slots = tables[np.arange(S), pos // BS] * BS + pos % BS
    width = (H + 2 * KV) * D
    if parts:
        qkv = SplitSum(jnp.asarray(rng.standard_normal((parts, S, width)), jnp.float32), dt)
    else:
        qkv = jnp.asarray(rng.standard_normal((S, width)), dt)
    inv_freq = jnp.asarray(1.0 / (10000.0 ** (np.arange(0, D, 2) / D)), jnp.float32)
    return (qkv, jnp.asarray(pos), inv_freq, jnp.float32(1.1), k_cache, v_cache, jnp.int32(1),
            jnp.asarray(slots, jnp.int32), jnp.asarray(tables), jnp.arange(S, dtype=jnp.int32))


def _norms(rng, D):
    """Qwen3 / Gemma 3 per-head q/k RMSNorm weights (far from 1, so that a skipped or misplaced norm
    shows)."""
    return (jnp.asarray(rng.uniform(0.2, 3.0, D), jnp.float32), jnp.asarray(rng.uniform(0.2, 3.0, D), jnp.float32),
            1e-6)


def _check(impl, args, *, tol, **kw):
    want = reference.rope_decode_attention(*args, **kw)
    fn = rope_attention.get(impl)
    if impl == "pallas_triton":  # small splits so that several split plans occur at these lengths
        fn = functools.partial(fn, num_splits=3, block_k=16)
    got = jax.jit(lambda *a: fn(*a, **kw), donate_argnums=(4, 5))(
        *args[:4], jnp.array(args[4]), jnp.array(args[5]), *args[6:])
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        # A written fp8 cache may differ by one e4m3 step (2^-3 relative): XLA's GPU fusion rounds the
        # rotated k a hair differently next to a rounding boundary (5 of 22,528 values on an H100)
        rt = 0.13 if g.dtype.itemsize == 1 else tol
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=rt, atol=tol)


@pytest.mark.parametrize("impl", rope_attention.IMPLEMENTATIONS)
@pytest.mark.parametrize("H,KV,D", [(8, 2, 16), (6, 2, 32), (2, 2, 64)])
@pytest.mark.parametrize("window,softcap,qk_norm", [(0, None, False), (6, 30.0, False), (6, None, True)])
def test_matches_oracle(impl, H, KV, D, window, softcap, qk_norm):
    rng = np.random.default_rng(H * D + window)
    # contexts from the first token to several key tiles (block_k 16, 3 splits)
    args = _case(rng, [1, 2, 5, 16, 17, 40, 97], H=H, KV=KV, D=D, dtype="float32")
    norm = {"qk_norm": _norms(rng, D)} if qk_norm else {}
    _check(impl, args, tol=2e-5 if ON_CPU else 3e-3, num_heads=H, num_kv_heads=KV, head_dim=D,
           scale=D ** -0.5, window=window, softcap=softcap, **norm)


@pytest.mark.parametrize("impl", rope_attention.IMPLEMENTATIONS)
@pytest.mark.parametrize("parts,qk_norm", [(0, False), (3, False), (3, True)])
def test_bf16_and_split_sums(impl, parts, qk_norm):
    """bf16 caches, q/k/v given whole or as a SplitSum of f32 partials (the int8 matmul's output),
    with and without q/k norms (normed heads rounded to bf16 before RoPE, as the model does)."""
    rng = np.random.default_rng(parts)
    args = _case(rng, [3, 33, 64, 70], H=8, KV=2, D=32, dtype="bfloat16", parts=parts)
    norm = {"qk_norm": _norms(rng, 32)} if qk_norm else {}
    _check(impl, args, tol=3e-2, num_heads=8, num_kv_heads=2, head_dim=32, scale=32 ** -0.5, **norm)


@pytest.mark.parametrize("impl", rope_attention.IMPLEMENTATIONS)
def test_fp8_cache(impl):
    """An fp8 cache: the step's own k/v are attended to as the cache will hold them (rounded to e4m3)."""
    rng = np.random.default_rng(11)
    args = _case(rng, [2, 18, 50], H=8, KV=2, D=32, dtype="bfloat16", cache_dtype="float8_e4m3fn")
    _check(impl, args, tol=3e-2, num_heads=8, num_kv_heads=2, head_dim=32, scale=32 ** -0.5)


@pytest.mark.parametrize("impl", rope_attention.IMPLEMENTATIONS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_head_size_not_a_power_of_two(impl, qk_norm):
    """Such heads go through rope_kv + the decode kernel (their padding): the same function."""
    rng = np.random.default_rng(7)
    args = _case(rng, [1, 9, 30], H=4, KV=2, D=24, dtype="float32")
    norm = {"qk_norm": _norms(rng, 24)} if qk_norm else {}
    _check(impl, args, tol=2e-5 if ON_CPU else 3e-3, num_heads=4, num_kv_heads=2, head_dim=24,
           scale=24 ** -0.5, **norm)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_option_generates_the_same_tokens(tmp_path, monkeypatch, family):
    """EngineConfig.fused_decode_attention through the whole engine (the decode loop; Pallas attention
    and RoPE kernels interpreted on CPU): the same greedy tokens and logprobs as the two kernels it
    replaces, and the reference attention's (Qwen3: its q/k norms inside both fused kernels)."""
    from hf_tiny import make_tiny_model
    from tiny_tokenizer import add_byte_tokenizer

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.kernels.rope_attention import pallas_triton

    calls = []
    real = pallas_triton.rope_decode_attention
    monkeypatch.setattr(pallas_triton, "rope_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    d = add_byte_tokenizer(make_tiny_model(family, tmp_path))
    prompts = [[5 + i for i in range(13)], [200, 100, 50]]
    p = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2)
    res = []
    for attn, fused in (("reference", False), ("pallas_triton", False), ("pallas_triton", True)):
        ecfg = EngineConfig(max_model_len=32, max_num_seqs=2, prefill_chunk_size=16, block_size=4,
                            num_blocks=24, scan_layers=False, fused_rope_kv=attn != "reference",
                            fused_decode_attention=fused, decode_steps=4,
                            compile_cache_dir=str(tmp_path / f"cache-{attn}-{fused}"))
        eng = LLMEngine(str(d), engine_config=ecfg, attention=attn, warmup=False)
        assert (eng.runner.rope_attend is not None) == fused
        outs = LLM.from_engine(eng).generate(prompts, p, use_tqdm=False)
        res.append(([o.outputs[0].token_ids for o in outs], [[lp for lp, _ in o.outputs[0].logprobs] for o in outs]))
    assert calls  # traced (per layer) in the decode program of the fused engine only
    for r in res[1:]:
        assert r[0] == res[0][0]
        np.testing.assert_allclose(r[1], res[0][1], atol=1e-4)


def test_engine_option_errors():
    from jaxserve.config import EngineConfig, ModelConfig
    from jaxserve.engine.runner import ModelRunner
    from jaxserve.loader.materialize import random_weights

    cfg = ModelConfig(arch="llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0)
    w = random_weights(cfg, jnp.float32, jax.random.PRNGKey(0), 0.2)
    ecfg = EngineConfig(fused_decode_attention=True, max_model_len=32, num_blocks=8, block_size=4,
                        max_num_seqs=2, fused_rope_kv=True)
    with pytest.raises(ValueError, match="fused_decode_attention needs"):
        ModelRunner(cfg, ecfg, w, 8, attention="reference")


def test_fp8_kv_cache_engine(tmp_path):
    """--kv-cache-dtype fp8 through the CLI's config and the whole engine: on a GPU the cache is e4m3
    and greedy decoding follows the f32 cache's tokens on a tiny model; on CPU it is refused."""
    from hf_tiny import make_tiny_model
    from tiny_tokenizer import add_byte_tokenizer

    from jaxserve import LLM, SamplingParams
    from jaxserve.cli import build_parser, engine_config_from_args
    from jaxserve.config import ConfigError, EngineConfig

    args = build_parser().parse_args(["run", "--kv-cache-dtype", "fp8"])
    assert engine_config_from_args(args).kv_dtype == "float8_e4m3fn"
    assert EngineConfig(kv_dtype="auto").kv_dtype is None
    with pytest.raises(ConfigError, match="kv_dtype must be one of"):
        EngineConfig(kv_dtype="int4")
    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    kw = dict(max_model_len=32, max_num_seqs=2, prefill_chunk_size=16, block_size=4, num_blocks=24)
    if ON_CPU:  # XLA converts fp8 in software there: refused with a reason
        with pytest.raises(ValueError, match="fp8 K/V cache .* needs a GPU"):
            LLM(str(d), kv_dtype="fp8", **kw)
        return
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    res = []
    for kv in (None, "fp8"):
        llm = LLM(str(d), kv_dtype=kv, **kw)
        assert llm.engine.runner.state["k"].dtype == (jnp.float8_e4m3fn if kv else jnp.float32)
        res.append(llm.generate([[5 + i for i in range(13)], [200, 100, 50]], p, use_tqdm=False))
    for a, b in zip(*res):  # (a random tiny model has near-ties: later tokens may part)
        assert a.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4]
        lp_a = [lp for lp, _ in a.outputs[0].logprobs[:4]]
        lp_b = [lp for lp, _ in b.outputs[0].logprobs[:4]]
        np.testing.assert_allclose(lp_b, lp_a, atol=0.3)  # ~2 significant digits per K/V value
