"""Structured output — JSON schema, any JSON object, regex, a fixed choice, a Lark grammar: the host
half. No JAX.

A constrained sequence carries a `GrammarMatcher`. Before each step that samples for it, the runner
asks the matcher for a bitmask of the tokens that keep the output inside the grammar (the sampler sets
every other logit to -inf, sampler.apply_token_mask); after each sampled token the scheduler feeds the
token to the matcher, and the sequence ends when the grammar is complete. The masks come from
llguidance (an Earley parser walked over the tokenizer's token trie; ~0.05 ms a mask for SmolLM2's
49k tokens), imported only when a request asks for structured output.

A step's mask depends on the token sampled just before it, so a batch that holds a constrained
sequence decodes one token per dispatch and is never scheduled ahead (the other sequences in that
batch lose multi-step decoding while it runs; their tokens are the same).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# Between JSON tokens: at most this many whitespace characters (a newline and indentation for a few
# levels of pretty-printing). llguidance's default allows any number, and a small model can then emit
# whitespace until max_tokens without ever closing the object.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class StructuredOutputError(ValueError):
    """The requested grammar is invalid (a 400 for the server)."""

    param = "response_format"


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: exactly one of the fields.

    json_schema: a JSON Schema (dict, or its JSON text); json_object: any JSON object; regex: a
    regular expression (Rust `regex` syntax) the whole output matches; choice: one of these strings
    exactly; grammar: a Lark grammar (llguidance's dialect: `start: ...`).
    """

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # a reasoning model's answer (the server's --reasoning-parser): the grammar starts after the
    # model's <think>...</think>, which is free (AfterReasoning)
    after_reasoning: bool = False

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(
                f"structured output needs exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
        if isinstance(self.json_schema, str):
            try:
                json.loads(self.json_schema)
            except ValueError as e:
                raise StructuredOutputError(f"json_schema is not valid JSON: {e}") from None
        elif self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise StructuredOutputError("json_schema must be a JSON object")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @functools.cached_property
    def grammar_text(self) -> str:
        """llguidance's grammar text for this constraint, made once per spec (the server, the engine's
        checks and each sequence's matcher all ask for it)."""
        llg = _llguidance()
        # overrides, not defaults: a schema's own "x-guidance" options must not lift the bound
        opts = {"whitespace_pattern": JSON_WHITESPACE}
        if self.json_object:
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=opts)
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                schema = json.loads(schema)
            try:
                return llg.LLMatcher.grammar_from_json_schema(closed_objects(schema), overrides=opts)
            except ValueError as e:
                raise StructuredOutputError(f"invalid json_schema: {e}") from None
        if self.regex is not None:
            return llg.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # One lexer terminal (uppercase), not parser alternatives: thousands of choices compile into
            # the lexer's automaton (20k: 0.08 s) instead of exceeding the parser's items per row (2000).
            # Lark string literals: JSON's escapes are a subset of what they accept.
            return llg.LLMatcher.grammar_from_lark(
                "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in self.choice))
        return llg.LLMatcher.grammar_from_lark(self.grammar)


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUB_SCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
               "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_SUB_LIST = ("anyOf", "oneOf", "prefixItems")  # not allOf: closing one branch would refuse the others' properties
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


MAX_SCHEMA_DEPTH = 64  # nesting of sub-schemas; deeper is a 400 (and no Python recursion limit is hit)


def closed_objects(schema, depth: int = 0):
    """A copy of a JSON schema in which an object that lists its properties (even none) accepts no
    others unless it says so (additionalProperties / patternProperties / unevaluatedProperties
    present) — as OpenAI's strict mode requires and vLLM's default grammar backend assumes. JSON
    Schema's own default (any extra property) lets a model write properties it invents until
    max_tokens. A bare {"type": "object"} stays open (any object)."""
    if not isinstance(schema, dict):
        return schema
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    sub = lambda x: closed_objects(x, depth + 1)
    out = dict(schema)
    for k in _SUB_SCHEMA:
        if k in out:
            v = out[k]
            out[k] = [sub(x) for x in v] if isinstance(v, list) else sub(v)
    for k in _SUB_LIST:
        if isinstance(out.get(k), list):
            out[k] = [sub(x) for x in out[k]]
    for k in _SUB_MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: sub(x) for name, x in out[k].items()}
    if (isinstance(out.get("properties"), dict)
            and not any(k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))):
        out["additionalProperties"] = False
    return out


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a declared dependency; say what is missing rather than a bare ImportError
        raise StructuredOutputError(f"structured output needs the llguidance package ({e})") from None
    return llguidance


