"""Structured output, host side and sampler: grammar masks on the real SmolLM2 tokenizer checked
against an independent scan of its vocabulary, the scheduler's handling of constrained sequences (one
token per dispatch, nothing scheduled ahead, the others' tokens unchanged), and the sampler's mask."""

import re

import numpy as np
import pytest

from jaxserve.engine.sampling_params import SamplingParams, SamplingParamsError
from jaxserve.engine.sampling_tensors import build_sampling_tensors
from jaxserve.engine.sequence import FinishReason
from jaxserve.engine.structured import (GrammarCompiler, StructuredOutput, StructuredOutputError, closed_objects,
                                        mask_words)
from jaxserve.loader.tokenizer import Tokenizer
from model_files import readers
from test_scheduler import EOS, FakeRunner, default_token, drain, make, seq, step


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(readers("smollm2"))


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, tok.vocab_size + 64)  # logits wider than the vocabulary (padded embedding)


def allowed(mask: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_spec_validation():
    for bad in [dict(), dict(regex="a", choice=["b"]), dict(choice=[]), dict(choice=["a", ""]),
                dict(json_schema="{not json"), dict(json_schema=[1])]:
        with pytest.raises(StructuredOutputError):
            StructuredOutput(**bad)
    assert StructuredOutput(choice=["a", "b"]).choice == ("a", "b")  # hashable, frozen
    assert StructuredOutput(json_object=True).kind == "json_object"
    # SamplingParams takes the fields as a dict; unknown fields are errors
    p = SamplingParams(structured={"regex": "a+"})
    assert p.structured == StructuredOutput(regex="a+")
    with pytest.raises(SamplingParamsError):
        SamplingParams(structured={"regexp": "a+"})
    with pytest.raises(SamplingParamsError):
        SamplingParams(structured="a+")


def test_closed_objects():
    schema = {"type": "object",
              "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                             "list": {"type": "array", "items": {"properties": {"b": {}}}},
                             "open": {"properties": {"c": {}}, "additionalProperties": True},
                             "pat": {"properties": {"d": {}}, "patternProperties": {"^x": {}}}},
              "$defs": {"D": {"properties": {"e": {}}}},
              "anyOf": [{"properties": {"f": {}}}],
              "allOf": [{"properties": {"g": {}}}]}
    c = closed_objects(schema)
    assert c["additionalProperties"] is False
    p = c["properties"]
    assert p["properties"]["additionalProperties"] is False and set(p["properties"]) == {"type", "properties",
                                                                                            "additionalProperties"}
    assert p["list"]["items"]["additionalProperties"] is False
    assert p["open"]["additionalProperties"] is True and "additionalProperties" not in p["pat"]
    assert c["$defs"]["D"]["additionalProperties"] is False and c["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in c["allOf"][0]  # closing one branch would refuse the others' properties
    assert "additionalProperties" not in schema  # the caller's schema is not changed
    assert closed_objects({"type": "object"}) == {"type": "object"}  # nothing listed: any object


def test_choice_mask_matches_a_scan_of_the_vocabulary(tok, compiler):
    choices = [" yes", " no", "maybe so"]
    m = compiler.matcher(StructuredOutput(choice=choices))
    mask = m.mask()
    assert mask.shape == (mask_words(tok.vocab_size + 64),)
    # independently: the tokens whose text is a non-empty prefix of a choice
    want = set()
    for t in range(tok.vocab_size):
        if t in tok.special_ids:
            continue
        s = tok.decode([t], skip_special_tokens=False)
        if s and any(c.startswith(s) for c in choices):
            want.add(t)
    assert allowed(mask) == want
    assert not allowed(mask) & set(range(tok.vocab_size, tok.vocab_size + 64))  # padding never
    # walk " yes": each token allowed, then only EOS, and the grammar is done
    ids = tok.encode(" yes", add_special_tokens=False)
    for t in ids:
        assert t in allowed(m.mask()) and not m.done
        assert m.accept(t)
    assert m.done and allowed(m.mask()) == set(tok.eos_token_ids)
    # a token the grammar does not allow is refused
    m = compiler.matcher(StructuredOutput(choice=choices))
    assert not m.accept(tok.encode(" maybe", add_special_tokens=False)[0])


def test_json_schema_walk_and_refusals(tok, compiler):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"]}
    spec = StructuredOutput(json_schema=schema)
    good = '{"city": "Oslo", "days": 3}'
    m = compiler.matcher(spec)
    for t in tok.encode(good, add_special_tokens=False):
        assert t in allowed(m.mask())
        assert m.accept(t)
    assert m.done
    for bad in ['{"city": 5', '{"town"', '{"city": "Oslo", "days": 3, "x"', '[']:
        m = compiler.matcher(spec)
        ids = tok.encode(bad, add_special_tokens=False)
        ok = all(m.accept(t) for t in ids)
        assert not ok, bad
    # whitespace between tokens is bounded: a model cannot pad forever
    m = compiler.matcher(spec)
    assert m.accept(tok.encode("{", add_special_tokens=False)[0])
    spaces = tok.encode(" " * 16, add_special_tokens=False)
    assert all(m.accept(t) for t in spaces)
    assert not all(m.accept(t) for t in spaces)
    for bad in [dict(regex="(("), dict(grammar="start: nowhere"), dict(json_schema={"type": "frob"})]:
        with pytest.raises(StructuredOutputError):
            compiler.matcher(StructuredOutput(**bad))


def test_sampling_tensor_mask_layout(compiler):
    m = compiler.matcher(StructuredOutput(choice=["a", "b"]))
    V = compiler.vocab_size
    st = build_sampling_tensors([SamplingParams(), SamplingParams()], 3, [1, 2], vocab_size=V)
    assert st["constrained"].tolist() == [False] * 3 and "allowed" not in st  # the runner's device copy
    st = build_sampling_tensors([SamplingParams(), SamplingParams()], 3, [1, 2], vocab_size=V,
                                masks=[None, m.mask()])
    W = mask_words(V)
    assert st["allowed"].shape == (3, W) and st["allowed"].dtype == np.uint32
    assert st["constrained"].tolist() == [False, True, False]
    assert (st["allowed"][[0, 2]] == 0xFFFFFFFF).all()
    assert allowed(st["allowed"][1]) == allowed(m.mask()) != set()
    with pytest.raises(ValueError):
        build_sampling_tensors([SamplingParams()], 2, [1], masks=[m.mask()])  # masks need the vocabulary


def test_sampler_applies_the_mask():
    import jax.numpy as jnp

    from jaxserve.engine.sampler import sample

    rng = np.random.default_rng(0)
    S, V = 6, 1000
    logits = rng.normal(size=(S, V)).astype(np.float32) * 3
    W = mask_words(V)
    masks = []
    for i in range(S):
        keep = rng.random(V) < (0.01 if i % 2 else 0.3)
        keep[rng.integers(V)] = True
        words = np.zeros(W * 32, bool)
        words[:V] = keep
        masks.append(np.packbits(words, bitorder="little").view(np.uint32))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2), SamplingParams(temperature=2.0, top_k=50, seed=3),
              SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=4)]
    constrained = [True, True, True, True, False, False]
    st = build_sampling_tensors(params, S, [p.seed or 0 for p in params], vocab_size=V,
                                masks=[mk if c else None for mk, c in zip(masks, constrained)])
    plain = build_sampling_tensors(params, S, [p.seed or 0 for p in params], vocab_size=V)
    plain["allowed"] = np.full((S, W), 0xFFFFFFFF, np.uint32)  # what the runner passes: no row constrained
    counts = jnp.zeros((S, V), jnp.int32)
    pm = jnp.zeros((S, V), bool)
    for pos in range(5):
        positions = jnp.full((S,), pos, jnp.int32)
        out = sample(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in st.items()}, positions, counts, pm, 0)
        ref = sample(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in plain.items()}, positions, counts, pm, 0)
        toks = np.asarray(out["tokens"])
        for i in range(S):
            if constrained[i]:
                assert toks[i] in allowed(masks[i]), (i, pos)
            else:  # unconstrained rows: the same draw as without masks at all
                assert toks[i] == int(ref["tokens"][i])
        ok = sorted(allowed(masks[0]))
        assert toks[0] == ok[int(np.argmax(logits[0, ok]))]  # greedy: the best allowed token


