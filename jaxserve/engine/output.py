"""Turning sampled tokens into text: incremental detokenisation and stop strings. No JAX.

Stop strings can span several tokens, so text that could still become the start of a stop string is
held back from the stream until it cannot (or the sequence ends): nothing of a stop string ever leaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.engine.sequence import Sequence


@dataclass
class SeqOutput:
    """What changed for one sequence in one engine step."""

    seq: Sequence
    new_token_ids: list[int]
    new_text: str  # text that is now final and may be streamed
    finished: bool
    new_logprobs: list = field(default_factory=list)


class TextState:
    """Per-sequence detokeniser + stop-string matcher."""

    def __init__(self, seq: Sequence, tokenizer):
        from jaxserve.loader.tokenizer import IncrementalDetokenizer

        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids,
                                            skip_special_tokens=seq.params.skip_special_tokens)
        self.text = ""  # all decoded output text (possibly containing a stop string at the end)
        self.emitted = 0  # chars of self.text already handed out
        self.num_tokens = 0  # output tokens consumed
        stops = seq.params.stop
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def consume(self) -> tuple[list[int], str, list, str | None]:
        """Take the tokens appended since last call.

        Returns (new ids, new emittable text, new logprobs, stop string hit or None). On a hit the
        tokens after it are dropped and the caller must finish the sequence (freeing its blocks)."""
        seq = self.seq
        new_ids = seq.output_token_ids[self.num_tokens:]
        new_lps = seq.output_logprobs[self.num_tokens:] if seq.output_logprobs else []
        start = self.num_tokens
        self.num_tokens = len(seq.output_token_ids)
        stops = seq.params.stop
        hit_stop = None
        p = seq.params
        last = len(seq.output_token_ids) - 1
        for j, tok in enumerate(new_ids):
            if (start + j == last and seq.is_finished and seq.ended_on_token
                    and not p.include_stop_str_in_output):
                continue  # the EOS / stop token's own text is not output (vLLM's rule)
            delta = self.detok.add([tok])
            if not delta:
                continue
            search_from = max(0, len(self.text) - self.holdback)
            self.text += delta
            # none of the first min_tokens output tokens ends the output (as EOS / stop ids in _stops)
            if stops and start + j + 1 > p.min_tokens:
                hit = self._find_stop(search_from)
                if hit is not None:
                    pos, s = hit
                    end = pos + len(s) if p.include_stop_str_in_output else pos
                    self.text = self.text[:end]
                    # Tokens after the one that completed the stop string are dropped.
                    keep = start + j + 1
                    del seq.output_token_ids[keep:]
                    if seq.output_logprobs:
                        del seq.output_logprobs[keep:]
                    new_ids = new_ids[:j + 1]
                    new_lps = new_lps[:j + 1] if new_lps else new_lps
                    self.num_tokens = keep
                    hit_stop = s
                    break
        if seq.is_finished and hit_stop is None:
            self.text += self.detok.flush()  # an incomplete character at the very end
        if seq.is_finished or hit_stop is not None:
            limit = len(self.text)
        else:
            limit = max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:limit]
        self.emitted = limit
        return new_ids, out, new_lps, hit_stop

    def _find_stop(self, search_from: int):
        best = None
        for s in self.seq.params.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best
