"""Speculative decoding by prompt lookup (engine/speculative.py): the proposer and the verification on
their own, then the real SmolLM2 through the engine — with drafts, greedy and seeded sampled requests
give exactly the tokens they give without (drafts accepted where the text repeats), so do requests with
penalties, logit bias and min_tokens (applied at each drafted row as a plain decode applies them), stop
strings cutting the text leave it unchanged, and nothing compiles while serving."""

import hashlib

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import ConfigError, EngineConfig, speculative_fields
from jaxserve.engine.speculative import eligible, propose
from jaxserve.engine.sequence import Sequence
from model_files import smollm2_gguf

_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **k: _compiles.append(name) if "backend_compile" in name else None)


def test_propose():
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 4, 4, 2) == [4, 5, 1, 2]  # the longest suffix n-gram first
    assert propose([1, 2, 7, 1, 2, 8, 9, 9, 9, 1, 2], 2, 4, 2) == [8, 9]  # the most recent occurrence
    assert propose([6, 6, 6, 6, 6, 6], 4, 4, 2) == [6, 6]  # none followed by k tokens: the longest run
    assert propose([1, 2, 3, 4, 5, 6, 7], 4, 4, 2) == []
    assert propose([5, 1, 9, 1], 3, 4, 2) == [] and propose([5, 1, 9, 1], 3, 4, 1) == [9, 1]  # n_min
    assert propose([1, 2, 1, 2], 0, 4, 2) == []


def test_eligible_and_config():
    seq = lambda **kw: Sequence(request_id="r", prompt_token_ids=[1, 2], params=SamplingParams(**kw))
    assert eligible(seq(temperature=0))
    assert eligible(seq(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=3))  # sampled: the same draw
    assert eligible(seq(temperature=0, logprobs=3))
    for kw in ({"temperature": 0.7, "frequency_penalty": 0.2}, {"temperature": 0, "repetition_penalty": 1.1},
               {"temperature": 0, "logit_bias": {3: 1.0}},
               {"temperature": 0, "min_tokens": 3}, {"temperature": 0, "presence_penalty": 0.5}):
        assert eligible(seq(**kw)), kw  # applied row by row by the verify
    constrained = seq(temperature=0)
    constrained.matcher = object()  # a grammar needs each token on the host
    assert not eligible(constrained)
    assert speculative_fields({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}) == \
        {"num_speculative_tokens": 3, "prompt_lookup_max": 5}
    for bad, match in (({"method": "eagle", "num_speculative_tokens": 3}, "not supported"),
                       ({"method": "ngram"}, "needs num_speculative_tokens"),
                       ({"num_speculative_tokens": 2, "eagle_head": "x"}, "unknown key"),
                       ({"num_speculative_tokens": "2"}, "integer")):
        with pytest.raises(ConfigError, match=match):
            speculative_fields(bad)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        EngineConfig(num_speculative_tokens=2, prompt_lookup_min=5, prompt_lookup_max=4)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=16)


KW = dict(max_model_len=512, max_num_seqs=4, prefill_chunk_size=64, seq_buckets=(4,), token_buckets=(64,))
COUNT = "one two three four five six seven eight nine ten, one two three four five six seven eight nine ten, one"
HA = "Laugh: ha ha ha ha ha ha ha ha ha ha ha ha ha ha"
QUOTE = "Copy this line: the quick brown fox jumps over the lazy dog. Again: the quick brown"


# top-k 20 keeps the draw among the sampler's candidates, top-p 0.8 makes it compute a nucleus, min-p too
SAMPLED = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, min_p=0.02, seed=7, max_tokens=32, ignore_eos=True)


def _run(llm):
    reqs = [(COUNT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
            (QUOTE, SamplingParams(temperature=0, max_tokens=24, stop=["dog"])),
            (COUNT, SAMPLED),
            (QUOTE, SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3))]
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def _same_logprobs(got, want):
    """Per token: the chosen token's logprob and the top-3 equal up to float rounding: a drafted token's
    logprobs come from its chunk's rows (the mixed program), not from a decode step's, so values differ by
    ~1e-3 here and two near-tied candidates (seen 4e-4 apart) could swap places."""
    assert len(got) == len(want)
    for (lp, top), (lp0, top0) in zip(got, want):
        assert abs(lp - lp0) < 5e-3 and top[0][0] == top0[0][0], (lp, lp0, top, top0)
        d, d0 = dict(top), dict(top0)
        assert len(d.keys() & d0.keys()) >= 2 and all(abs(d[t] - d0[t]) < 5e-3 for t in d.keys() & d0.keys()), \
            (top, top0)


