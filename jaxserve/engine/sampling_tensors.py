"""Host half of the sampler: per-request SamplingParams -> fixed-shape numpy arrays. No JAX.

Every array's shape depends only on `num_rows` and the fixed maxima (`max_bias`, `max_eos`), never
on the requests, so the compiled step sees the same shapes (and dtypes) every time and never
recompiles. Rows without a request (None, or beyond len(params)) are neutral greedy rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.engine.sampling_params import SamplingParams

# Below this temperature a row is greedy (vLLM's _SAMPLING_EPS): dividing by ~0 only overflows.
GREEDY_EPS = 1e-5
DEFAULT_MAX_BIAS = 64
DEFAULT_MAX_EOS = 8

SAMPLING_TENSOR_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "presence", "frequency", "repetition", "seed",
    "bias_ids", "bias_vals", "suppress_eos", "eos_ids", "min_tokens_left",
)


def seed_to_u32(seed: int) -> int:
    """Fold an arbitrary (possibly 64-bit or negative) integer seed into 32 bits without dropping the high half."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return (s ^ (s >> 32)) & 0xFFFFFFFF


def build_sampling_tensors(
    params: Sequence[SamplingParams | None],
    num_rows: int,
    seeds: Sequence[int],
    max_bias: int = DEFAULT_MAX_BIAS,
    *,
    output_lens: Sequence[int] | None = None,
    eos_token_ids: Sequence[int] = (),
    max_eos: int = DEFAULT_MAX_EOS,
    vocab_size: int | None = None,
    masks: Sequence[np.ndarray | None] | None = None,
) -> dict[str, np.ndarray]:
    """Pack the batch's sampling parameters into arrays padded to `num_rows` (S).

    params[i] / seeds[i] / output_lens[i] describe row i (seeds: every request has one; the engine
    draws a random seed for unseeded requests). `eos_token_ids` are the model's EOS ids; a row's
    ids suppressed while it is shorter than min_tokens are its stop_token_ids plus, unless
    ignore_eos, the EOS ids (as vLLM's min_tokens processor does).

    Returns (S = num_rows, B = max_bias, E = max_eos):
      temperature f32[S] (0 = greedy), top_p f32[S], top_k i32[S] (0 = off), min_p f32[S],
      presence f32[S], frequency f32[S], repetition f32[S], seed u32[S],
      bias_ids i32[S, B] (-1 = unused), bias_vals f32[S, B],
      suppress_eos bool[S], eos_ids i32[S, E] (-1 = unused),
      min_tokens_left i32[S] (outputs still to come before EOS is allowed; with K decode steps per
      dispatch the runner can use `min_tokens_left > k` as step k's suppress_eos);
    and with vocab_size (W = ceil(vocab_size / 32)): constrained bool[S] and, when some row is
      constrained, allowed u32[S, W] (bit t % 32 of word t // 32: token t may be sampled) from masks[i]
      (structured output's GrammarMatcher.mask(), None for an unconstrained row: all ones). Without
      constrained rows "allowed" is left out: the runner passes an all-ones array it keeps on the device
      (at 256 rows and a 262k vocabulary it is 8 MB, not worth building and copying every step).

    Raises ValueError when rows exceed num_rows, a row has more than max_bias logit_bias entries,
    or more than max_eos ids to suppress (the server caps both).
    """
    n = len(params)
    if n > num_rows:
        raise ValueError(f"{n} requests do not fit in {num_rows} rows")
    if len(seeds) != n:
        raise ValueError(f"got {len(seeds)} seeds for {n} requests")
    if output_lens is not None and len(output_lens) != n:
        raise ValueError(f"got {len(output_lens)} output lengths for {n} requests")
    S = num_rows
    out = {
        "temperature": np.zeros(S, np.float32),
        "top_p": np.ones(S, np.float32),
        "top_k": np.zeros(S, np.int32),
        "min_p": np.zeros(S, np.float32),
        "presence": np.zeros(S, np.float32),
        "frequency": np.zeros(S, np.float32),
        "repetition": np.ones(S, np.float32),
        "seed": np.zeros(S, np.uint32),
        "bias_ids": np.full((S, max_bias), -1, np.int32),
        "bias_vals": np.zeros((S, max_bias), np.float32),
        "suppress_eos": np.zeros(S, np.bool_),
        "eos_ids": np.full((S, max_eos), -1, np.int32),
        "min_tokens_left": np.zeros(S, np.int32),
    }
    if vocab_size is not None:
        out["constrained"] = np.zeros(S, np.bool_)
        if masks and any(m is not None for m in masks):
            out["allowed"] = np.full((S, -(-int(vocab_size) // 32)), 0xFFFFFFFF, np.uint32)
            for i, m in enumerate(masks):
                if m is not None:
                    out["constrained"][i] = True
                    out["allowed"][i] = m
    elif masks and any(m is not None for m in masks):
        raise ValueError("token masks need vocab_size")
    eos = [int(t) for t in eos_token_ids]
    for i, p in enumerate(params):
        if p is None:
            continue
        t = float(p.temperature)
        out["temperature"][i] = 0.0 if t < GREEDY_EPS else t
        out["top_p"][i] = p.top_p
        out["top_k"][i] = max(int(p.top_k), 0)
        out["min_p"][i] = p.min_p
        out["presence"][i] = p.presence_penalty
        out["frequency"][i] = p.frequency_penalty
        out["repetition"][i] = p.repetition_penalty
        out["seed"][i] = seed_to_u32(seeds[i])
        if p.logit_bias:
            if len(p.logit_bias) > max_bias:
                raise ValueError(f"row {i}: {len(p.logit_bias)} logit_bias entries exceed the maximum {max_bias}")
            ids = np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias))
            if (ids < 0).any():
                raise ValueError(f"row {i}: negative logit_bias token id")
            out["bias_ids"][i, : len(ids)] = ids
            out["bias_vals"][i, : len(ids)] = np.fromiter(p.logit_bias.values(), np.float32, len(ids))
        left = max(int(p.min_tokens) - (int(output_lens[i]) if output_lens is not None else 0), 0)
        out["min_tokens_left"][i] = left
        if left > 0:
            # dict keeps first-seen order and drops duplicates between stop ids and EOS ids
            stop = list(dict.fromkeys([int(s) for s in p.stop_token_ids] + ([] if p.ignore_eos else eos)))
            if len(stop) > max_eos:
                raise ValueError(f"row {i}: {len(stop)} stop/EOS ids to suppress exceed the maximum {max_eos}")
            if stop:
                out["eos_ids"][i, : len(stop)] = stop
                out["suppress_eos"][i] = True
    return out