def _grammar_token(tok):
    """The fake runner's "model": the lowest allowed token for constrained sequences."""
    def fn(s, pos):
        if s.matcher is None:
            return default_token(s, pos)
        return min(allowed(s.matcher.mask()))
    return fn


def test_scheduler_runs_constrained_sequences_one_token_per_dispatch(tok, compiler):
    cfg, bm, sched = make({"decode_steps": 4, "max_num_seqs": 3, "max_model_len": 256})
    runner = FakeRunner(bm, token_fn=_grammar_token(tok))
    free = seq(range(6), "free", max_tokens=40)
    c = seq(range(10, 16), "c", max_tokens=60)
    c.params = c.params.replace(structured=StructuredOutput(regex=r"[a-c]{3}-\d{2}"))
    c.matcher = compiler.matcher(c.params.structured)
    sched.add(free)
    sched.add(c)
    steps = []
    while c.status.value != "finished":
        out, _ = step(sched, runner, eos=lambda t: t in tok.eos_token_ids)
        steps.append(out.decode_steps)
        if c in [ss.seq for ss in out.scheduled]:
            assert out.decode_steps == 1 and sched.schedule_ahead(out) is None
    assert c.finish_reason == FinishReason.STOP
    assert re.fullmatch(r"[a-c]{3}-\d{2}", tok.decode(c.output_token_ids)), tok.decode(c.output_token_ids)
    assert set(steps) == {1}
    # once no constrained sequence runs, multi-step decoding (and steps ahead) come back
    out = sched.schedule()
    assert out.decode_steps == 4 and sched.schedule_ahead(out) is not None
    sched.update(out, runner.run(out), lambda t: t == EOS)
    drain(sched, runner)
    assert free.output_token_ids == [default_token(free, free.num_prompt_tokens + i) for i in range(40)]


