"""The compiled step functions: pure functions of (weights, device state, step inputs).

Two program families, each compiled once per bucket at start-up:
  * mixed(T tokens, S seqs): any mix of prompt chunks, recomputes and decodes; samples one token per
    sequence; and, when a request asks (inp["want_plp"]), the log-probabilities of every input
    token's successor.
  * decode(S seqs): up to K decode steps in an on-device loop (trip count is an input, <= K), feeding
    each sampled token back; the host reads all K tokens afterwards and drops those after a stop.
Device state (donated every step): the paged K/V caches and, per persistent batch row, the output
token counts and prompt-token mask that the repetition/presence/frequency penalties read, and the
last token a decode program sampled (the input of a decode step scheduled ahead of the host).
A third, tiny program (`seed_penalty_rows`) fills a row's penalty state from tokens no step computes:
a prefix-cache hit's cached tokens.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.engine import sampler as sampler_mod
from jaxserve.models import transformer as tf


def _slots(batch, block_size):
    tables = batch["block_tables"][batch["token_seq"]]  # [T, MB]
    pos = batch["positions"]
    blk = jnp.take_along_axis(tables, (pos // block_size)[:, None], axis=1)[:, 0]
    return blk * block_size + pos % block_size


def _sample(cfg, weights, hidden_rows, state, rows, samples, positions, st, num_top, logits_sharding,
            qmm=None):
    logits = tf.logits_from_hidden(cfg, weights, hidden_rows, qmm)
    if logits_sharding is not None:  # tensor parallel: every device samples from the same logits
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    out = sampler_mod.sample(logits, st, positions, state["out_counts"][rows],
                             state["prompt_mask"][rows], 0)
    if num_top:
        # Top-k logprobs cost a pass over the vocabulary: only when some request asked for them.
        def top():
            lse = jax.nn.logsumexp(logits, axis=-1)
            vals, ids = sampler_mod.block_top_k(logits, num_top)
            return ids, vals - lse[:, None]

        S = logits.shape[0]
        none = lambda: (jnp.zeros((S, num_top), jnp.int32), jnp.zeros((S, num_top), jnp.float32))
        out["top_ids"], out["top_logprobs"] = jax.lax.cond(st["want_logprobs"], top, none)
    # Count what was sampled (padding and non-sampling rows go to the dummy row, then are dropped).
    R = state["out_counts"].shape[0] - 1
    tgt = jnp.where(samples, rows, R)
    state = dict(state, out_counts=state["out_counts"].at[tgt, out["tokens"]].add(1, mode="drop"))
    return out, state


def seed_penalty_rows(pen, inp):
    """pen {"out_counts", "prompt_mask"} (donated): row inp["row"] cleared when inp["reset"], then its
    prompt mask set at inp["prompt_ids"] and its output counts raised by inp["out_cnt"] at
    inp["out_ids"] (the host's histogram of the cached tokens; padding ids = vocab size, dropped)."""
    oc, pm = pen["out_counts"], pen["prompt_mask"]
    reset = jnp.where(inp["reset"], inp["row"], oc.shape[0])
    oc, pm = oc.at[reset].set(0, mode="drop"), pm.at[reset].set(False, mode="drop")
    return {"out_counts": oc.at[inp["row"], inp["out_ids"]].add(inp["out_cnt"], mode="drop"),
            "prompt_mask": pm.at[inp["row"], inp["prompt_ids"]].set(True, mode="drop")}


PLP_CHUNK = 512  # rows of prompt log-probs computed at once (mixed_step)


def mixed_step(cfg: ModelConfig, consts, weights, state, inp, *, scan_layers, attention, num_top,
               block_size, logits_sharding=None, add_norm=None, rope_kv=None, qmm=None, moe_impl=None,
               lora_adapters=0):
    R = state["out_counts"].shape[0] - 1
    # Fresh rows: clear their penalty state before counting this step's tokens into them.
    reset_rows = jnp.where(inp["reset"], inp["rows"], R)
    state = dict(state,
                 out_counts=state["out_counts"].at[reset_rows].set(0, mode="drop"),
                 prompt_mask=state["prompt_mask"].at[reset_rows].set(False, mode="drop"))
    tok_rows = inp["rows"][jnp.minimum(inp["token_seq"], inp["rows"].shape[0] - 1)]
    pm_rows = jnp.where(inp["is_prompt"], tok_rows, R)
    oc_rows = jnp.where(inp["count_output"], tok_rows, R)
    state = dict(state,
                 prompt_mask=state["prompt_mask"].at[pm_rows, inp["token_ids"]].set(True, mode="drop"),
                 out_counts=state["out_counts"].at[oc_rows, inp["token_ids"]].add(1, mode="drop"))

    batch = {k: inp[k] for k in ("token_ids", "positions", "token_seq", "block_tables", "mm_embeds", "mm_mask",
                                 "attn_limit") if k in inp}
    batch["slots"] = _slots(batch, block_size)
    if "rope_delta" in inp:  # multimodal RoPE: each token's 3-axis position, relative to its position
        batch["rope_pos"] = inp["positions"][None] + inp["rope_delta"]
    batch["decode_slots"] = inp["rows"].shape[0]  # static: the single-token region (see runner)
    if cfg.is_moe:  # padding tokens (the dummy sequence) are not routed to experts of their own
        batch["moe_valid"] = inp["token_seq"] < inp["rows"].shape[0]
    if lora_adapters:  # multi-LoRA: each token's adapter scales [T, N] (models/lora.py)
        batch["lora_onehot"] = inp["lora"]
    hidden, (k, v) = tf.forward_hidden(cfg, weights, consts, (state["k"], state["v"]), batch,
                                       scan_layers=scan_layers, attention=attention, add_norm=add_norm,
                                       rope_kv=rope_kv, qmm=qmm, moe_impl=moe_impl)
    state = dict(state, k=k, v=v)
    counted = inp["samples"] & (inp["verify_len"] == 0) if "verify_len" in inp else inp["samples"]
    out, state = _sample(cfg, weights, hidden[inp["sample_idx"]], state, inp["rows"], counted,
                         inp["sample_pos"], inp["st"], num_top, logits_sharding, qmm)
    out = {k: v[None] for k, v in out.items()}  # [K=1, S, ...] like the decode program
    # Prompt log-probabilities (score, echo) cost a [T, V] pass: computed only when a request in the
    # step asked (lax.cond), so one program per token bucket serves both kinds of step.
    T = hidden.shape[0]

    def prompt_lp_rows(h, targets):
        logits = tf.logits_from_hidden(cfg, weights, h, qmm)
        if logits_sharding is not None:
            logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
        lp = jax.nn.log_softmax(logits, axis=-1)
        chosen = jnp.take_along_axis(lp, targets[:, None], axis=1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(lp, num_top) if num_top else (lp[:, :0], lp[:, :0])
        return chosen, top_ids.astype(jnp.int32), top_lp

    def prompt_lp():
        # In chunks of PLP_CHUNK rows: the [rows, vocab] f32 logits and log-softmax of a whole 8,192-token
        # step were ~24 GiB of temporaries that the KV-cache sizing had to reserve (lax.cond's branches
        # share the program's peak) for a rarely used feature.
        if T <= PLP_CHUNK:
            return prompt_lp_rows(hidden, inp["target_ids"])
        n = -(-T // PLP_CHUNK)  # T is a bucket plus the decode rows: n equal chunks, < n rows of padding
        C = -(-T // n)
        pad = n * C - T
        h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(n, C, -1)
        tgt = jnp.pad(inp["target_ids"], (0, pad)).reshape(n, C)
        outs = jax.lax.map(lambda a: prompt_lp_rows(*a), (h, tgt))
        return tuple(o.reshape(n * C, *o.shape[2:])[:T] for o in outs)

    def none():
        return (jnp.zeros((T,), jnp.float32), jnp.zeros((T, num_top), jnp.int32),
                jnp.zeros((T, num_top), jnp.float32))

    out["prompt_logprob"], out["prompt_top_ids"], out["prompt_top_logprobs"] = jax.lax.cond(
        inp["want_plp"], prompt_lp, none)
    if "verify_idx" in inp:  # speculative decoding: the token sampled at each draft position (those rows only)
        N = inp["verify_idx"].shape[0]
        none = lambda: ((jnp.zeros((N,), jnp.int32), jnp.zeros((N,), jnp.float32),
                         jnp.zeros((N, num_top), jnp.int32), jnp.zeros((N, num_top), jnp.float32)),
                        state["out_counts"])
        verified, counts = jax.lax.cond(
            inp["want_verify"], lambda: _verify(cfg, weights, hidden, state, inp, num_top, logits_sharding, qmm), none)
        (out["verify"], out["verify_logprob"], out["verify_top_ids"], out["verify_top_logprobs"]) = verified
        state = dict(state, out_counts=counts)
    return state, out


def _verify(cfg, weights, hidden, state, inp, num_top, logits_sharding, qmm):
    """The token the sampler would pick after each drafted row: the same draw (noise keyed by the request's
    seed and the sampled position only, engine/sampler.py) that a plain decode would make there, so a
    draft token equal to it is what decoding without drafts would have produced once the tokens before it
    were (engine/speculative.py). Row j of an item samples as a plain decode would after the draft's first
    j tokens: penalties count them as outputs, logit bias applies, EOS stays banned while min_tokens is not
    reached. Greedy rows: the argmax. Also each pick's raw logprob, and the top num_top when a request of
    the step asked for them; and the penalty counts with the picks that are kept (the agreeing prefix and the
    pick after it) added, the drafted tokens fed as inputs not being counted by the step itself."""
    rows = inp["verify_idx"]  # S items x (k + 1) rows, item-major
    N = rows.shape[0]
    S = inp["rows"].shape[0]
    V1 = N // S  # k + 1
    logits = tf.logits_from_hidden(cfg, weights, hidden[rows], qmm).astype(jnp.float32)
    if logits_sharding is not None:
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    vocab = logits.shape[1]
    ln = inp["verify_len"]  # rows of each item's chunk (0: not drafted)
    j_of = jnp.arange(V1)
    # the token fed at row j + 1 (the draft's (j+1)-th token), -1 where the chunk has none
    nxt = jnp.where(j_of[None, 1:] < ln[:, None], inp["token_ids"][rows].reshape(S, V1)[:, 1:], -1)
    nxt = jnp.concatenate([nxt, jnp.full((S, 1), -1, jnp.int32)], axis=1)  # [S, k + 1]
    pos = (inp["positions"][rows] + 1).reshape(S, V1)
    item_rows = inp["rows"]
    st = inp["st"]

    def row_by_row():  # each row samples after the draft tokens before it, counted as outputs
        prompt_mask = state["prompt_mask"][item_rows]

        def one(counts, xs):
            x, j, d, p = xs
            tok = sampler_mod.sample(x, dict(st, suppress_eos=st["min_tokens_left"] > j), p, counts, prompt_mask,
                                     0, logprobs=False)["tokens"]
            # row j + 1 follows d: count it (an item whose chunk ends here adds nothing)
            counts = counts.at[jnp.arange(S), jnp.where(d >= 0, d, vocab)].add(1, mode="drop")
            return counts, tok

        counts0 = state["out_counts"][item_rows]  # [S, V]
        xs = (logits.reshape(S, V1, vocab).transpose(1, 0, 2), j_of, nxt.T, pos.T)
        return jax.lax.scan(one, counts0, xs)[1].T

    def all_rows():  # no drafted item has penalties, bias or pending min_tokens: one pass over the N rows
        item = jnp.arange(N) // V1
        st_n = {k: st[k][item] for k in ("temperature", "top_p", "top_k", "min_p", "seed")}
        return sampler_mod.sample(logits, st_n, pos.reshape(N), None, None, 0, logprobs=False,
                                  penalties=False)["tokens"].reshape(S, V1)

    drafted = ln > 0
    plain = ~jnp.any(drafted & ((st["repetition"] != 1.0) | (st["frequency"] != 0.0) | (st["presence"] != 0.0)
                                | jnp.any(st["bias_ids"] >= 0, axis=1) | (st["min_tokens_left"] > 0)))
    picks = jax.lax.cond(plain, all_rows, row_by_row)  # [S, k + 1]
    # kept: the agreeing prefix of the draft (m tokens) and the pick after it; count those m + 1 picks
    agree = jnp.cumprod((picks == nxt).astype(jnp.int32), axis=1)
    m = jnp.sum(agree, axis=1)
    keep = (j_of[None, :] <= m[:, None]) & (ln[:, None] > 0)
    R = state["out_counts"].shape[0] - 1
    tgt_rows = jnp.where(keep, item_rows[:, None], R)
    counts = state["out_counts"].at[tgt_rows, picks].add(1, mode="drop")
    toks = picks.reshape(N)

    # the raw logprob of each pick, as the sampler gives it (a log-sum-exp pass, small next to the LM head)
    lse = sampler_mod.row_logsumexp(logits)
    chosen = jnp.take_along_axis(logits, toks[:, None], axis=1)[:, 0] - lse
    if not num_top:
        return (toks, chosen, jnp.zeros((N, 0), jnp.int32), jnp.zeros((N, 0), jnp.float32)), counts

    def top():
        vals, ids = sampler_mod.block_top_k(logits, num_top)
        return ids, vals - lse[:, None]

    none = lambda: (jnp.zeros((N, num_top), jnp.int32), jnp.zeros((N, num_top), jnp.float32))
    return (toks, chosen, *jax.lax.cond(inp["st"]["want_logprobs"], top, none)), counts


def decode_step(cfg: ModelConfig, consts, weights, state, inp, *, scan_layers, attention, num_top,
                max_steps, block_size, logits_sharding=None, add_norm=None, rope_kv=None, qmm=None,
                rope_attend=None, moe_impl=None, lora_adapters=0):
    S = inp["token_ids"].shape[0]
    token_seq = jnp.arange(S, dtype=jnp.int32)
    # multi-LoRA: each row's adapter, the same for every step of the loop
    adapters = {"lora_onehot": inp["lora"]} if lora_adapters else {}

    def one(i, carry):
        state, tokens, positions, outs = carry
        batch = {"token_ids": tokens, "positions": positions, "token_seq": token_seq,
                 "block_tables": inp["block_tables"], **adapters}
        batch["slots"] = _slots(batch, block_size)
        if "rope_delta" in inp:  # multimodal RoPE: a row's text offset, the same at every step
            batch["rope_pos"] = positions[None] + inp["rope_delta"]
        if cfg.is_moe:  # padding rows (the dummy row) are not routed to experts of their own
            batch["moe_valid"] = inp["rows"] < state["out_counts"].shape[0] - 1
        hidden, (k, v) = tf.forward_hidden(cfg, weights, consts, (state["k"], state["v"]), batch,
                                           scan_layers=scan_layers, attention=attention,
                                           add_norm=add_norm, rope_kv=rope_kv, qmm=qmm,
                                           rope_attend=rope_attend, moe_impl=moe_impl)
        state = dict(state, k=k, v=v)
        # min_tokens: EOS stays banned while fewer than min_tokens outputs exist at this inner step.
        st = dict(inp["st"], suppress_eos=inp["st"]["min_tokens_left"] > i)
        out, state = _sample(cfg, weights, hidden, state, inp["rows"], inp["samples"], positions + 1,
                             st, num_top, logits_sharding, qmm)
        outs = {name: outs[name].at[i].set(out[name]) for name in outs}
        return state, out["tokens"], positions + 1, outs

    outs = {"tokens": jnp.zeros((max_steps, S), jnp.int32),
            "logprob": jnp.zeros((max_steps, S), jnp.float32),
            "top_ids": jnp.zeros((max_steps, S, num_top), jnp.int32),
            "top_logprobs": jnp.zeros((max_steps, S, num_top), jnp.float32)}
    rows = inp["rows"]
    # A step scheduled ahead starts from the row's last sampled token, still on the device.
    tokens = jnp.where(inp["use_last"], state["last_token"][rows], inp["token_ids"])
    state, last, _, outs = jax.lax.fori_loop(0, inp["num_steps"], one, (state, tokens, inp["positions"], outs))
    state = dict(state, last_token=state["last_token"].at[rows].set(last))  # padding: dummy row R
    return state, outs
