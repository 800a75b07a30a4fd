"""Tokenizers for the runtime: from a HF directory (tokenizer.json) or rebuilt from GGUF metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of one (vocabulary, merges or scores,
token types, pre-tokenizer family). We rebuild an equivalent `tokenizers.Tokenizer`:
  * `gpt2` model: byte-level BPE from vocab + merges, split by the regex of the `tokenizer.ggml.pre`
    family (the same splits llama.cpp applies), byte-level decoder;
  * `llama` model (SentencePiece): BPE with byte fallback whose merges are derived from the
    vocabulary, best piece first (by score; Gemma by file order, as its scores do not rank merges).
Control tokens become special added tokens and user-defined ones plain added tokens, so both are
matched whole in text. BOS/EOS are added here rather than by a post-processor, so a prompt that a
chat template already started with BOS never gets a second one.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

log = logging.getLogger(__name__)

# Pre-tokenizer split regexes of llama.cpp's `tokenizer.ggml.pre` families (byte-level BPE).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRES = {"gpt2", "gpt-2", "default", "phi-2", "stablelm2", "olmo", "mpt", "jais", "poro-chat", "bloom"}
_DIGIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}  # \p{N} then gpt2
_LLAMA3_PRES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx"}
_QWEN2_PRES = {"qwen2", "deepseek-r1-qwen", "megrez"}

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


def _gpt2_byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted: char -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_GPT2_BYTE_OF = _gpt2_byte_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_pre(pre: str | None):
    pre = (pre or "default").lower()
    if pre in _DIGIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT if pre in _QWEN2_PRES else None
    if split is not None:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in _GPT2_PRES:
        log.warning("unknown GGUF pre-tokenizer %r: splitting text with the GPT-2 regex", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _spm_merges(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's "merge the best-scoring adjacent pair" rule.

    Every split of a piece into two vocabulary pieces becomes a merge ranked by the piece's priority
    (ties: longer left part first, then file order), the ranking transformers uses for GGUF files.
    """
    merges = []
    for piece, score in priority.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-score, -k, k - len(piece), left, right))
    merges.sort(key=lambda m: m[:3])  # stable: equal keys keep file order
    return [(m[3], m[4]) for m in merges]