def test_same_tokens_with_and_without_drafts():
    plain = LLM(str(smollm2_gguf()), **KW)
    spec = LLM(str(smollm2_gguf()), speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **KW)
    want = _run(plain)
    n = len(_compiles)
    got = _run(spec)
    assert len(_compiles) == n, "compiled while serving"
    assert got == want
    assert len(want[0][0]) == 40 and want[1][2] == "stop"  # the counting run went the distance
    st = spec.engine.stats()
    assert st["spec_accepted_tokens"] >= 20, st  # the counting run repeats its prompt
    assert st["spec_draft_tokens"] >= st["spec_accepted_tokens"]
    # the speculated run took fewer steps than tokens: several tokens per forward pass
    one = spec.generate(COUNT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    steps = spec.engine.stats()["num_steps"] - st["num_steps"]
    assert one.outputs[0].token_ids == want[0][0] and steps < 20, steps
    # a seeded sampled request drafts too: the same tokens, some drafts kept, fewer steps than tokens
    st = spec.engine.stats()
    one = spec.generate(COUNT, SAMPLED)[0]
    st2 = spec.engine.stats()
    assert one.outputs[0].token_ids == want[2][0] and len(want[2][0]) == 32
    assert st2["spec_accepted_tokens"] - st["spec_accepted_tokens"] >= 4, (st, st2)  # 7 with seed 7
    assert st2["num_steps"] - st["num_steps"] < 28
    # logprobs: a drafting request gets the same tokens and logprobs as without drafts
    lp_req = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    want_lp = plain.generate(COUNT, lp_req)[0].outputs[0]
    st = spec.engine.stats()
    got_lp = spec.generate(COUNT, lp_req)[0].outputs[0]
    assert spec.engine.stats()["spec_accepted_tokens"] - st["spec_accepted_tokens"] >= 8
    assert got_lp.token_ids == want_lp.token_ids
    _same_logprobs(got_lp.logprobs, want_lp.logprobs)
    # penalties, logit bias, min_tokens: each drafted row is sampled as a plain decode would after the same
    # tokens (penalty counts include the draft before the row; only kept tokens stay counted)
    eos, seven = spec.engine.tokenizer.eos_token_id, spec.engine.tokenizer.encode(" seven")[0]
    # "ha" repeated: the penalty a row sees grows with the draft's own "ha"s before it, and ends the run
    req = SamplingParams(temperature=0, max_tokens=24, frequency_penalty=0.2)
    want_p = plain.generate(HA, req)[0].outputs[0]
    st = spec.engine.stats()
    assert spec.generate(HA, req)[0].outputs[0].token_ids == want_p.token_ids
    assert spec.engine.stats()["spec_accepted_tokens"] - st["spec_accepted_tokens"] >= 8
    assert want_p.text.count("ha") < 24, want_p.text  # the penalty ended the run
    for kw in ({"frequency_penalty": 0.3, "presence_penalty": 0.2}, {"repetition_penalty": 1.02},
               {"logit_bias": {seven: -2.0}},  # counts without "seven", and repeats that
               {"logit_bias": {eos: 15.0}},  # EOS after "ten" (10 tokens) ...
               {"logit_bias": {eos: 15.0}, "min_tokens": 12}):  # ... not before 12: at the next "ten"
        req = SamplingParams(**{"temperature": 0, "max_tokens": 32, **kw})
        want_p = plain.generate(COUNT, req)[0].outputs[0]
        st = spec.engine.stats()
        got_p = spec.generate(COUNT, req)[0].outputs[0]
        assert got_p.token_ids == want_p.token_ids, kw
        assert spec.engine.stats()["spec_accepted_tokens"] - st["spec_accepted_tokens"] >= 4, kw
        if "logit_bias" in kw and eos in kw["logit_bias"]:
            assert want_p.finish_reason == "stop" and (len(want_p.token_ids) > 12) == ("min_tokens" in kw), want_p
        if seven in kw.get("logit_bias", {}):
            assert seven not in want_p.token_ids and len(want_p.token_ids) == 32
    from jaxserve.server.metrics import Metrics  # /metrics exports the two counters

    st = spec.engine.stats()
    text = Metrics(spec.engine.stats).render().decode()
    for name, key in (("draft", "spec_draft_tokens"), ("accepted", "spec_accepted_tokens")):
        assert f"jaxserve_spec_decode_{name}_tokens_total {float(st[key])}" in text


def _model_token(p: int) -> int:
    """A fake model's greedy token at sequence index p: three symbols in a hashed order, so every 2-gram
    recurs (prompt lookup always finds a draft) and drafts are right only by chance."""
    return 10 + hashlib.md5(str(p).encode()).digest()[0] % 3


class _SpecRunner:
    """Fake runner for the scheduler (no JAX): sampled tokens and drafts' verification from _model_token."""

    def run(self, out):
        from jaxserve.engine.batch import StepResult

        toks, ver = [], []
        for ss in out.scheduled:
            end = ss.start + ss.num_new  # index of the token sampled after the chunk
            toks.append([_model_token(end + j) for j in range(out.decode_steps)] if ss.samples else [])
            ver.append([_model_token(ss.start + 1 + j) for j in range(len(ss.draft))] if ss.draft else None)
        n = len(toks)
        return StepResult(toks, [None] * n, [None] * n, ver)


def _spec_run(n_seqs=1, max_tokens=200, **cfg):
    from jaxserve.engine.block_manager import BlockManager
    from jaxserve.engine.scheduler import Scheduler

    ec = EngineConfig(max_model_len=512, max_num_seqs=4, block_size=4, prefill_chunk_size=64, decode_steps=8,
                      attn_tile=1, num_speculative_tokens=4, **cfg)
    sched = Scheduler(ec, BlockManager(512, 4, False, None))
    seqs = [Sequence(f"r{i}", [_model_token(p) for p in range(12)], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                                  ignore_eos=True))
            for i in range(n_seqs)]
    for s in seqs:
        sched.add(s)
    runner, drafted, multi = _SpecRunner(), 0, 0
    while sched.has_unfinished():
        out = sched.schedule()
        drafted += sum(1 for ss in out.scheduled if ss.draft)
        multi += out.decode_steps > 1
        sched.update(out, runner.run(out), lambda t: False)
    for s in seqs:  # drafts or not, the model's own tokens
        assert s.output_token_ids == [_model_token(12 + i) for i in range(max_tokens)]
    return drafted, multi, sched


