"""Reasoning parsers (`--reasoning-parser`): a thinking model's `<think>...</think>` text goes to the
chat message's `reasoning_content` (DeepSeek's API field, as vLLM and llama.cpp's server give it) and
only what follows to `content`, in whole replies and in streams alike.

    deepseek_r1  the reply starts inside the thinking (DeepSeek-R1 and its distills, Qwen3 *-Thinking-2507,
                 QwQ: their templates open `<think>` in the prompt; a leading `<think>` is dropped): all
                 text up to `</think>` is reasoning; without `</think>` (cut by max_tokens) all of it.
    qwen3        Qwen3 hybrid models: reasoning only when the reply begins with `<think>` (leading
                 whitespace aside); with thinking switched off (`chat_template_kwargs:
                 {"enable_thinking": false}`) the reply is all content.

Both stream through ReasoningSplitter, which holds back a possible partial tag at the end of a delta
so that a tag split across deltas is still recognized; `split` of the whole text gives what the
stream gives.
"""

from __future__ import annotations

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


class ReasoningSplitter:
    """Feed a reply's text deltas; get (reasoning delta, content delta) pairs."""

    def __init__(self, kind: str):
        if kind not in PARSERS:
            raise ValueError(f"unknown reasoning parser {kind!r}; known: {', '.join(PARSERS)}")
        self.kind = kind
        # "start": before the reply's first non-space text (a leading <think> may come);
        # "reasoning": inside the thinking; "content": after it (or never in it)
        self.mode = "start"
        self.buf = ""  # text held back: leading text not yet decided, or a possible partial tag

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while True:
            if self.mode == "start":
                lead = self.buf.lstrip()
                if lead.startswith(START):
                    self.buf, self.mode = lead[len(START):], "reasoning"
                elif START.startswith(lead) and not final:
                    break  # only whitespace or a prefix of <think> so far: undecided
                else:
                    self.mode = "reasoning" if self.kind == "deepseek_r1" else "content"
                continue
            if self.mode == "content":
                content.append(self.buf)
                self.buf = ""
                break
            i = self.buf.find(END)
            if i >= 0:
                reasoning.append(self.buf[:i])
                self.buf, self.mode = self.buf[i + len(END):], "content"
                continue
            keep = 0 if final else _partial_tail(self.buf, END)
            reasoning.append(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return "".join(reasoning), "".join(content)


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (a tag that may be cut)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split(kind: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply; None for a part that is empty."""
    r, c = ReasoningSplitter(kind).feed(text, final=True)
    return r or None, c or None
