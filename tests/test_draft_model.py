"""Speculative decoding with a draft model (engine/draft_model.py) on the real SmolLM2: whatever the draft
model proposes, greedy and seeded sampled requests give the tokens they give without speculation; the
SmolLM2 drafting for itself has its greedy drafts all accepted (several tokens per step), a tiny random
draft model with SmolLM2's vocabulary has them refused; nothing compiles while serving; a draft model of
another vocabulary, a missing one and a bad config are clear errors."""

import functools

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import ConfigError, EngineConfig, speculative_fields
from model_files import readers, smollm2_gguf, tiny_qwen3_causal

_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **k: _compiles.append(name) if "backend_compile" in name else None)

KW = dict(max_model_len=512, max_num_seqs=4, prefill_chunk_size=64, seq_buckets=(4,), token_buckets=(64,))
COUNT = "one two three four five six seven eight nine ten, one two three four five six seven eight nine ten, one"
STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=30, seed=11, max_tokens=32, ignore_eos=True)
# a long prompt: the draft model reads it in several chunks of the 64-token step budget before its first draft
LONG = " ".join(f"item {i}: the value is {i * 7 % 13}." for i in range(40)) + " item 40: the value is"


@functools.lru_cache(maxsize=None)
def tiny_draft():
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer: drafts right only by chance."""
    import tempfile
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxserve.loader.tokenizer import Tokenizer

    d = Path(tempfile.mkdtemp(prefix="jaxserve-tiny-draft-"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                 tie_word_embeddings=True)).save_pretrained(d, safe_serialization=True)
    Tokenizer.from_gguf(readers("smollm2")).save(d)
    return str(d)


@functools.lru_cache(maxsize=None)
def plain():
    return LLM(str(smollm2_gguf()), **KW)


def _outs(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_config():
    assert speculative_fields({"model": "d", "num_speculative_tokens": 3}) == \
        {"num_speculative_tokens": 3, "speculative_model": "d"}
    assert speculative_fields({"method": "draft_model", "model": "d", "num_speculative_tokens": 2,
                               "disable_by_batch_size": 4}) == \
        {"num_speculative_tokens": 2, "speculative_model": "d", "speculative_disable_by_batch_size": 4}
    for bad, match in (({"method": "draft_model", "num_speculative_tokens": 3}, "needs \"model\""),
                       ({"method": "ngram", "model": "d", "num_speculative_tokens": 3}, "draft_model method"),
                       ({"model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 3}, "ngram method"),
                       ({"model": 3, "num_speculative_tokens": 3}, "needs \"model\""),
                       ({"model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}, "unknown key")):
        with pytest.raises(ConfigError, match=match):
            speculative_fields(bad)
    with pytest.raises(ConfigError, match="needs num_speculative_tokens"):
        EngineConfig(speculative_model="d")


def test_self_draft_accepted_and_exact():
    """SmolLM2 drafting for itself: its greedy drafts are the target's greedy tokens, so nearly all are kept
    and a 40-token reply takes a fraction of the steps; sampled requests keep what the draws agree with."""
    g = str(smollm2_gguf())
    want = _outs(plain(), [COUNT, STORY, LONG], GREEDY)
    want_s = _outs(plain(), [COUNT, STORY], SAMPLED)
    spec = LLM(g, speculative_config={"model": g, "num_speculative_tokens": 3}, **KW)
    n = len(_compiles)
    st0 = spec.engine.stats()
    got = _outs(spec, [COUNT, STORY, LONG], GREEDY)
    st = spec.engine.stats()
    assert got == want
    drafted, kept = st["spec_draft_tokens"] - st0["spec_draft_tokens"], st["spec_accepted_tokens"] - st0["spec_accepted_tokens"]
    assert drafted >= 60 and kept >= 0.9 * drafted, st
    assert st["num_steps"] - st0["num_steps"] <= 25, st  # 120 tokens; ~4 per drafted step
    assert _outs(spec, [COUNT, STORY], SAMPLED) == want_s
    st2 = spec.engine.stats()
    assert st2["spec_accepted_tokens"] > st["spec_accepted_tokens"], st2  # some sampled picks agree
    assert len(_compiles) == n, "compiled while serving"


def test_random_draft_refused_and_exact():
    """A random draft model is nearly always wrong: the output is still the target's own, greedy and sampled,
    streamed one request at a time or batched."""
    spec = LLM(str(smollm2_gguf()), speculative_config={"model": tiny_draft(), "num_speculative_tokens": 4}, **KW)
    base = plain()  # built (and warmed up) before the count: this test may run first in its process
    n = len(_compiles)
    assert _outs(spec, [COUNT, STORY, LONG], GREEDY) == _outs(base, [COUNT, STORY, LONG], GREEDY)
    assert _outs(spec, [STORY], SAMPLED) == _outs(base, [STORY], SAMPLED)
    st = spec.engine.stats()
    assert st["spec_draft_tokens"] >= 8 and st["spec_accepted_tokens"] < st["spec_draft_tokens"] / 2, st
    assert len(_compiles) == n, "compiled while serving"


def test_draft_model_errors(tmp_path):
    g = str(smollm2_gguf())
    with pytest.raises(ValueError, match="another vocabulary"):
        LLM(g, speculative_config={"model": str(tiny_qwen3_causal()), "num_speculative_tokens": 2}, **KW)
    with pytest.raises(Exception, match="nope"):
        LLM(g, speculative_config={"model": str(tmp_path / "nope"), "num_speculative_tokens": 2}, **KW)
    with pytest.raises(ValueError, match="single device"):
        LLM(g, speculative_config={"model": g, "num_speculative_tokens": 2}, tensor_parallel_size=2, **KW)
