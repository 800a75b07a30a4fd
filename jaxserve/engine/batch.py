"""What the scheduler hands the runner for one step, and what comes back. No JAX.

A step processes, for every scheduled sequence, the known tokens [start, start + num_new) — a prompt
chunk, a recompute after preemption, or the one newest token of a decode — and samples a next token
for the sequences whose chunk reaches their last known token. With decode_steps = K > 1 (only when
every scheduled sequence is a plain decode) the device runs K decode steps back to back and returns K
tokens per sequence; the host finds EOS/stop afterwards and drops what came after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.engine.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first token processed this step (= seq.num_computed_tokens)
    num_new: int  # tokens processed this step
    reset_row: bool = False  # first step on this device row: zero its penalty counts
    # Scheduled before the previous step's tokens reached the host (Scheduler.schedule_ahead): its
    # input token is the last one the device sampled for the row; start counts the previous step's
    # tokens as computed.
    ahead: bool = False
    # Speculative decoding (engine/speculative.py): proposed tokens fed after the newest known one (they
    # are part of num_new); the step's argmax at each position verifies them.
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        return self.ahead or self.start + self.num_new - len(self.draft) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    decode_steps: int = 1
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended while scheduling (never fit, ...)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepResult:
    """Host copies of a step's outputs, one entry per scheduled sequence (same order)."""

    # tokens[i] : list of K sampled tokens (K = decode_steps), empty if the seq did not sample
    tokens: list[list[int]]
    # logprobs[i][k] = (logprob of sampled token, [(token, logprob) * top_n]) or None when not asked;
    # for a drafted item, one entry per chunk position instead (the pick after it: see verify)
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None]
    # prompt_logprobs[i] = list over the chunk's tokens (position start+1 ..) or None when not asked
    prompt_logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None]
    # verify[i] = the sampler's pick after each of the chunk's positions (speculative items only), else None
    verify: list[list[int] | None] | None = None
