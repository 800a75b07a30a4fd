"""The offline engine end to end on the real SmolLM2 GGUF: continuous batching, chunked prefill, prefix
cache, preemption, sampling, logprobs, scoring — and nothing compiles after warm-up."""

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from model_files import smollm2_gguf

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "List three colours:",
    "Once upon a time, in a small village by the sea, there lived",
    "Water boils at",
    "The best way to learn a new language is",
]

_compiles = []


def _on_event(name, *args, **kw):
    if "backend_compile" in name:
        _compiles.append(name)


jax.monitoring.register_event_duration_secs_listener(_on_event)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(str(smollm2_gguf()), max_model_len=512, max_num_seqs=8, prefill_chunk_size=64,
              decode_steps=4)
    return llm


@pytest.fixture(autouse=True)
def no_compiles_while_serving(llm):
    n = len(_compiles)
    yield
    assert len(_compiles) == n, f"{len(_compiles) - n} compile(s) after warm-up"


def _greedy(n=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_batched_equals_alone(llm):
    together = llm.generate(PROMPTS, _greedy())
    for p, t in zip(PROMPTS, together):
        alone = llm.generate(p, _greedy())[0]
        assert alone.outputs[0].token_ids == t.outputs[0].token_ids, p
        assert t.outputs[0].finish_reason == "length"
        assert len(t.outputs[0].token_ids) == 24


def test_staggered_max_tokens_in_one_batch(llm):
    """Sequences reaching max_tokens one after another inside 4-step decodes (the others' steps are
    not cut short: the ended ones' last tokens are computed into their own last block's free slots or,
    past their block tables, into the null block 0, then dropped; with these lengths both happen):
    each output is the prefix of the sequence's longest greedy run alone; run twice, the second batch
    over the first's cached prompt blocks."""
    lens = [9, 27, 10, 17, 15, 22]
    tail = " Please answer in detail, with examples, and keep going for a while."
    prompts = [p + tail for p in PROMPTS]
    alone = [llm.generate(p, _greedy(27))[0].outputs[0].token_ids for p in prompts]
    eng = llm.engine
    prepare, past = eng.runner.prepare, []

    def counting(sched):  # decode positions of a dispatch that have no slot (their K/V go to block 0)
        for s in sched.scheduled if sched.decode_steps > 1 else []:
            past.append(max(0, s.start + sched.decode_steps - len(s.seq.block_table) * eng.ecfg.block_size))
        return prepare(sched)

    eng.runner.prepare = counting
    try:
        for run in range(2):
            n0, hits0 = eng.num_ahead_steps, eng.stats()["prefix_cache_hit_tokens"]
            outs = llm.generate(prompts, [_greedy(n) for n in lens])
            assert [o.outputs[0].token_ids for o in outs] == [a[:n] for a, n in zip(alone, lens)]
            assert eng.num_ahead_steps - n0 >= 3
            assert run == 0 or eng.stats()["prefix_cache_hit_tokens"] - hits0 >= 16 * len(prompts)
    finally:
        eng.runner.prepare = prepare
    assert sum(past) > 0


def test_greedy_matches_transformers_with_chunked_prefill(llm):
    """A prompt longer than the 64-token chunk, greedy tokens identical to transformers' generate."""
    import torch
    import transformers

    path = smollm2_gguf()
    text = " ".join(PROMPTS) * 4
    ids = llm.tokenizer.encode(text)
    assert len(ids) > 150
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    out = llm.generate([ids], _greedy(16))[0]
    assert out.outputs[0].token_ids == ref


def test_prefix_cache_hit_and_same_output(llm):
    system = "You are a meticulous assistant who answers briefly and precisely. " * 6
    a = llm.generate(system + "Name a fruit.", _greedy(8))[0]
    b = llm.generate(system + "Name a fruit.", _greedy(8))[0]
    c = llm.generate(system + "Name a planet.", _greedy(8))[0]
    assert b.num_cached_tokens >= 64 and c.num_cached_tokens >= 64
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert llm.engine.block_manager.prefix_hits_tokens > 0
    # penalties count every earlier token on the device: a penalized request's cached prefix is counted
    # into its row (runner._seed_inputs), so it gets the tokens of the whole context computed (a request
    # owing prompt logprobs skips the cache). The model wants to go on with words of the cached part.
    count = ("Count with me: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, "
             "thirteen, fourteen, fifteen, sixteen, seventeen, eighteen, nineteen, twenty. Once more from "
             "the start: one, two,")
    plain = llm.generate(count, _greedy(12))[0].outputs[0].token_ids
    for pen in (_greedy(12, repetition_penalty=2.0),
                _greedy(12, frequency_penalty=1.5, presence_penalty=0.5)):
        ref = llm.generate(count, pen.replace(prompt_logprobs=0))[0]
        d, e = (llm.generate(count, pen)[0] for _ in range(2))
        assert ref.num_cached_tokens == 0 and d.num_cached_tokens >= 48 and e.num_cached_tokens >= 48
        assert d.outputs[0].token_ids == e.outputs[0].token_ids == ref.outputs[0].token_ids
    assert ref.outputs[0].token_ids != plain


def test_seeded_sampling_is_batch_invariant(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=i) for i in range(5)]
    outs = llm.generate([PROMPTS[0]] * 3 + PROMPTS[1:6], [p] * 3 + others)
    for o in outs[:3]:
        assert o.outputs[0].token_ids == alone
    unseeded = llm.generate([PROMPTS[0]] * 2, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_choices_differ_and_stop_strings(llm):
    out = llm.generate(PROMPTS[3], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16))[0]
    assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    full = llm.generate(PROMPTS[2], _greedy(32))[0].outputs[0].text
    words = full.split()
    stop = words[min(3, len(words) - 1)]
    cut = llm.generate(PROMPTS[2], _greedy(32, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[:full.index(stop)]


def test_stop_token_text_min_tokens_and_choice_seeds(llm):
    """vLLM's rules: a stop token id's (or EOS's) own text is not output unless
    include_stop_str_in_output; stop strings only count from min_tokens output tokens on; a request's
    n choices get seeds unrelated to neighbouring seeds, and seeds are not cut to 31 bits."""
    full = llm.generate(PROMPTS[2], _greedy(32))[0].outputs[0]
    ids, text = full.token_ids, full.text
    k = next(i for i in range(3, len(ids)) if llm.get_tokenizer().decode([ids[i]]).strip())
    stop_id = ids[k]
    kept = llm.generate(PROMPTS[2], _greedy(32, stop_token_ids=[stop_id]))[0].outputs[0]
    first = ids.index(stop_id)
    assert kept.finish_reason == "stop" and kept.stop_reason == stop_id and kept.token_ids == ids[:first + 1]
    tok = llm.get_tokenizer()
    assert kept.text == tok.decode(ids[:first]), (kept.text, tok.decode(ids[:first + 1]))
    shown = llm.generate(PROMPTS[2], _greedy(32, stop_token_ids=[stop_id], include_stop_str_in_output=True))[0]
    assert shown.outputs[0].text == tok.decode(ids[:first + 1])
    # a stop string completed before min_tokens tokens does not end the output
    stop = tok.decode(ids[1:2]).strip() or tok.decode(ids[1:2])
    hit = next(i for i in range(len(ids)) if stop in tok.decode(ids[:i + 1]))
    early = llm.generate(PROMPTS[2], _greedy(32, stop=[stop]))[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == hit + 1
    late = llm.generate(PROMPTS[2], _greedy(32, stop=[stop], min_tokens=hit + 6))[0].outputs[0]
    assert len(late.token_ids) >= hit + 6 and late.token_ids[:hit + 6] == ids[:hit + 6]
    # seeds: choice 1 of seed s is not choice 0 of seed s + 1; seeds differing above bit 31 differ
    sp = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    three = llm.generate(PROMPTS[3], SamplingParams(n=3, seed=42, **sp))[0].outputs
    nxt = llm.generate(PROMPTS[3], SamplingParams(seed=43, **sp))[0].outputs[0]
    assert three[1].token_ids != nxt.token_ids
    outs = [llm.generate(PROMPTS[3], SamplingParams(seed=s, **sp))[0].outputs[0].token_ids
            for s in (5, 5 + 2 ** 31, 5 + 2 ** 40, 5)]
    assert outs[0] == outs[3] and len({tuple(o) for o in outs[:3]}) == 3


def test_logprobs_and_penalties(llm):
    out = llm.generate(PROMPTS[1], _greedy(8, logprobs=5))[0].outputs[0]
    assert len(out.logprobs) == 8
    for tok, (lp, top) in zip(out.token_ids, out.logprobs):
        assert len(top) == 5 and top[0][0] == tok and abs(top[0][1] - lp) < 1e-5
        assert all(top[i][1] >= top[i + 1][1] for i in range(4))
    plain = llm.generate(PROMPTS[1], _greedy(24))[0].outputs[0].token_ids
    pen = llm.generate(PROMPTS[1], _greedy(24, frequency_penalty=2.0, presence_penalty=2.0))[0]
    toks = pen.outputs[0].token_ids
    assert toks != plain
    assert len(set(toks)) > len(set(plain)) or len(set(toks)) == len(toks)
    banned = plain[0]
    biased = llm.generate(PROMPTS[1], _greedy(4, logit_bias={banned: -100}))[0].outputs[0].token_ids
    assert banned not in biased


def test_score_matches_model_logprobs(llm):
    text = "Paris is the capital and most populous city of France."
    sc = llm.score([text, text + " It is on the Seine."])
    assert sc[0].logprobs[0] is None and len(sc[0].logprobs) == len(sc[0].token_ids)
    # The shared prefix has the same logprobs in both texts (and the prefix cache is bypassed).
    n = len(sc[0].token_ids)
    np.testing.assert_allclose(sc[0].logprobs[1:], sc[1].logprobs[1:n], atol=1e-4)
    assert all(lp <= 0 for lp in sc[0].logprobs[1:])
    assert 1.0 < sc[0].perplexity < 1000


def test_preemption_gives_same_greedy_output():
    n0 = len(_compiles)
    # f32 weights (packed_weights=False): the native quantized kernel is batch-invariant per row, but it
    # quantizes activations, which turns the last-bit differences of the other ops between a sequence
    # alone and in a batch (other bucket shapes) into rare near-tie flips; this test is about preemption.
    small = LLM(str(smollm2_gguf()), max_model_len=256, max_num_seqs=8, prefill_chunk_size=64,
                num_blocks=16, block_size=16, packed_weights=False)
    del _compiles[n0:]  # its own warm-up compiles; nothing may compile after them
    prompts = [p + " " + p for p in PROMPTS] + PROMPTS[:2]
    alone = [small.generate(p, _greedy(48))[0].outputs[0].token_ids for p in prompts]
    together = small.generate(prompts, _greedy(48))
    assert [o.outputs[0].token_ids for o in together] == alone
    assert small.engine.num_preemptions > 0
    # with a frequency penalty, a preempted sequence's counts come back whole: its own cached blocks
    # (prompt and output tokens) are counted into its new row before it goes on
    n = small.engine.num_preemptions
    pen = _greedy(48, frequency_penalty=0.3)
    alone = [small.generate(p, pen)[0].outputs[0].token_ids for p in prompts]
    runner, seeded = small.engine.runner, []
    real = runner._seed_inputs
    runner._seed_inputs = lambda seq, k: seeded.append(k - seq.num_prompt_tokens) or real(seq, k)
    try:
        assert [o.outputs[0].token_ids for o in small.generate(prompts, pen)] == alone
    finally:
        del runner._seed_inputs
    assert small.engine.num_preemptions > n
    assert max(seeded) > 0, "no preempted sequence resumed from cached blocks holding its output tokens"
    bm = small.engine.block_manager
    assert bm.num_used_blocks == 0


def test_async_scheduling_gives_the_same_outputs(llm):
    """Decode steps dispatched ahead of the host (their first token still on the device) change
    nothing: greedy, seeded sampling with penalties and min_tokens, stop strings, stop tokens that end
    a sequence inside a multi-step decode, logprobs."""
    eng = llm.engine
    first = llm.generate(PROMPTS[2], _greedy(40))[0].outputs[0].token_ids
    params = [_greedy(30),
              SamplingParams(temperature=0.8, seed=3, max_tokens=25, stop=["\n\n"]),
              _greedy(40, stop_token_ids=[first[9]]),  # ends after ~10 tokens: inside a 4-step decode
              SamplingParams(temperature=1.0, seed=5, max_tokens=33, frequency_penalty=1.0, logprobs=2,
                             min_tokens=5)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[4]]

    def run():
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in outs]

    assert eng.ecfg.async_scheduling
    n0 = eng.num_ahead_steps
    got = run()
    assert eng.num_ahead_steps > n0
    eng.ecfg = eng.ecfg.replace(async_scheduling=False)
    try:
        n1 = eng.num_ahead_steps
        want = run()
        assert eng.num_ahead_steps == n1
    finally:
        eng.ecfg = eng.ecfg.replace(async_scheduling=True)
    assert got == want
    assert want[2][2] == "stop" and len(want[2][0]) <= 10


def test_prompt_logprobs_with_a_one_step_decode_scheduled_ahead(llm):
    """A request with prompt_logprobs whose last decode dispatch, scheduled ahead, is one step long (6
    tokens: 1 from the prompt step, 4 in a multi-step decode, 1 ahead) stays on the decode program: it
    once went to the prompt (mixed) program, which cannot take a token the host has not read, and the
    engine died. Same outputs with async scheduling off."""
    eng = llm.engine
    sp = _greedy(6, prompt_logprobs=1)
    n0 = eng.num_ahead_steps
    got = llm.generate(PROMPTS[1], sp)[0]
    assert eng.num_ahead_steps > n0
    eng.ecfg = eng.ecfg.replace(async_scheduling=False)
    try:
        want = llm.generate(PROMPTS[1], sp)[0]
    finally:
        eng.ecfg = eng.ecfg.replace(async_scheduling=True)
    assert len(got.outputs[0].token_ids) == 6 and got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt_logprobs == want.prompt_logprobs and len(got.prompt_logprobs) == len(got.prompt_token_ids)


def test_structured_output_beside_free_sequences(llm):
    """Constrained sequences (JSON schema greedy and sampled, a regex, a choice) in one batch with free
    ones: each constrained output satisfies its grammar and ends when it is complete; the free
    sequences' tokens equal their tokens alone (which ran in 4-step decodes: the batch with constrained
    rows decodes one token per dispatch); nothing compiles."""
    import json
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                               "year": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                        "maxItems": 3}},
              "required": ["title", "year"]}
    prompts = ["A famous book, as JSON:", "A famous film, as JSON:", "A phone number:", "Is water wet? Answer:",
               PROMPTS[0], PROMPTS[3]]
    params = [SamplingParams(temperature=0, max_tokens=80, structured={"json_schema": schema}),
              SamplingParams(temperature=0.9, seed=11, max_tokens=80, structured={"json_schema": schema}),
              SamplingParams(temperature=0.7, seed=2, max_tokens=20, structured={"regex": r" \d{3}-\d{4}"}),
              SamplingParams(temperature=0, structured={"choice": [" yes", " no"]}),
              _greedy(20), _greedy(20)]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    for o in outs[:2]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)
    assert re.fullmatch(r" \d{3}-\d{4}", outs[2].text) and outs[2].finish_reason == "stop"
    assert outs[3].text in (" yes", " no") and outs[3].finish_reason == "stop"
    for p, o in zip(prompts[4:], outs[4:]):
        assert o.token_ids == llm.generate(p, _greedy(20))[0].outputs[0].token_ids
    # the greedy constrained output is reproducible alone
    assert llm.generate(prompts[0], params[0])[0].outputs[0].text == outs[0].text


