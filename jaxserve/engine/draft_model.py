"""Speculative decoding with a draft model (vLLM's "draft_model" method, llama.cpp's --model-draft).

A smaller model with the target's vocabulary proposes the k tokens of a drafted step (engine/speculative.py
reserves them as PENDING while scheduling; `DraftProposer.fill` writes them before the step is dispatched)
by greedy decoding; the target verifies them exactly as it verifies prompt-lookup drafts, so the output is
the target's own whatever the draft model says.

The draft model has its own paged K/V cache, indexed by the target's block tables (the same block count and
size: a sequence's slots hold the same positions in both caches), and its own ModelRunner with the same
buckets, so nothing compiles while serving. It sees a sequence's tokens lazily: before drafting, it reads
the tokens it has not read yet (the whole prompt the first time, the few tokens kept since its last draft
afterwards) in chunks of the step budget, the chunk that reaches the newest token samples the first draft
token, then decode steps give the rest. Its cache then holds the sequence's known tokens (positions below
the newest + 1); the positions its drafts were written at lie beyond and are written again with the kept
tokens next time. A preempted sequence lost its blocks: its draft cache is read again from position 0.
Host side (no JAX): the runner is the boundary to the device.
"""

from __future__ import annotations

import time

from jaxserve.engine.batch import ScheduledSeq, SchedulerOutput
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.sequence import Sequence

_GREEDY = SamplingParams(temperature=0.0)


