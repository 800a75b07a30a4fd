"""Speculative decoding: prompt lookup (vLLM's "ngram" method; host side, no JAX), the verification both
methods share, and the drafting pauses. The draft-model method's proposals: engine/draft_model.py.

A sequence whose last tokens (an n-gram, longest first from prompt_lookup_max down to prompt_lookup_min)
occurred earlier in its prompt or output proposes the k tokens that followed that occurrence. The step
then feeds [last token, draft...] as one chunk of a mixed step, and the sampler picks a token after every
position of the chunk (step.py: "verify"): the argmax for greedy requests; for sampled ones (temperature,
top-k, top-p, min-p) the very draw a plain decode would make there, since the sampler's noise is keyed by
the request's seed and the sampled position only. The longest prefix of the draft equal to those picks is
kept, plus the pick where the first mismatch is (or, when every draft token matched, the token sampled
after the chunk). Each kept draft token is the token decoding without drafts would have produced, given
the same tokens before it, so the output is that of decoding without drafts (up to float rounding of the
logits), 1 to k + 1 tokens for one forward pass over k + 1 positions; a sampled draft token is kept with
the probability the model gives it (as rejection sampling with a one-token draft keeps it). A win where
text repeats its context (quoting, editing, code, extraction), nothing proposed (a plain decode) where
it does not.

Penalties, logit bias and min_tokens apply at each drafted row as a plain decode would apply them after
the same tokens (the penalty counts include the draft tokens before the row; only the kept ones are
counted afterwards). Grammars need each token on the host: constrained sequences do not draft. Logprobs
come from the drafted rows.
"""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix n-gram of `tokens` (n from
    n_max down to n_min): the most recent occurrence followed by k tokens, else the earliest (the
    longest continuation; in a run like "a a a a" the latest one is followed by a single token); []
    when none occurred."""
    L = len(tokens)
    if k <= 0 or L < n_min + 1:
        return []
    arr = np.asarray(tokens, np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n:]
        # windows starting at 0 .. L-n-1 (the suffix itself excluded), each followed by >= 1 token
        win = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)
        hits = np.flatnonzero((win == suffix).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= L]
            i = int(full[-1] if full.size else hits[0]) + n
            return [int(t) for t in arr[i:i + k]]
    return []


def agreeing(draft, picks) -> int:
    """How many of the draft's tokens, from the first, equal the model's picks at their positions (the kept
    prefix; the scheduler keeps them, the runner counts them for the penalties)."""
    n = 0
    while n < len(draft) and picks[n] == draft[n]:
        n += 1
    return n


# A draft model's tokens are not known while scheduling: the scheduler reserves k positions holding PENDING,
# and the engine fills them (engine/draft_model.py) before the step is dispatched.
PENDING = -1


# A drafted step leaves the on-device multi-step decode loop (a mixed program and a host round trip per
# token), so drafts the model refuses cost far more than they would in a plain decode: measured on an H100,
# 32 sequences whose drafts were 95% wrong decoded 552 tok/s against 4,170 without drafting. A sequence
# whose draft is mostly refused (fewer than half its tokens accepted) pauses drafting for BACKOFF_FIRST
# output tokens, doubling up to BACKOFF_MAX on each such draft; a wholly accepted draft ends the pauses.
BACKOFF_FIRST = 8
BACKOFF_MAX = 128


def _next_backoff(backoff: int) -> int:
    return min(BACKOFF_MAX, 2 * backoff if backoff else BACKOFF_FIRST)


def after_verify(seq, drafted: int, accepted: int) -> None:
    """Update seq's drafting pause after the model accepted `accepted` of its `drafted` tokens."""
    if accepted == drafted:
        seq.spec_backoff = 0
    elif 2 * accepted < drafted:
        seq.spec_backoff = _next_backoff(seq.spec_backoff)
        seq.spec_resume_at = len(seq.output_token_ids) + seq.spec_backoff


class BatchPause:
    """The same pause for the whole batch, counted in decode steps: one sequence's draft takes every
    sequence of the step out of the multi-step loop, so with many sequences, each pausing on its own
    still left a draft in nearly every step (H100, 32 sequences of refused drafts: 1,201 tok/s with
    per-sequence pauses alone, 4,109 without drafting). A step whose drafts were mostly refused pauses
    all drafting; a step whose drafts were all accepted ends the pauses."""

    def __init__(self) -> None:
        self.clock = self.resume_at = self.backoff = 0

    def active(self, ahead: int = 0) -> bool:
        return self.clock + ahead < self.resume_at

    def after_step(self, steps: int, drafted: int, accepted: int) -> None:
        self.clock += steps
        if not drafted:
            return
        if accepted == drafted:
            self.backoff = 0
        elif 2 * accepted < drafted:
            self.backoff = _next_backoff(self.backoff)
            self.resume_at = self.clock + self.backoff


def may_draft(seq, ahead: int = 0) -> bool:
    """Whether seq would look for a draft `ahead` tokens from now (eligible and not pausing)."""
    return eligible(seq) and len(seq.output_token_ids) + ahead >= seq.spec_resume_at


def eligible(seq) -> bool:
    """Whether seq may draft: every request but a constrained one (a grammar needs each token on the host
    before it masks the next). Penalties, logit bias and min_tokens are applied row by row by the verify,
    as a plain decode applies them after the same tokens (step.py: _verify)."""
    return seq.matcher is None
