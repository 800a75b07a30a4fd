"""The runner's two layer layouts (scan over stacked layers: CPU default; unrolled per-layer arrays:
GPU default) compute the same thing, through the whole engine (decode loop, mixed steps, sampler)."""

import numpy as np

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


def test_stored_programs_skip_tracing(tmp_path, monkeypatch):
    """A second start with the same cache directory loads every program from the program store without
    tracing, and generates the same tokens; another engine config misses and compiles."""
    import jax

    from jaxserve.engine.runner import ModelRunner

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path / "m"))
    kw = dict(max_model_len=32, max_num_seqs=2, prefill_chunk_size=16, block_size=4, num_blocks=24,
              compile_cache_dir=str(tmp_path / "cache"))
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompt = [[7, 8, 9, 10, 11]]
    first = LLM(str(d), **kw)
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
    # CPU); the start still works, and so does the next one.
    for f in (tmp_path / "cache" / "jaxserve-programs").glob("*.jaxprog"):
        f.unlink()
    jax.clear_caches()  # else jit's in-memory cache hands back the first engine's (fresh) executables
    third = LLM(str(d), **kw)
    assert not list((tmp_path / "cache" / "jaxserve-programs").glob("*.jaxprog"))
    assert third.generate(prompt, p)[0].outputs[0].token_ids == want.token_ids