def test_grammar_end_and_an_impossible_token(tok, compiler):
    # the grammar completes: the sequence stops without waiting for EOS
    cfg, bm, sched = make({"decode_steps": 1, "max_num_seqs": 2})
    runner = FakeRunner(bm, token_fn=_grammar_token(tok))
    a = seq(range(6), "a", max_tokens=50)
    a.params = a.params.replace(structured=StructuredOutput(choice=["ab"]))
    a.matcher = compiler.matcher(a.params.structured)
    sched.add(a)
    drain(sched, runner, eos=lambda t: t in tok.eos_token_ids)
    assert tok.decode(a.output_token_ids) == "ab" and a.finish_reason == FinishReason.STOP
    # a token outside the grammar (a row whose mask left nothing) is dropped and the output ends
    cfg, bm, sched = make({"decode_steps": 1, "max_num_seqs": 2})
    bad = tok.encode("zzz", add_special_tokens=False)[0]
    runner = FakeRunner(bm, token_fn=lambda s, pos: bad)
    b = seq(range(6), "b", max_tokens=50)
    b.params = b.params.replace(structured=StructuredOutput(choice=["ab"]))
    b.matcher = compiler.matcher(b.params.structured)
    sched.add(b)
    drain(sched, runner, eos=lambda t: t in tok.eos_token_ids)
    assert b.output_token_ids == [] and b.finish_reason == FinishReason.STOP


def _walk(compiler, tok, spec, text) -> bool:
    m = compiler.matcher(spec)
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and m.done