def test_prompt_forms_chat_prompt_and_parameter_errors(llm):
    """Token ids as any integer sequence (a numpy array too) give the list's output; chat() returns the
    rendered template as `prompt` and takes chat_template_kwargs; bad parameters are ValueErrors at
    construction (NaN temperature / repetition penalty, min_tokens > max_tokens, a non-integer seed),
    and a prompt of another type is a TypeError before anything runs."""
    ids = llm.get_tokenizer().encode(PROMPTS[4])
    want = llm.generate(ids, _greedy(6))[0].outputs[0].token_ids
    for form in (np.array(ids), tuple(ids), [np.int64(t) for t in ids]):
        assert llm.generate(form, _greedy(6))[0].outputs[0].token_ids == want
        assert llm.generate([form, ids], _greedy(6))[0].outputs[0].token_ids == want
    assert llm.generate((p for p in [ids]), _greedy(6))[0].outputs[0].token_ids == want  # any iterable
    assert llm.generate({"prompt_token_ids": np.array(ids)}, _greedy(6))[0].outputs[0].token_ids == want
    msgs = [{"role": "user", "content": "Say hi"}]
    out = llm.chat(msgs, _greedy(4))[0]
    assert out.prompt == llm.apply_chat_template(msgs) and out.prompt.rstrip().endswith("assistant")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt)
    assert llm.chat(msgs, _greedy(4), chat_template_kwargs={"add_extra": 1})[0].outputs[0].token_ids == \
        out.outputs[0].token_ids  # a variable the template does not use changes nothing
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(msgs, _greedy(4), chat_template_kwargs={"tools": []})
    for kw, what in [(dict(temperature=float("nan")), "temperature"),
                     (dict(temperature=float("inf")), "temperature"),
                     (dict(repetition_penalty=float("nan")), "repetition_penalty"),
                     (dict(min_tokens=10, max_tokens=3), "min_tokens"), (dict(seed=1.5), "seed")]:
        with pytest.raises(ValueError, match=what):
            SamplingParams(**kw)
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([ids, 3.5], _greedy(2))
    assert not llm.engine.has_unfinished()