class GrammarCompiler:
    """One per engine: the tokenizer's llguidance view (built once, on first use: ~0.2 s for a 49k
    vocabulary), compiled grammars, and the width of the sampler's mask rows."""

    CACHE_SIZE = 64

    def __init__(self, tokenizer, vocab_size: int):
        self._hf_json = tokenizer.backend.to_str()
        self._eos = sorted(tokenizer.eos_token_ids) or None
        self._n_tok = tokenizer.backend.get_vocab_size(with_added_tokens=True)
        # <think> and </think> as single tokens (reasoning models); None where the vocabulary lacks them
        ids = tuple(tokenizer.backend.token_to_id(t) for t in THINK_TAGS)
        self._think = ids if None not in ids else None
        self.vocab_size = int(vocab_size)  # logits width (may exceed the tokenizer's: padded embeddings)
        self._lltok = None
        self._lock = threading.Lock()  # the server validates requests on several threads
        self._cache: OrderedDict = OrderedDict()

    @property
    def lltokenizer(self):
        with self._lock:
            if self._lltok is None:
                llg = _llguidance()
                try:
                    self._lltok = llg.LLTokenizer(self._hf_json, n_vocab=self._n_tok, eos_token=self._eos)
                except Exception as e:  # a tokenizer llguidance cannot read: a clear 400, not a 500
                    self._lltok = StructuredOutputError(
                        f"structured output is not available for this model's tokenizer: {e}")
            if isinstance(self._lltok, Exception):
                raise self._lltok
            return self._lltok

    def matcher(self, spec: StructuredOutput, prompt_ids: list[int] | None = None):
        """A fresh matcher at the start of the output; StructuredOutputError for an invalid grammar.
        With spec.after_reasoning (and <think> / </think> single tokens), an AfterReasoning around it:
        prompt_ids tell whether the prompt already opened the thinking.
        Compiled grammars are kept (LRU, CACHE_SIZE): the same spec again — a request's n choices and
        prompts, the engine's checks after the server's — is a copy (~1 us), not a compile (a large
        enum: ~0.3 s)."""
        try:
            grammar = spec.grammar_text
        except (ValueError, RecursionError, TypeError) as e:
            if isinstance(e, StructuredOutputError):
                raise
            raise StructuredOutputError(f"invalid {spec.kind}: {e}") from None
        with self._lock:
            base = self._cache.get(grammar)
            if base is not None:
                self._cache.move_to_end(grammar)
        if base is None:
            base = self._compile(spec, grammar)
            with self._lock:
                self._cache[grammar] = base
                while len(self._cache) > self.CACHE_SIZE:
                    self._cache.popitem(last=False)
        m = GrammarMatcher(base.deep_copy(), self.vocab_size)
        if not spec.after_reasoning or self._think is None:
            return m  # no thinking tags in this vocabulary: the grammar holds from the first token
        start, end = self._think
        ids = list(prompt_ids or ())
        last_start = max((i for i, t in enumerate(ids) if t == start), default=-1)
        opened = last_start >= 0 and end not in ids[last_start:]
        return AfterReasoning(m, start, end, opened)

    def _compile(self, spec: StructuredOutput, grammar: str):
        llg = _llguidance()
        try:
            m = llg.LLMatcher(self.lltokenizer, grammar, log_level=0)
        except (ValueError, RecursionError, TypeError) as e:  # e.g. a lone surrogate in a regex
            raise StructuredOutputError(f"invalid {spec.kind}: {e}") from None
        if m.is_error():
            raise StructuredOutputError(f"invalid {spec.kind}: {_first_line(m.get_error())}")
        # The first mask, on a copy: a grammar no output can satisfy (e.g. the regex [^\s\S]) fails here as a
        # 400 instead of ending its reply at the first token with an empty 200. It also builds the lexer states
        # the copies share here, off the engine thread (a{1000000}: ~0.3 s that would stall a step).
        probe = m.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise StructuredOutputError(f"invalid {spec.kind}: no output can satisfy it "
                                        f"({_first_line(probe.get_error())})")
        return m


def _first_line(msg: str) -> str:
    # llguidance appends its parser state and the whole grammar to errors: keep the message itself
    return msg.split("\n<state>")[0].split("\n<grammar>")[0].strip()


THINK_TAGS = ("<think>", "</think>")


class AfterReasoning:
    """A grammar that starts once the model's reasoning has ended (vLLM's reasoning-aware structured
    output): inside <think>...</think> every token is allowed; after </think> the grammar holds. When
    the prompt has not opened the thinking, the first token may be <think> (the model thinks first)
    or what the grammar allows (it answers at once: a model that does not think, or thinking
    switched off in the prompt)."""

    def __init__(self, inner: "GrammarMatcher", start: int, end: int, opened: bool):
        self.inner, self.start, self.end = inner, start, end
        self.phase = "thinking" if opened else "first"
        self.words = inner.words

    def mask(self) -> np.ndarray:
        if self.phase == "thinking":
            return np.full(self.words, 0xFFFFFFFF, np.uint32)
        m = self.inner.mask()
        if self.phase == "first":
            m[self.start // 32] |= np.uint32(1 << (self.start % 32))
        return m

    def accept(self, token: int) -> bool:
        if self.phase == "thinking":
            if int(token) == self.end:
                self.phase = "answer"
            return True
        if self.phase == "first":
            if int(token) == self.start:
                self.phase = "thinking"
                return True
            self.phase = "answer"
        return self.inner.accept(token)

    @property
    def done(self) -> bool:
        return self.phase == "answer" and self.inner.done

    @property
    def error(self) -> str:
        return self.inner.error


def mask_words(vocab_size: int) -> int:
    """u32 words of one mask row: bit t of word t // 32 is token t."""
    return -(-int(vocab_size) // 32)


class GrammarMatcher:
    """A sequence's position in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.words = mask_words(vocab_size)

    def mask(self) -> np.ndarray:
        """u32 [words]: the tokens allowed next (EOS once the output is complete). Tokens past the
        tokenizer's vocabulary (embedding padding) are never allowed."""
        bits = np.frombuffer(self._m.compute_bitmask(), np.uint32)
        out = np.zeros(self.words, np.uint32)
        n = min(len(bits), self.words)
        out[:n] = bits[:n]
        return out

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        return bool(self._m.consume_token(int(token))) and not self._m.is_error()

    @property
    def done(self) -> bool:
        """The output is complete and nothing more can follow (only EOS is allowed)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return _first_line(self._m.get_error()) if self._m.is_error() else ""