def test_forced_tool_schemas(tok, compiler):
    from jaxserve.server.structured import forced_tool_spec

    # Pydantic-style parameters with $defs: references still resolve inside the combined "required" schema
    trip = {"name": "book", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}}
    ping = {"name": "ping", "parameters": {"type": "object", "properties": {}}}
    loose = {"name": "loose", "parameters": {"properties": {"n": {"type": "integer"}}}}  # no "type"
    funcs = [trip, ping, loose]
    req = forced_tool_spec(funcs, "required", one_call=False)
    assert _walk(compiler, tok, req, '[{"name": "book", "arguments": {"to": {"city": "Oslo"}}}, '
                                     '{"name": "ping", "arguments": {}}]')
    assert not _walk(compiler, tok, req, '[{"name": "book", "arguments": {"to": {"town": "Oslo"}}}]')
    assert not _walk(compiler, tok, req, '[{"name": "ping", "arguments": {"x": 1}}]')  # no invented keys
    assert not _walk(compiler, tok, req, '[{"name": "loose", "arguments": 5}]')  # arguments: an object
    assert not _walk(compiler, tok, req, '[]')
    one = forced_tool_spec(funcs, "required", one_call=True)
    assert not _walk(compiler, tok, one, '[{"name": "ping", "arguments": {}}, {"name": "ping", "arguments": {}}]')
    # a named function: its arguments object, references resolved in place
    assert _walk(compiler, tok, forced_tool_spec(funcs, "book", False), '{"to": {"city": "Rome"}}')
    assert _walk(compiler, tok, forced_tool_spec(funcs, "ping", False), '{}')
    assert not _walk(compiler, tok, forced_tool_spec(funcs, "loose", False), '7')


def test_compiled_grammars_are_reused_and_bad_input_is_an_error(tok, compiler):
    import time

    big = StructuredOutput(choice=[f"option number {i}" for i in range(5000)])  # > the parser's 2000 items a row
    t = time.perf_counter()
    a = compiler.matcher(big)
    first = time.perf_counter() - t
    t = time.perf_counter()
    b = compiler.matcher(big)
    assert time.perf_counter() - t < first / 3  # a copy of the compiled grammar
    assert all(a.accept(t) for t in tok.encode("option number 432", add_special_tokens=False)), a.error
    assert allowed(b.mask()) != allowed(a.mask())  # copies do not share state
    assert not a.done and set(tok.eos_token_ids) <= allowed(a.mask())  # "...432" or "...4320" to "...4329"
    deep = {"type": "object"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    # [^\s\S]: compiles, but no output satisfies it (was accepted and ended its reply at the first token)
    for bad in [dict(regex="\ud800"), dict(json_schema=deep), dict(regex="[^\\s\\S]"),
                dict(regex="[^\\x00-\\x{10FFFF}]")]:
        with pytest.raises(StructuredOutputError):
            compiler.matcher(StructuredOutput(**bad))
    # a schema's own whitespace option does not lift the bound
    spec = StructuredOutput(json_schema={"type": "object", "properties": {},
                                         "x-guidance": {"whitespace_pattern": "[ ]*"}})
    assert not _walk(compiler, tok, spec, "{" + " " * 60 + "}")


def test_multihost_step_message_leaves_out_an_all_ones_mask(compiler):
    from jaxserve.parallel.multihost import _pack_step, _unpack_step

    V = compiler.vocab_size
    ones = lambda S: np.full((S, mask_words(V)), 0xFFFFFFFF, np.uint32)
    st = build_sampling_tensors([SamplingParams()], 4, [1], vocab_size=V)
    inp = {"st": dict(st, allowed=ones(4)), "token_ids": np.arange(4)}
    packed = _pack_step(inp)
    assert packed["st"]["allowed"] == ("ones", (4, mask_words(V)))
    back = _unpack_step(packed, ones)
    assert (back["st"]["allowed"] == 0xFFFFFFFF).all() and back["st"]["allowed"].shape == (4, mask_words(V))
    # a constrained row: the mask travels as it is
    m = compiler.matcher(StructuredOutput(choice=["a"]))
    st = build_sampling_tensors([SamplingParams()], 4, [1], vocab_size=V, masks=[m.mask()])
    packed = _pack_step({"st": st})
    assert packed["st"]["allowed"] is st["allowed"]
    assert _unpack_step(packed, ones)["st"]["allowed"] is st["allowed"]
