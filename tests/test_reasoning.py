"""Reasoning parsers (server/reasoning.py): the split of whole replies for both parsers, streams cut
at every place giving the same split, chat_template_kwargs reaching the template, and a real server
(SmolLM2, started with --reasoning-parser qwen3) whose reply is forced by a regex to think first:
reasoning_content and content in whole and streamed replies, validated against OpenAI's schema."""

import re

import numpy as np
import pytest

from conftest import post_json, validate_schema
from jaxserve.loader.chat_template import ChatTemplate
from jaxserve.server.reasoning import ReasoningSplitter, split
from test_server import chat_body, sse

CASES = {  # text: (deepseek_r1, qwen3)
    "<think>abc</think>\n\nHello": (("abc", "\n\nHello"), ("abc", "\n\nHello")),
    "\n<think>x</think>y": (("x", "y"), ("x", "y")),
    "plain answer": (("plain answer", None), (None, "plain answer")),
    "still thinking</think>the answer": (("still thinking", "the answer"), (None, "still thinking</think>the answer")),
    "<think>cut by max_tokens": (("cut by max_tokens", None), ("cut by max_tokens", None)),
    "<thin": (("<thin", None), (None, "<thin")),
    "": ((None, None), (None, None)),
    "<think></think>": ((None, None), (None, None)),
}


@pytest.mark.parametrize("kind", ["deepseek_r1", "qwen3"])
def test_split_and_streams_agree(kind):
    rng = np.random.default_rng(0)
    for text, want in CASES.items():
        assert split(kind, text) == want[kind == "qwen3"], (kind, text)
        for _ in range(20):  # the same text in random pieces, tags cut anywhere
            cuts = sorted(rng.integers(0, len(text) + 1, size=rng.integers(0, 6)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            sp, r, c = ReasoningSplitter(kind), "", ""
            for i, p in enumerate(pieces):
                dr, dc = sp.feed(p, final=i == len(pieces) - 1)
                r, c = r + dr, c + dc
            assert (r or None, c or None) == want[kind == "qwen3"], (kind, pieces)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningSplitter("r1")


def test_template_kwargs_reach_the_template():
    src = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
           "<think>\n\n</think>\n\n{% endif %}{% endif %}")
    t = ChatTemplate(src, None, None)
    msgs = [{"role": "user", "content": "hi"}]
    assert t.render(msgs).endswith("<|assistant|>")
    assert t.render(msgs, enable_thinking=False).endswith("<|assistant|><think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def url(server_factory):
    return server_factory("main").url


THINK = {"structured_outputs": {"regex": r"<think>[a-z ]{3,40}</think>[A-Z][a-z ]{3,40}"}, "temperature": 0,
         "max_tokens": 60}


def test_reasoning_content_whole_and_streamed(url):
    status, r = post_json(f"{url}/v1/chat/completions", chat_body("Think, then answer: what is bread?", **THINK))
    assert status == 200, r
    validate_schema(r, "CreateChatCompletionResponse")
    msg = r["choices"][0]["message"]
    assert re.fullmatch(r"[a-z ]{3,40}", msg["reasoning_content"]), msg
    assert re.fullmatch(r"[A-Z][a-z ]{3,40}", msg["content"]) and "think>" not in msg["content"], msg
    events = [e for _, e in sse(f"{url}/v1/chat/completions",
                                chat_body("Think, then answer: what is bread?", stream=True, **THINK))]
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    for e in events[:-1]:
        validate_schema(e, "CreateChatCompletionStreamResponse")
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]
    # a reply that does not open with <think> is all content, and has no reasoning_content field
    status, r = post_json(f"{url}/v1/chat/completions", chat_body("Say hi.", max_tokens=8, temperature=0))
    assert status == 200 and "reasoning_content" not in r["choices"][0]["message"], r


def test_chat_template_kwargs_requests(url):
    status, r = post_json(f"{url}/v1/chat/completions",
                          chat_body("hi", max_tokens=2, chat_template_kwargs={"enable_thinking": False}))
    assert status == 200, r
    status, r = post_json(f"{url}/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                              "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and r["count"] > 0, r
    for bad in ({"messages": []}, {"add_generation_prompt": False}):
        status, err = post_json(f"{url}/v1/chat/completions", chat_body("hi", chat_template_kwargs=bad))
        assert status == 400 and err["error"]["param"] == "chat_template_kwargs", err
        validate_schema(err, "ErrorResponse")
    status, err = post_json(f"{url}/v1/chat/completions", chat_body("hi", chat_template_kwargs=["x"]))
    assert status == 400, err


def _think_model(tmp_path):
    """A tiny random Llama whose vocabulary has <think> (256) and </think> (257) as single tokens."""
    from hf_tiny import make_tiny_model
    from tiny_tokenizer import add_byte_tokenizer

    return add_byte_tokenizer(make_tiny_model("llama", tmp_path, vocab_size=258), special=("<think>", "</think>"))


def test_grammar_after_reasoning(tmp_path):
    """AfterReasoning's masks and phases, then the engine: a prompt that opened the thinking lets the
    model close it freely (a logit bias makes it pick </think>) before the regex holds."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.engine.structured import AfterReasoning, GrammarCompiler, GrammarMatcher, StructuredOutput

    llm = LLM(str(_think_model(tmp_path)), max_model_len=64, num_blocks=32)
    tok = llm.tokenizer
    gc = GrammarCompiler(tok, 258)
    spec = StructuredOutput(regex="[a-c]{3}", after_reasoning=True)
    allowed = lambda m: {t for t in range(258) if m[t // 32] >> (t % 32) & 1}
    abc = {ord(c) - 33 for c in "abc"}  # the byte vocabulary numbers printable bytes from "!"
    assert [tok.encode(c, add_special_tokens=False)[0] for c in "abc"] == sorted(abc)
    m = gc.matcher(spec, tok.encode("hi", add_special_tokens=False))  # not opened: <think> or the answer
    assert isinstance(m, AfterReasoning) and allowed(m.mask()) == abc | {256}
    assert m.accept(256) and allowed(m.mask()) == set(range(258))  # thinking: anything
    assert m.accept(ord("x") - 33) and m.accept(257) and allowed(m.mask()) == abc  # after </think>
    assert all(m.accept(ord(c) - 33) for c in "abc") and m.done
    m = gc.matcher(spec, [256, 257])  # thinking opened and closed in the prompt: the answer at once
    assert allowed(m.mask()) == abc | {256} and m.accept(ord("a") - 33) and allowed(m.mask()) == abc
    assert type(gc.matcher(StructuredOutput(regex="[a-c]{3}"), [256])) is GrammarMatcher

    prompt = tok.encode("hi", add_special_tokens=False) + [256]  # the template opened the thinking
    kw = dict(temperature=0, max_tokens=8, logit_bias={257: 40.0})
    out = llm.generate([prompt], SamplingParams(structured=spec, **kw))[0].outputs[0]
    assert out.token_ids[0] == 257 and len(out.token_ids) == 4 and set(out.token_ids[1:]) <= abc, out.token_ids
    assert out.finish_reason == "stop"
    plain = llm.generate([prompt], SamplingParams(structured=StructuredOutput(regex="[a-c]{3}"), **kw))[0].outputs[0]
    assert len(plain.token_ids) == 3 and set(plain.token_ids) <= abc, plain.token_ids  # </think> not allowed