def _content(tok) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what the runtime needs around it (BOS/EOS policy, chat template)."""

    def __init__(self, tok: HFTokenizer, *, bos_token_id: int | None = None, eos_token_ids: Iterable[int] = (),
                 pad_token_id: int | None = None, add_bos: bool = False, add_eos: bool = False,
                 chat_template: str | None = None, vocab_size: int | None = None):
        self._tok = tok
        self.bos_token_id = bos_token_id
        eos = [int(i) for i in eos_token_ids]
        self.eos_token_id: int | None = eos[0] if eos else None
        self.eos_token_ids: set[int] = set(eos)
        self.pad_token_id = pad_token_id
        self.add_bos = bool(add_bos and bos_token_id is not None)
        self.add_eos = bool(add_eos and self.eos_token_id is not None)
        self.chat_template = chat_template
        self.vocab_size = max(int(vocab_size or 0), tok.get_vocab_size(with_added_tokens=True))
        self.special_ids: set[int] = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._tok.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._tok.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos and (not ids or ids[0] != self.bos_token_id):
                ids.insert(0, self.bos_token_id)
            if self.add_eos:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def token_bytes(self, i: int) -> bytes:
        """The bytes one token adds to the text (for logprobs: a token can hold part of a UTF-8
        character, which decoding it alone turns into U+FFFD). Byte-level BPE pieces map back through
        GPT-2's byte alphabet; SentencePiece pieces are '▁' for a space and <0xNN> byte-fallback tokens;
        added tokens are their own text; anything else, the token decoded alone."""
        i = int(i)
        piece = self._tok.id_to_token(i)
        if piece is None:
            return b""
        if i in self._added_ids:
            return piece.encode("utf-8")
        if self._piece_kind == "byte_level" and all(c in _GPT2_BYTE_OF for c in piece):
            return bytes(_GPT2_BYTE_OF[c] for c in piece)
        if self._piece_kind == "spm":
            m = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode("utf-8")
        return self._tok.decode([i], skip_special_tokens=False).encode("utf-8")

    @functools.cached_property
    def _added_ids(self) -> set[int]:
        return set(self._tok.get_added_tokens_decoder())

    @functools.cached_property
    def _piece_kind(self) -> str:
        """'byte_level', 'spm' or 'other', from the tokenizer's decoder."""
        dec = json.loads(self._tok.to_str()).get("decoder") or {}
        steps = dec.get("decoders", [dec]) if dec.get("type") == "Sequence" else [dec]
        types = {d.get("type") for d in steps}
        spm = "Metaspace" in types or any(
            d.get("type") == "Replace" and (d.get("pattern") or {}).get("String") == "\u2581" for d in steps)
        return "byte_level" if "ByteLevel" in types else "spm" if spm else "other"

    def token_to_id(self, s: str) -> int | None:
        return self._tok.token_to_id(s)

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json + tokenizer_config.json (e.g. for a tokenizer rebuilt from GGUF metadata).

        from_dir reads them back with the same BOS/EOS policy and chat template; a post-processor that
        adds BOS/EOS is attached for other readers (transformers), ours encodes without it."""
        from tokenizers import processors

        path = Path(path)
        tok = HFTokenizer.from_str(self._tok.to_str())
        if (self.add_bos or self.add_eos) and tok.post_processor is None:
            pre = [self.bos_token] if self.add_bos else []
            post = [self.eos_token] if self.add_eos else []
            ids = {t: self._tok.token_to_id(t) for t in pre + post}
            tok.post_processor = processors.TemplateProcessing(
                single=" ".join(pre + ["$A"] + post), pair=" ".join(pre + ["$A"] + post + ["$B"] + post),
                special_tokens=list(ids.items()))
        tok.save(str(path / "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos,
               "add_eos_token": self.add_eos, "bos_token": self.bos_token, "eos_token": self.eos_token,
               "pad_token": None if self.pad_token_id is None else self._tok.id_to_token(self.pad_token_id)}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def synthetic(cls, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """For random-weight models: ids < 256 are bytes (byte-level BPE, no merges), id i >= 256
        decodes to " t<i>". Text encodes to bytes, so any text round-trips."""
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab = {ch: i for i, ch in enumerate(alphabet)}
        vocab.update({f"\u0120t{i}": i for i in range(len(alphabet), vocab_size)})  # U+0120 = a space
        tok = HFTokenizer(BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return cls(tok, eos_token_ids=eos_token_ids, add_bos=False)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """A HF tokenizer directory: tokenizer.json plus the config files around it."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))

        def load(name: str) -> dict:
            p = path / name
            return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}

        tcfg, smap, gcfg, mcfg = (load(n) for n in ("tokenizer_config.json", "special_tokens_map.json",
                                                     "generation_config.json", "config.json"))

        def token_id(name: str, *id_sources) -> int | None:
            text = _content(tcfg.get(name)) or _content(smap.get(name))
            if text is not None and tok.token_to_id(text) is not None:
                return tok.token_to_id(text)
            for src in id_sources:
                if (ids := _ids(src.get(f"{name}_id"))):
                    return ids[0]
            return None

        bos = token_id("bos_token", gcfg, mcfg)
        eos = [i for i in [token_id("eos_token", gcfg, mcfg)] if i is not None]
        for src in (gcfg, mcfg):
            eos += [i for i in _ids(src.get("eos_token_id")) if i not in eos]
        pad = token_id("pad_token", gcfg, mcfg)

        add_bos, add_eos = tcfg.get("add_bos_token"), tcfg.get("add_eos_token")
        if add_bos is None or add_eos is None:  # ask the post-processor what it adds
            plain, full = tok.encode("a", add_special_tokens=False).ids, tok.encode("a").ids
            if add_bos is None:
                add_bos = bos is not None and len(full) > len(plain) and full[0] == bos
            if add_eos is None:
                add_eos = bool(eos) and len(full) > len(plain) and full[-1] in eos

        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(ct := tcfg.get("chat_template"), str):
            template = ct
        elif isinstance(ct, list) and ct:  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in ct}
            template = named.get("default") or ct[0].get("template")
        elif (path / "chat_template.json").is_file():  # a processor's template (llava-hf checkpoints)
            ct = json.loads((path / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
            template = ct if isinstance(ct, str) else None
        return cls(tok, bos_token_id=bos, eos_token_ids=eos, pad_token_id=pad, add_bos=bool(add_bos),
                   add_eos=bool(add_eos), chat_template=template)

    @classmethod
    def from_gguf(cls, readers) -> "Tokenizer":
        """Rebuild the tokenizer a GGUF file describes (readers: one GGUFReader or a list of shards)."""
        from jaxserve.loader.gguf_loader import eog_token_ids, meta_get

        def m(key, default=None):
            return meta_get(readers, f"tokenizer.ggml.{key}", default)

        model_type = m("model")
        tokens = original = m("tokens")
        if not tokens:
            raise ValueError("GGUF file has no tokenizer.ggml.tokens")
        types = m("token_type") or [1] * len(tokens)
        arch = meta_get(readers, "general.architecture", "")
        unk = m("unknown_token_id")

        if model_type == "gpt2":
            vocab = {t: i for i, t in enumerate(tokens)}
            merges = [tuple(x.split(" ", 1)) for x in (m("merges") or [])]
            llama3 = (m("pre") or "").lower() in _LLAMA3_PRES  # llama.cpp looks whole words up first
            tok = HFTokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=llama3))
            tok.pre_tokenizer = _byte_level_pre(m("pre"))
            tok.decoder = decoders.ByteLevel()
        elif model_type == "llama":
            # a piece made only of spaces is spelt with real spaces in some files; text reaches the
            # model with spaces already turned into "▁", so spell the piece that way too
            tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
            vocab = {t: i for i, t in enumerate(tokens)}
            if arch.startswith("gemma"):
                priority = {t: -float(i) for i, t in enumerate(tokens)}
            else:
                scores = m("scores") or [0.0] * len(tokens)
                priority = dict(zip(tokens, (float(s) for s in scores)))
            tok = HFTokenizer(BPE(vocab=vocab, merges=_spm_merges(vocab, priority), byte_fallback=True,
                                  fuse_unk=True, unk_token=tokens[unk] if unk is not None else None))
            prefix = bool(m("add_space_prefix", not arch.startswith("gemma")))
            steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            if arch.startswith("gemma") and not prefix:
                tok.normalizer = normalizers.Replace(" ", "▁")
            else:
                tok.pre_tokenizer = pre_tokenizers.Metaspace(
                    replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
                if prefix:
                    steps.append(decoders.Strip(" ", 1, 0))
            tok.decoder = decoders.Sequence(steps)
        else:
            raise ValueError(f"GGUF tokenizer model {model_type!r} is not supported (supported: gpt2, llama)")

        control = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(original, types) if ty == TOKEN_CONTROL and t]
        tok.add_special_tokens(control)
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(original, types) if ty == TOKEN_USER_DEFINED and t in vocab]
        tok.add_tokens(user)

        add_bos = m("add_bos_token")
        if add_bos is None:  # llama.cpp's default: sentencepiece vocabularies start with BOS
            add_bos = model_type == "llama"
        return cls(tok, bos_token_id=m("bos_token_id"), eos_token_ids=eog_token_ids(readers),
                   pad_token_id=m("padding_token_id"), add_bos=bool(add_bos),
                   add_eos=bool(m("add_eos_token", False)),
                   chat_template=meta_get(readers, "tokenizer.chat_template"), vocab_size=len(tokens))