class DraftProposer:
    def __init__(self, runner, max_num_seqs: int, vocab_size: int):
        """runner: the draft model's ModelRunner (its own cache of the target's num_blocks); vocab_size: the
        target's (a draft model with a larger padded vocabulary could propose ids the target has no row for:
        they become 0, a token the target just refuses or picks itself)."""
        self.runner = runner
        self.vocab_size = vocab_size
        ecfg = runner.ecfg
        self.budget = max(ecfg.token_buckets)  # prompt-chunk tokens of one mixed step (padded to tiles)
        self.tile = ecfg.attn_tile
        self.max_steps = ecfg.decode_steps
        self.max_num_seqs = max_num_seqs
        # seq_id -> (tokens whose K/V the draft cache holds, the sequence's preemption count then)
        self._read: dict[int, tuple[int, int]] = {}
        self.num_dispatches = 0  # draft-model programs run (tests, stats)
        self.num_fills = 0  # target steps with drafted items
        self.catch_up_dispatches = 0
        self.fill_seconds = 0.0  # host wall time in fill (the draft's programs run synchronously there)
        self.catch_up_seconds = 0.0

    def stats(self) -> dict:
        return {"draft_fills": self.num_fills, "draft_dispatches": self.num_dispatches,
                "draft_catch_up_dispatches": self.catch_up_dispatches,
                "draft_fill_seconds": round(self.fill_seconds, 4), "draft_catch_up_seconds": round(self.catch_up_seconds, 4)}

    def forget(self, seq_id: int) -> None:
        self._read.pop(seq_id, None)

    def _known(self, seq: Sequence) -> int:
        read, preemptions = self._read.get(seq.seq_id, (0, seq.num_preemptions))
        return read if preemptions == seq.num_preemptions else 0

    def fill(self, sched: SchedulerOutput) -> None:
        """Replace every drafted item's PENDING tokens with the draft model's greedy continuation."""
        items = [s for s in sched.scheduled if s.draft]
        if not items:
            return
        t0 = time.perf_counter()
        self.num_fills += 1
        if len(self._read) > 4 * self.max_num_seqs:  # ended sequences the engine did not report
            live = {s.seq.seq_id for s in sched.scheduled}
            self._read = {k: v for k, v in self._read.items() if k in live}
        proxies = []
        for s in items:
            seq = s.seq
            # the draft model's view: the same tokens (the prompt shared, the outputs copied: drafts are
            # appended to them), greedy, no penalties, no logprobs
            proxies.append(Sequence(request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, params=_GREEDY,
                                    output_token_ids=list(seq.output_token_ids), block_table=seq.block_table,
                                    row=seq.row, num_computed_tokens=min(self._known(seq), s.start)))
        first = self._catch_up(proxies)
        self.catch_up_seconds += time.perf_counter() - t0
        drafts = [[t] for t in first]
        K = max(len(s.draft) for s in items)
        for p, t in zip(proxies, first):  # decode from the first draft token on
            p.output_token_ids.append(t)
        done = 1
        while done < K:
            steps = min(self.max_steps, K - done)
            dec = SchedulerOutput(scheduled=[ScheduledSeq(p, p.num_tokens - 1, 1) for p in proxies],
                                  decode_steps=steps)
            res = self.runner.execute(dec)
            self.num_dispatches += 1
            for p, d, toks in zip(proxies, drafts, res.tokens):
                d.extend(toks[:steps])
                p.output_token_ids.extend(toks[:steps])
                p.num_computed_tokens += steps
            done += steps
        for s, d in zip(items, drafts):
            s.draft = tuple(t if 0 <= t < self.vocab_size else 0 for t in d[:len(s.draft)])
            self._read[s.seq.seq_id] = (s.start + 1, s.seq.num_preemptions)
        self.fill_seconds += time.perf_counter() - t0

    def _catch_up(self, proxies: list[Sequence]) -> list[int]:
        """Feed each proxy's unread tokens through the draft model (mixed steps within the token budget);
        returns the token each samples after its newest one."""
        Q = self.tile
        first: list[int | None] = [None] * len(proxies)
        while any(t is None for t in first):
            out, room, idx = SchedulerOutput(), self.budget, []
            for i, p in enumerate(proxies):
                left = p.num_tokens - p.num_computed_tokens
                if first[i] is not None:
                    continue
                n = left if left == 1 else min(left, room // Q * Q)
                if n <= 0:
                    continue
                if n > 1:
                    room -= -(-n // Q) * Q
                out.scheduled.append(ScheduledSeq(p, p.num_computed_tokens, n))
                idx.append(i)
            res = self.runner.execute(out)
            self.num_dispatches += 1
            self.catch_up_dispatches += 1
            for j, i in enumerate(idx):
                ss = out.scheduled[j]
                proxies[i].num_computed_tokens += ss.num_new
                if ss.samples:
                    first[i] = res.tokens[j][0]
        return first


def load_draft(path: str, target, ecfg, *, multi_host: bool = False):
    """The draft model (a LoadedModel) for a target LoadedModel, checked: one device, a text model, the same
    tokenizer vocabulary. Loads through the device side (imported here, so this module stays host-only)."""
    from jaxserve.engine.llm_engine import load_model

    if target.mesh is not None or multi_host:
        raise ValueError("speculative decoding with a draft model runs on one device (no tensor or data "
                         "parallelism, one host)")
    if target.vision is not None:
        raise ValueError("speculative decoding with a draft model is for text models (this one takes images)")
    draft = load_model(path, dtype=ecfg.dtype, packed=ecfg.packed_weights)
    if draft.vision is not None:
        raise ValueError(f"the draft model {path} takes images: a draft model must be a text model")
    mine, theirs = target.tokenizer, draft.tokenizer
    if mine is not None and theirs is not None:
        a, b = mine.backend.get_vocab(with_added_tokens=True), theirs.backend.get_vocab(with_added_tokens=True)
        if a != b:
            diff = len(set(a.items()) ^ set(b.items()))
            raise ValueError(f"the draft model {path} has another vocabulary than the target model ({len(b)} vs "
                             f"{len(a)} tokens, {diff} token/id pairs differ): a draft model must share the "
                             "target's tokenizer")
    elif draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.cfg.vocab_size}) is not the target's "
                         f"({target.cfg.vocab_size})")
    return draft


def draft_engine_config(ecfg):
    """The draft runner's EngineConfig: the target's limits, buckets and block layout (its cache is indexed by
    the target's block tables), without speculation, adapters, logprobs or weight-format options. Its dense
    weight layout (kmajor_weights) is the target's setting; left to auto, a one-sequence engine's draft
    holds every weight [N, K] (its drafting steps are one row each; not measured on its own)."""
    return ecfg.replace(num_speculative_tokens=0, speculative_model=None, max_logprobs=0, lora=(), lora_modules=(),
                        max_loras=None, max_lora_rank=None, isq=None, int8_activations=False, dense_gemv=None,
                        token_buckets=ecfg.token_buckets, seq_buckets=ecfg.seq_buckets)
