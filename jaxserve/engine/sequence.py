"""Host-side state of one generation (one choice of one request). No JAX."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from jaxserve.engine.sampling_params import SamplingParams

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # client went away, timeout, shutdown


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    choice_index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # logprob data per output token: (logprob, [(token, logprob), ...]) when params.logprobs is set
    output_logprobs: list = field(default_factory=list)
    # per prompt token (from position 1): (logprob, top list) when params.prompt_logprobs is set
    prompt_logprobs: list = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    ended_on_token: bool = False  # its last token is an EOS or stop token id (its text is not output)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at (last) admission
    row: int = -1  # persistent batch row on the device (penalty counts), -1 = none
    num_preemptions: int = 0
    first_token_time: float | None = None
    sample_seed: int = 0  # noise comes from (sample_seed, position) only
    # structured output: the GrammarMatcher that masks this sequence's next token (structured.py)
    matcher: object | None = None
    # image inputs (engine/multimodal.MultiModalPrompt; shared by the request's n choices)
    mm: object | None = None
    # multi-LoRA: the adapters it runs with, ((slot 1..N, scale), ...) (engine/lora_slots.py; () = the base
    # model); one adapter at scale 1 unless a request mixes several (llama.cpp's per-request `lora`)
    lora_mix: tuple = ()
    lora_key: str = ""  # the adapters' loads and scales: its prefix-cache blocks are its own
    # speculative decoding (engine/speculative.py): no drafts before this many output tokens (after drafts
    # the model mostly refused), and how long the next such pause is
    spec_resume_at: int = 0
    spec_backoff: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, a: int, b: int) -> list[int]:
        """all_token_ids[a:b] (0 <= a <= b) without building the whole list (a long context's step reads a few)."""
        P = len(self.prompt_token_ids)
        if b <= P:
            return self.prompt_token_ids[a:b]
        if a >= P:
            return self.output_token_ids[a - P:b - P]
        return self.prompt_token_ids[a:] + self.output_token_ids[:b - P]

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """Still has known tokens whose K/V are not computed (prompt, or recompute after preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1 or self.num_computed_tokens == 0

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