class IncrementalDetokenizer:
    """Streams text for generated tokens, vLLM-style: decode only a short window of recent tokens.

    `prefix` is the window start, `read` the end of what was already emitted. Each step decodes
    tokens[prefix:read] and tokens[prefix:]; the difference is the new text. Text is held back while
    it ends in U+FFFD (an incomplete UTF-8 character split across tokens).
    """

    _CONTEXT = 5  # prompt tokens kept as left context (spacing/merging depends on the previous token)

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids)[-self._CONTEXT:]
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def add(self, token_ids: Iterable[int]) -> str:
        """Append generated tokens; return the newly completed text (possibly "")."""
        delta = []
        for t in token_ids:
            t = int(t)
            if self._skip and t in self._tokenizer.special_ids:
                continue  # decodes to nothing: keeping it would only widen the window
            self._ids.append(t)
            delta.append(self._step())
        out = "".join(delta)
        self.text += out
        return out

    def flush(self) -> str:
        """At end of stream: emit whatever was held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._prefix, self._read)
        full = self._decode(self._prefix, len(self._ids))
        out = full[len(prefix_text):] if len(full) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += out
        return out

    def _decode(self, a: int, b: int) -> str:
        return self._tokenizer.decode(self._ids[a:b], skip_special_tokens=self._skip)

    def _step(self) -> str:
        prefix_text = self._decode(self._prefix, self._read)
        full = self._decode(self._prefix, len(self._ids))
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            if self._prefix > 64:  # drop tokens the window can no longer reach
                self._ids = self._ids[self._prefix:]
                self._read -= self._prefix
                self._prefix = 0
            return full[len(prefix_text):]
        return ""
