"""The runner's two layer layouts (scan over stacked layers: CPU default; unrolled per-layer arrays:
GPU default) compute the same thing, through the whole engine (decode loop, mixed steps, sampler)."""

import numpy as np
import pytest

from hf_tiny import make_tiny_model
from jaxserve import LLM, SamplingParams
from tiny_tokenizer import add_byte_tokenizer


def test_scan_and_unrolled_layouts_agree(tmp_path):
    d = add_byte_tokenizer(make_tiny_model("gemma3", tmp_path))
    prompts = [[5 + i for i in range(30)], [200, 100, 50, 25, 12], [9] * 11]
    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    res = {}
    for scan in (True, False):
        llm = LLM(str(d), max_model_len=64, max_num_seqs=2, prefill_chunk_size=16, block_size=4,
                  scan_layers=scan)
        assert isinstance(llm.engine.runner.weights["layers"], dict if scan else list)
        outs = llm.generate(prompts, p)
        sampled = llm.generate(prompts[0], SamplingParams(temperature=1.0, seed=3, max_tokens=10))
        res[scan] = ([o.outputs[0].token_ids for o in outs],
                     [[lp for lp, _ in o.outputs[0].logprobs] for o in outs],
                     sampled[0].outputs[0].token_ids)
    assert res[True][0] == res[False][0]
    np.testing.assert_allclose(res[True][1], res[False][1], atol=1e-5)
    assert res[True][2] == res[False][2]


@pytest.mark.parametrize("kmajor", [None, True])
def test_stored_programs_skip_tracing(tmp_path, monkeypatch, kmajor):
    """A second start with the same cache directory loads every program from the program store without
    tracing, and generates the same tokens; another engine config misses and compiles. kmajor: weights
    that are KMajor pytree nodes (the GPU default) store and load alike."""
    import jax

    from jaxserve.engine.runner import ModelRunner

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path / "m"))
    kw = dict(max_model_len=32, max_num_seqs=2, prefill_chunk_size=16, block_size=4, num_blocks=24,
              compile_cache_dir=str(tmp_path / "cache"), kmajor_weights=kmajor)
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompt = [[7, 8, 9, 10, 11]]
    first = LLM(str(d), **kw)
    if kmajor:
        from jaxserve.models.kmajor import KMajor

        assert any(isinstance(v, KMajor) for v in jax.tree.leaves(first.engine.runner.weights,
                                                                  is_leaf=lambda v: isinstance(v, KMajor)))
    want = first.generate(prompt, p)[0].outputs[0]
    stored = list((tmp_path / "cache" / "jaxserve-programs").glob("*.jaxprog"))
    assert len(stored) == first.engine.runner.num_compiled > 0

    traced = []
    real_fn = ModelRunner._fn
    monkeypatch.setattr(ModelRunner, "_fn", lambda self, key: traced.append(key) or real_fn(self, key))
    second = LLM(str(d), **kw)
    got = second.generate(prompt, p)[0].outputs[0]
    assert traced == []
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose([lp for lp, _ in got.logprobs], [lp for lp, _ in want.logprobs], atol=1e-6)

    LLM(str(d), **dict(kw, max_num_seqs=3))  # another shape set: nothing stored fits
    assert traced

    # Programs that JAX's own cache supplies are not stored (re-serialized they can lack functions on
    # CPU); the start still works, and so does the next one. (The penalty-seeding program compiles
    # faster than JAX's cache threshold, so JAX never supplies it: it is stored each time.)
    for f in (tmp_path / "cache" / "jaxserve-programs").glob("*.jaxprog"):
        f.unlink()
    jax.clear_caches()  # else jit's in-memory cache hands back the first engine's (fresh) executables
    third = LLM(str(d), **kw)
    assert [f.name.split("-")[0] for f in (tmp_path / "cache" / "jaxserve-programs").glob("*.jaxprog")] == ["seed"]
    assert third.generate(prompt, p)[0].outputs[0].token_ids == want.token_ids


def test_program_options_per_kind_reach_xla_and_bad_tables_are_errors(tmp_path, monkeypatch):
    """JAXSERVE_PROGRAM_XLA_OPTIONS: each program is compiled with its kind's XLA options (here: mixed
    programs without GEMM autotuning, decode programs plain), the engine's tokens do not change, and a
    table naming an unknown kind or a non-XLA option is refused."""
    from jaxserve.engine import program_store
    from jaxserve.engine.runner import program_options_table

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    # no program store (it would hand back programs without compiling), a cache of its own
    kw = dict(max_model_len=32, max_num_seqs=2, prefill_chunk_size=16, block_size=4, num_blocks=24,
              program_store=False, compile_cache_dir=str(tmp_path / "cache"))
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = LLM(str(d), **kw).generate([[7, 8, 9, 10, 11]], p)[0].outputs[0].token_ids

    seen = []
    real = program_store.compile_noting_cache_hit
    monkeypatch.setattr(program_store, "compile_noting_cache_hit",
                        lambda lowered, opts=None: seen.append(opts) or real(lowered, opts))
    monkeypatch.setenv("JAXSERVE_PROGRAM_XLA_OPTIONS", '{"mixed": {"xla_gpu_autotune_level": 0}}')
    llm = LLM(str(d), **kw)
    keys = llm.engine.runner.program_keys()
    assert llm.generate([[7, 8, 9, 10, 11]], p)[0].outputs[0].token_ids == want
    assert sorted(map(str, seen)) == sorted(
        str({"xla_gpu_autotune_level": 0} if k[0] == "mixed" else None) for k in keys)

    for bad in ('{"prefill": null}', '{"mixed": {"autotune": 0}}', '[1]'):
        with pytest.raises(ValueError, match="JAXSERVE_PROGRAM_XLA_OPTIONS"):
            program_options_table("gpu", {"JAXSERVE_PROGRAM_XLA_OPTIONS": bad})
    assert program_options_table("cpu", {}) == {}


