"""Our GGUF-built tokenizers give the ids transformers gives; decoding and streaming round-trip."""

import random

import pytest
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from jaxserve.loader.tokenizer import IncrementalDetokenizer, Tokenizer
from model_files import gemma3_gguf, readers, smollm2_gguf

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we've won!",
    "def f(x):\n    return x**2 + 3.14159  # comment\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++",
    "2024-01-01 12:34:56, 1234567890, $1,000.50, 0x1F, -42e-3, 3½",
    "  leading spaces, trailing spaces   ",
    "many     internal      spaces\t\ttabs\n\n\nnewlines\r\nwindows\r\n",
    "日本語のテキストです。中文文本。한국어 텍스트.",
    "café naïve résumé Ærøskøbing Ångström façade Zürich ñandú",
    "emoji 🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 math 𝔹𝕆𝕃𝔻 ✓ ★",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "text with <bos> and <eos> and <|endoftext|> inside",
    "URL https://example.com/path?q=1&r=%20 email a.b@c.org",
    "",
    " ",
    "\n",
]


def _random_corpus(n=60, seed=0):
    pools = ["abcdefghijklmnopqrstuvwxyz", "ABCXYZ", "0123456789", " ", "  \n\t", ".,;:!?'\"()[]{}<>/\\-_=+*&^%$#@",
             "éèêàçñöüßøå", "中文日本語한국", "🎉👍🏽😀🚀", "\u200b\u00a0"]
    rng = random.Random(seed)
    return ["".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40))) for _ in range(n)]


_FILES = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}


@pytest.fixture(scope="module", params=sorted(_FILES))
def pair(request):
    path = _FILES[request.param]()
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if request.param == "smollm2":
        # transformers' GGUF loader has no entry for the `smollm` pre-tokenizer and falls back to plain
        # GPT-2 splitting. SmolLM2's own tokenizer.json (and llama.cpp's `smollm` regexes) isolate each
        # digit first, so " 5" is [" ", "5"], never " 5". Give the reference the real pre-tokenizer.
        assert hf.encode("x  5", add_special_tokens=False) != Tokenizer.from_gguf(readers("smollm2")).encode("x  5")
        hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return request.param, Tokenizer.from_gguf(readers(request.param)), hf


def test_ids_match_transformers(pair):
    which, ours, hf = pair
    for text in CORPUS + _random_corpus():
        want = hf.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == want, repr(text)
        if not text.startswith(hf.bos_token or "\0"):
            assert ours.encode(text) == hf.encode(text), repr(text)


def test_decode_matches_transformers(pair):
    which, ours, hf = pair
    for text in CORPUS + _random_corpus(seed=1):
        ids = hf.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), repr(text)
        if not any(s in text for s in ("<bos>", "<eos>", "<|", "<start_of", "<end_of")):
            assert ours.decode(ids) == text


def test_token_bytes_rebuild_the_text(pair):
    """token_bytes: the bytes each token adds (logprobs' `bytes`), including tokens that hold part of a
    UTF-8 character (byte-level BPE's byte alphabet, SentencePiece's <0xNN> byte fallback): joined, they
    are the decoded text's UTF-8, and a token whose bytes are whole characters reads as transformers'
    piece does."""
    which, ours, hf = pair
    partial = 0
    for text in CORPUS + _random_corpus(seed=2):
        ids = ours.encode(text, add_special_tokens=False)
        pieces = [ours.token_bytes(i) for i in ids]
        assert b"".join(pieces).decode("utf-8") == ours.decode(ids, skip_special_tokens=False), repr(text)
        for p in pieces:
            try:
                p.decode("utf-8")
            except UnicodeDecodeError:
                partial += 1
    assert partial > 0  # the emoji and CJK lines do split characters across tokens
    word = ours.encode(" hello", add_special_tokens=False)
    assert len(word) == 1 and ours.token_bytes(word[0]) == b" hello"


def test_properties(pair):
    which, ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token, ours.eos_token) == (hf.bos_token, hf.eos_token)
    assert ours.bos_token_id == hf.bos_token_id and ours.eos_token_id == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.special_ids == set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert ours.chat_template == hf.chat_template
    for i in (0, 1, 2, 100, 1000, ours.vocab_size - 1):
        assert ours.id_to_token(i) == hf.convert_ids_to_tokens(i)
        assert ours.token_to_id(ours.id_to_token(i)) == i
    if which == "gemma3":
        assert ours.add_bos and ours.eos_token_ids == {1, 106}  # <eos>, <end_of_turn>
        assert ours.encode("hi") == ours.encode("<bos>hi") == [2, ours.token_to_id("hi")]  # never two BOS
    else:
        assert not ours.add_bos and ours.eos_token_ids == {2, 0}  # <|im_end|>, <|endoftext|>
        assert ours.encode("hi") == hf.encode("hi")


STREAMS = [
    "Sure! 🎉👍🏽 Here is 中文 and 日本語 text, then 👨‍👩‍👧‍👦 and 𝔹𝕆𝕃𝔻 — done. ✓",
    "🚀🚀🚀 ẞ ǅ 𝄞 𐍈 한국어 ",
    "plain ascii then 表情符号😀😃😄 and café",
]


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer(pair, chunk):
    which, ours, _ = pair
    prompt = ours.encode("Tell me something:")
    for text in STREAMS:
        ids = ours.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(ours, prompt, skip_special_tokens=True)
        deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == detok.text == ours.decode(ids) == text
        assert detok.flush() == ""
    # byte-fallback / byte-level pieces really are split mid-character in these streams
    assert any("\ufffd" in ours.decode([i]) for i in ours.encode(STREAMS[1], add_special_tokens=False))


def test_incremental_detokenizer_special_and_bounded(pair):
    which, ours, _ = pair
    eos = ours.eos_token_id
    ids = ours.encode("word " * 400, add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, [], skip_special_tokens=False)
    for t in ids:
        detok.add([t])
        assert len(detok._ids) < 80  # the decode window stays small however long the stream
    assert detok.add([eos]) == ours.eos_token
    assert detok.text == ours.decode(ids + [eos], skip_special_tokens=False)
    held = IncrementalDetokenizer(ours, [], skip_special_tokens=True)
    cut = [i for i in ours.encode("🚀", add_special_tokens=False)]
    if len(cut) > 1:  # an unfinished character is held back, and flush() releases it at the end
        assert held.add(cut[:1]) == ""
        assert held.flush() == ours.decode(cut[:1])


def test_from_dir_roundtrip(pair, tmp_path):
    which, ours, hf = pair
    if which == "gemma3":
        pytest.skip("same code path as SmolLM2; saving Gemma's 262k-token tokenizer.json is slow")
    hf.save_pretrained(tmp_path)
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.chat_template == hf.chat_template
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                                 hf.pad_token_id)
    assert loaded.add_bos == ours.add_bos and loaded.special_ids == ours.special_ids
    for text in CORPUS:
        assert loaded.encode(text) == hf.encode(text), repr(text)
        assert loaded.decode(loaded.encode(text), False) == hf.decode(hf.encode(text))
