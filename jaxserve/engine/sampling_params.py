"""Per-request sampling parameters (host side, no JAX)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

from jaxserve.engine.structured import StructuredOutput


class SamplingParamsError(ValueError):
    """Invalid sampling parameters; `param` names the offending field (for OpenAI error bodies)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = 256  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; k >= 0: sampled token's logprob + top-k
    prompt_logprobs: int | None = None  # None: none; k >= 0: per prompt token logprob + top-k
    skip_special_tokens: bool = True
    # the output must match a JSON schema / JSON object / regex / choice / Lark grammar (a dict of
    # StructuredOutput's fields is accepted too)
    structured: StructuredOutput | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if isinstance(self.structured, dict):
            try:
                self.structured = StructuredOutput(**self.structured)
            except TypeError as e:  # an unknown field
                raise SamplingParamsError(f"structured: {e}", "structured") from None
        elif self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise SamplingParamsError("structured must be a StructuredOutput or a dict of its fields", "structured")
        self.validate()

    def validate(self, max_logprobs: int = 20, vocab_size: int | None = None) -> None:
        def bad(msg, p):
            raise SamplingParamsError(msg, p)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be >= 1, got {self.n}", "n")
        if not (0 <= self.temperature < math.inf):  # NaN fails too
            bad(f"temperature must be a finite number >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            bad(f"top_k must be >= 0 (or -1 for off), got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        if not (0 < self.repetition_penalty < math.inf):
            bad(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}", "repetition_penalty")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            bad(f"seed must be an integer, got {self.seed!r}", "seed")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= max_logprobs:
                bad(f"{name} must be in [0, {max_logprobs}], got {v}", name)
        for tok, b in self.logit_bias.items():
            if vocab_size is not None and not 0 <= tok < vocab_size:
                bad(f"logit_bias token id {tok} is out of range [0, {vocab_size})", "logit_bias")
            if not -100 <= b <= 100:
                bad(f"logit_bias values must be in [-100, 100], got {b}", "logit_bias")
        if vocab_size is not None:
            for tok in self.stop_token_ids:
                if not 0 <= tok < vocab_size:
                    bad(f"stop token id {tok} is out of range [0, {vocab_size})", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Repetition / presence / frequency penalties: they need every earlier token counted on the device."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def replace(self, **kw) -> "SamplingParams":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with, as vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`: it
    names a loaded adapter (lora_modules, LLM.add_lora), or with a lora_path not loaded yet it is loaded
    on demand into a free adapter slot (max_loras). A lora_path given for a loaded name must be the
    directory it was loaded from; lora_int_id is vLLM's numeric id, not needed here (the name
    identifies the adapter)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


def choice_seed(seed: int, choice: int) -> int:
    """The 31-bit sampling seed of choice `choice` of a request seeded with `seed` (any int: OpenAI's
    seeds are 64-bit). A splitmix64 mix of both, so that choice 1 of seed s is not choice 0 of s + 1
    and seeds that differ above bit 31 differ."""
    M = (1 << 64) - 1
    z = ((int(seed) & M) * 0x9E3779B97F4A7C15 + (choice + 1) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return (z ^ (z >> 31)) & 0x7FFFFFFF