def test_kv_sizing_probe_has_one_layer_of_each_kind_and_the_same_temporaries():
    """The KV-cache sizing probe (llm_engine.probe_model): the first layer of each kind, sliced from
    stacked or picked from per-layer weights; its largest step reports the same temporaries as the
    whole model's (the assumption that lets the probe compile one layer instead of all)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxserve.config import EngineConfig, ModelConfig
    from jaxserve.engine.llm_engine import probe_model
    from jaxserve.engine.runner import ModelRunner
    from jaxserve.loader.materialize import random_weights
    from jaxserve.models import transformer as tf

    cfg = ModelConfig(arch="gemma3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=6,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, sliding_window=8,
                      layer_types=("sliding",) * 5 + ("full",))
    w = random_weights(cfg, jnp.float32, jax.random.PRNGKey(0), 0.2)
    pcfg, pw = probe_model(cfg, w)
    assert pcfg.num_layers == 2 and pcfg.layer_types == ("sliding", "full")
    np.testing.assert_array_equal(np.asarray(pw["layers"]["down"][1]), np.asarray(w["layers"]["down"][5]))
    listed = tf.unstack_layers(random_weights(cfg, jnp.float32, jax.random.PRNGKey(0), 0.2))
    picked = probe_model(cfg, listed)[1]["layers"][1]
    assert picked["down"] is not listed["layers"][5]["down"]  # a copy: the probe runner frees what it fuses
    np.testing.assert_array_equal(np.asarray(picked["down"]), np.asarray(listed["layers"][5]["down"]))
    llama = dataclasses.replace(cfg, layer_types=("full",) * 6)
    assert probe_model(llama, w)[0].num_layers == 1
    from jaxserve.quant import isq

    head = jax.device_put(isq.quantize(np.asarray(w["embed"]).T.copy(), "q8_0"))  # a packed LM head
    ph = probe_model(llama, dict(w, lm_head=head))[1]["lm_head"]
    assert ph is not head and ph.arrays["q0"] is not head.arrays["q0"]  # a copy the probe may free
    np.testing.assert_array_equal(np.asarray(ph.arrays["q0"]), np.asarray(head.arrays["q0"]))
    ecfg = EngineConfig(max_model_len=256, max_num_seqs=4, prefill_chunk_size=128, dtype="float32",
                        scan_layers=False, program_store=False)
    from jaxserve.engine.llm_engine import PROBE_COMPILER_OPTIONS, PROBE_MARGIN

    temps = []
    for c, ws, opts in ((cfg, w, None), (pcfg, pw, PROBE_COMPILER_OPTIONS)):  # the probe as the engine compiles it
        r = ModelRunner(c, ecfg, ws, 2)
        r.compile(("mixed", max(ecfg.token_buckets)), compiler_options=opts)
        temps.append(r.max_temp_bytes())
    # the engine reserves PROBE_MARGIN x the probe's: at least what the whole model needs
    assert 0 < temps[1] <= temps[0] <= PROBE_MARGIN * temps[1], temps
    key = ("mixed", max(ecfg.token_buckets))  # a program built with options is never served as the plain one
    assert r.compile(key) is not r.compile(key, compiler_options=PROBE_COMPILER_OPTIONS)


def test_prompt_logprobs_in_row_chunks_are_the_same_and_need_less_memory(tmp_path, monkeypatch):
    """A mixed step computes prompt log-probs PLP_CHUNK rows at a time (the [rows, vocab] logits of a
    whole large step were most of the temporaries the KV sizing reserved): the same log-probs and top
    ids as one pass over every row, and a smaller peak."""
    from jaxserve.engine import step as step_mod

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path, vocab_size=8192))  # logits dominate the peak
    prompt = [[(7 * i) % 250 + 3 for i in range(100)]]
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    res, temps = {}, {}
    for chunk in (4096, 16):  # 4096: one pass; 16: the 130-row step (128 tokens + 2 decode rows) in 9 chunks
        monkeypatch.setattr(step_mod, "PLP_CHUNK", chunk)
        llm = LLM(str(d), max_model_len=256, max_num_seqs=2, prefill_chunk_size=128, block_size=4,
                  scan_layers=False, program_store=False)
        out = llm.generate(prompt, p)[0]
        res[chunk] = out.prompt_logprobs[1:]
        temps[chunk] = llm.engine.runner.max_temp_bytes()
    assert len(res[16]) == len(res[4096]) == 99
    for (lp_a, top_a), (lp_b, top_b) in zip(res[4096], res[16]):
        assert lp_a == pytest.approx(lp_b, abs=1e-5)
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
    assert temps[16] < temps[4096], temps


def test_program_store_key_follows_kernel_settings(tmp_path, monkeypatch):
    """Kernel settings changed at run time (benchmarks' K-split targets, tile tables, split-sum flags)
    change the store's fingerprint, so a program traced under other settings is never loaded; the same
    settings give the same fingerprint."""
    from jaxserve.engine.program_store import ProgramStore
    from jaxserve.kernels.quant_matmul import pallas_dp4a, pallas_fp8

    def fp():
        return ProgramStore(tmp_path, "ctx").fingerprint

    base = fp()
    assert fp() == base
    monkeypatch.setattr(pallas_dp4a, "PER_SM", 6)
    per_sm = fp()
    assert per_sm != base
    monkeypatch.setitem(pallas_fp8.GEMV, "block_n", 64)
    assert fp() not in (base, per_sm)
    monkeypatch.undo()
    assert fp() == base
    monkeypatch.setattr(pallas_dp4a.engine_qmatmul, "takes_split_out", False)
    assert fp() != base