def test_refused_drafts_pause_drafting(monkeypatch):
    """A sequence whose drafts the model mostly refuses stops drafting for a doubling number of tokens
    (a drafted step leaves the multi-step decode loop: 7.5x slower at 32 sequences on an H100 when 95%
    were refused), and decodes K tokens per dispatch meanwhile; disable_by_batch_size turns drafting off
    above a batch size."""
    from jaxserve.engine import speculative

    drafted, multi, sched = _spec_run()
    assert 0 < drafted <= 12 and multi >= 15, (drafted, multi)
    assert sched.spec_accepted < sched.spec_proposed
    # 4 sequences: the batch pauses as one (each pausing on its own still left a draft in most steps)
    drafted, multi, _ = _spec_run(n_seqs=4, max_tokens=120)
    assert drafted <= 24 and multi >= 8, (drafted, multi)
    monkeypatch.setattr(speculative, "BACKOFF_FIRST", 0)  # no pause: a draft at (nearly) every step
    many, few_multi, _ = _spec_run()
    assert many >= 60 and few_multi <= 2, (many, few_multi)
    monkeypatch.undo()
    drafted, _, _ = _spec_run(n_seqs=3, max_tokens=40, speculative_disable_by_batch_size=2)
    assert drafted == 0
    assert _spec_run(n_seqs=2, max_tokens=40, speculative_disable_by_batch_size=2)[0] > 0
    assert speculative_fields({"num_speculative_tokens": 2, "disable_by_batch_size": 8}) == \
        {"num_speculative_tokens": 2, "speculative_disable_by_batch_size": 8}
