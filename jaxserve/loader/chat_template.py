"""Rendering a model's Jinja chat template, in the environment transformers' apply_chat_template uses.

Templates come from model files, so they are untrusted code: they run in jinja2's immutable sandbox,
and everything they see is rebuilt from plain JSON-like data first. The environment matches
transformers (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, a
`tojson` that keeps non-ASCII and takes an indent, and a no-op `{% generation %}` block) so a prompt
renders byte-for-byte as it would there.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateMissing(ValueError):
    """The model ships no chat template, so chat messages cannot be turned into a prompt."""


class ChatTemplateError(ValueError):
    """The template failed to render these messages (the server answers 400 with the message)."""


class _GenerationBlock(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; render the body.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes and always sorts keys; templates expect plain json.dumps
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes (no reaching into Python internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


def _dict(*args, **kwargs):
    return dict(*args, **kwargs)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=_dict)
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """A copy made only of JSON-like builtins (objects with methods never reach the sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _with_reasoning_aliases(message: dict) -> dict:
    # templates read a message's reasoning as `reasoning_content` (most) or `thinking` (gpt-oss)
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """A compiled chat template plus the special-token strings templates refer to."""

    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None):
        if not source:
            raise ChatTemplateMissing("this model has no chat template; use the completions endpoint "
                                      "or provide a chat template")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _compile(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    def render(self, messages: list, tools: list | None = None, add_generation_prompt: bool = True,
               **extra) -> str:
        """The prompt text for `messages` (dicts with role/content, as the OpenAI API sends them)."""
        msgs = _plain(list(messages))
        for m in msgs:
            if not isinstance(m, dict):
                raise ChatTemplateError(f"chat messages must be objects, got {m!r}")
        msgs = [_with_reasoning_aliases(m) for m in msgs]
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, "documents": None}
        context.update(_plain(extra))
        try:
            return self._template.render(messages=msgs, tools=_plain(tools),
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e) or type(e).__name__) from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # a template indexing a message field that is not there, etc.: the request's fault
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
