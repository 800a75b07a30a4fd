"""Continuous-batching scheduler with chunked prefill, recompute preemption and multi-step decode.

Host side only (no JAX). One `schedule()` builds a step under a token budget:
  1. every running sequence in decode gets its one token (preempting the most recently admitted
     running sequences by recompute when blocks run out);
  2. running sequences still in (chunked) prefill get chunks of what budget is left;
  3. waiting sequences are admitted first come, first served while budget, rows and blocks allow.
When the step is nothing but plain decodes and nobody could be admitted, the runner is asked for
`decode_steps` tokens per sequence in one dispatch (a sequence reaching max_tokens sooner does not
shorten it: its extra tokens go to slots nobody reads and are dropped). `update()` applies the results.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from typing import Callable

from jaxserve.config import EngineConfig
from jaxserve.engine.batch import ScheduledSeq, SchedulerOutput, StepResult
from jaxserve.engine import multimodal, speculative
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.sequence import FinishReason, Sequence, SeqStatus

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, engine_cfg: EngineConfig, block_manager: BlockManager):
        self.cfg = engine_cfg
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the tail is preempted first
        self._free_rows = list(range(engine_cfg.max_num_seqs))
        heapq.heapify(self._free_rows)
        self._finished_log: list[Sequence] = []
        self.spec_proposed = 0  # speculative decoding: draft tokens fed, and how many the model agreed with
        self.spec_accepted = 0
        self.spec_pause = speculative.BatchPause()

    # ---------------------------------------------------------------- queue management

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def check_prompt_fits(self, num_prompt_tokens: int, max_tokens: int | None = None) -> str | None:
        """Why a prompt can never be served, or None.

        max_tokens is not a reason to refuse: generation simply ends with LENGTH at max_model_len
        (or when a lone sequence fills the whole cache).
        """
        L = self.cfg.max_model_len
        if num_prompt_tokens <= 0:
            return "prompt is empty"
        if num_prompt_tokens >= L:
            return (f"prompt has {num_prompt_tokens} tokens but max_model_len is {L} "
                    f"(the prompt must leave room for at least one generated token)")
        # the prompt plus the slot of the first generated token must fit in the whole cache
        if not self.bm.can_fit_alone(num_prompt_tokens + 1):
            bs, usable = self.bm.block_size, self.bm.num_usable_blocks
            return (f"prompt has {num_prompt_tokens} tokens but the KV cache holds only "
                    f"{usable * bs} tokens ({usable} blocks of {bs}), and the prompt plus one "
                    f"generated token needs {num_prompt_tokens + 1}")
        return None

    def _remove_running(self, seq: Sequence) -> None:
        # by identity: dataclass equality would compare whole token lists
        for i, s in enumerate(self.running):
            if s is seq:
                del self.running[i]
                return

    def _release(self, seq: Sequence) -> None:
        self.bm.free(seq)
        if seq.row >= 0:
            heapq.heappush(self._free_rows, seq.row)
            seq.row = -1

    def finish_seq(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End seq now (stop string found by the engine, abort, ...): frees its blocks and row."""
        if seq.is_finished:
            return
        self._remove_running(seq)
        for i, s in enumerate(self.waiting):
            if s is seq:
                del self.waiting[i]
                break
        self._release(seq)
        seq.finish(reason, stop_reason)
        self._finished_log.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every choice of request_id that is still waiting or running."""
        hit = [s for s in self.running if s.request_id == request_id]
        hit += [s for s in self.waiting if s.request_id == request_id]
        for s in hit:
            self.finish_seq(s, FinishReason.ABORT)
        return hit

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        # recompute: drop the KV, keep the tokens; it resumes from the front of the queue
        self._remove_running(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _make_room(self, seq: Sequence, n: int, scheduled: set[int], out: SchedulerOutput,
                   yield_self: bool) -> bool:
        """Preempt newer unscheduled sequences until seq can get slots for n more positions.

        Returns False when seq cannot run this step: it is then preempted itself (yield_self),
        finished (it could never fit), or left as it is to wait for a later step.
        """
        if not self.bm.can_fit_alone(seq.num_computed_tokens + n):
            # could not fit even with the whole cache to itself: end it instead of thrashing
            self.finish_seq(seq, FinishReason.LENGTH)
            return False
        while not self.bm.can_append(seq, n):
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
            if victim is None or victim is seq:
                # only older or already scheduled sequences hold the blocks
                if yield_self:
                    self._preempt(seq, out)
                return False
            self._preempt(victim, out)
        return True

    # ---------------------------------------------------------------- scheduling

    def _remaining(self, seq: Sequence) -> int:
        """Tokens seq may still generate."""
        left = self._room(seq)
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - len(seq.output_token_ids))
        return max(1, left)

    def _room(self, seq: Sequence) -> int:
        """Tokens seq may still generate before it reaches max_model_len (a hard bound on positions:
        the block tables have no entries past it)."""
        return max(1, self.cfg.max_model_len - seq.num_tokens)

    def _multi_step(self, seqs, K: int, done: int = 0) -> int:
        """Steps for a multi-step decode of seqs after `done` steps already in flight: at most K, no
        position past any sequence's max_model_len, and no more than the longest still wants. A
        sequence that reaches its max_tokens earlier does not shorten the step for the others: the
        device computes (and the host drops) its last few tokens, whose K/V land past the slots it
        was given (its own last block's free slots, or the null block 0 the block tables are padded
        with). Ending by length one after another (staggered requests) would otherwise cut every
        multi-step short and make each next step wait for the host. Exception: while a request waits
        for a row, the step ends with the first sequence to end by length, so the row frees then."""
        want = (min if self.waiting else max)(self._remaining(s) for s in seqs)
        return min(K, want - done, min(self._room(s) for s in seqs) - done)

    def _may_draft(self, seq: Sequence, ahead: int = 0) -> bool:
        """Whether seq would look for a draft `ahead` decode steps from now: speculation on, the batch not
        over disable_by_batch_size, neither the batch nor seq pausing (engine/speculative.py)."""
        return (bool(self.cfg.num_speculative_tokens)
                and not 0 < self.cfg.speculative_disable_by_batch_size < len(self.running)
                and not self.spec_pause.active(ahead) and speculative.may_draft(seq, ahead))

    def _draft(self, seq: Sequence) -> tuple[int, ...]:
        """Speculative tokens for a decode of seq (engine/speculative.py), none past what it may generate."""
        if not self._may_draft(seq):
            return ()
        k = min(self.cfg.num_speculative_tokens, self._remaining(seq) - 1, self._room(seq) - 1)
        if k <= 0:
            return ()
        if self.cfg.speculative_model is not None:  # a draft model proposes, on the device, before dispatch
            return (speculative.PENDING,) * k
        return tuple(speculative.propose(seq.all_token_ids, k, self.cfg.prompt_lookup_max, self.cfg.prompt_lookup_min))

    def _slots_for(self, seq: Sequence, steps: int) -> int:
        """Positions seq needs slots for in `steps` decode steps: none past its last token."""
        return min(steps, self._remaining(seq))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # Sequences ended outside a step (could never fit, aborted, stop string) are reported once.
        out.finished, self._finished_log = self._finished_log, []
        budget = self.cfg.max_step_tokens
        scheduled: set[int] = set()

        Q = self.cfg.attn_tile

        def cost(n: int) -> int:
            # The runner pads every multi-token chunk to whole query tiles: charge what it lays out.
            return n if n == 1 else -(-n // Q) * Q

        def chunk(n: int) -> int:
            """Largest chunk of at most n tokens whose padded cost fits the budget (0: none)."""
            if n <= 1 or cost(n) <= budget:
                return n if cost(n) <= budget else 0
            return min(n, budget // Q * Q)

        def whole_runs(seq: Sequence, n: int) -> int:
            """n, or less so that the chunk does not cut an image run whose rows attend both ways (0: wait)."""
            s = seq.num_computed_tokens
            e = multimodal.chunk_end(seq.mm, s, s + n)
            return e - s if e - s <= n else 0

        def put(seq: Sequence, n: int, reset_row: bool = False, draft: tuple = ()) -> None:
            nonlocal budget
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, reset_row, draft=draft))
            scheduled.add(seq.seq_id)
            budget -= cost(n)

        def admit(seq: Sequence, n: int) -> None:
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.row = heapq.heappop(self._free_rows)
            self.running.append(seq)
            put(seq, n, reset_row=True)

        # 0. a prefill whose next chunk is a whole image run of two-way attention (Gemma 3) goes first: after the
        #    decodes the budget left might never hold the run (it is checked to fit a whole step at start-up)
        for seq in list(self.running):
            if seq.status == SeqStatus.RUNNING and seq.is_prefill and multimodal.at_run(seq.mm, seq.num_computed_tokens):
                n = whole_runs(seq, chunk(min(seq.num_tokens - seq.num_computed_tokens, self.bm.capacity(seq))))
                if n > 0 and self.bm.can_append(seq, n):
                    self.bm.append_slots(seq, n)
                    put(seq, n)
        # ... and so does the first waiting request whose prefix-cache hit ends at or inside such a run
        head = self.waiting[0] if self.waiting and len(self.running) < self.cfg.max_num_seqs else None
        if head is not None and head.mm is not None and head.mm.bidirectional and budget >= Q:
            if self.bm.allocate_prompt(head, budget):
                n = whole_runs(head, chunk(head.num_tokens - head.num_computed_tokens))
                if multimodal.at_run(head.mm, head.num_computed_tokens) and n > 0:
                    admit(head, n)
                else:  # not at a run (step 3 admits it in turn) or the run does not fit yet
                    self.bm.undo_allocate_prompt(head)

        # 1. decodes: one token each (budget >= max_num_seqs, so they always fit; after step 0, most)
        for seq in list(self.running):
            if seq.status != SeqStatus.RUNNING or seq.is_prefill or budget <= 0:
                continue
            # a decode that cannot get a slot is the newest running seq: it yields to the rest
            if self._make_room(seq, 1, scheduled, out, yield_self=True):
                draft = self._draft(seq)
                # a draft rides along only where its slots are free and the others' decodes still fit
                if draft and not (self.bm.can_append(seq, 1 + len(draft))
                                  and cost(1 + len(draft)) <= budget - len(self.running)):
                    draft = ()
                self.bm.append_slots(seq, 1 + len(draft))
                put(seq, 1 + len(draft), draft=draft)

        # 2. running sequences in the middle of a (chunked) prefill
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status != SeqStatus.RUNNING or seq.seq_id in scheduled:
                continue
            # blocked only by decodes already in this step: keep its blocks and wait; those
            # decodes preempt it (or themselves, if newer) when they next need a block
            if not self._make_room(seq, 1, scheduled, out, yield_self=False):
                continue
            # a smaller chunk beats preempting someone: take what the free blocks allow
            n = whole_runs(seq, chunk(min(seq.num_tokens - seq.num_computed_tokens, self.bm.capacity(seq))))
            if n <= 0:
                continue
            self.bm.append_slots(seq, n)
            put(seq, n)

        # 3. admit waiting sequences, first come first served
        while self.waiting and budget >= Q and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if not self.bm.allocate_prompt(seq, budget):
                if not self.running:
                    # nothing else holds blocks and it still does not fit: it never will
                    self.finish_seq(seq, FinishReason.LENGTH)
                    continue
                break
            n = whole_runs(seq, chunk(seq.num_tokens - seq.num_computed_tokens))
            if n <= 0:  # its first chunk would cut an image run that the budget left cannot hold: next step
                self.bm.undo_allocate_prompt(seq)
                break
            admit(seq, n)

        out.decode_steps = self._pick_decode_steps(out)
        return out

    def _pick_decode_steps(self, out: SchedulerOutput) -> int:
        K = self.cfg.decode_steps
        if K <= 1 or not out.scheduled or out.preempted:
            return 1
        # anyone waiting for a free seat should get it next step, not K steps later
        if self.waiting and len(self.running) < self.cfg.max_num_seqs:
            return 1
        if len(out.scheduled) != len(self.running):
            return 1  # a running prefill sat this step out for blocks: do not keep it waiting K
        for s in out.scheduled:
            # structured output: each token's mask needs the token before it on the host
            if s.num_new != 1 or not s.samples or s.reset_row or s.seq.matcher is not None:
                return 1
        K = self._multi_step([s.seq for s in out.scheduled], K)
        if K <= 1:
            return 1
        # lookahead slots for every position a sequence keeps, or no multi-step at all
        need = sum(self.bm.blocks_needed(s.seq, self._slots_for(s.seq, K)) for s in out.scheduled)
        if need > self.bm.num_free_blocks:
            return 1
        for s in out.scheduled:
            self.bm.append_slots(s.seq, self._slots_for(s.seq, K))
        return K

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The decode step after `prev` — a multi-step decode dispatched but not yet read — assuming
        every sequence in it takes all of its tokens. Sequences that in fact stop inside `prev` are
        skipped when this step's results arrive (update() ignores finished sequences; what the device
        computed for them is dropped); those that end by length inside `prev` are left out of it.
        None when the next step needs the host: someone waits to be admitted, everyone ends inside
        `prev`, or the blocks for both steps are short."""
        K0 = prev.decode_steps
        if K0 < 2 or prev.preempted or self.waiting or self._finished_log:
            return None
        items = [s for s in prev.scheduled if s.seq.status == SeqStatus.RUNNING]
        if not items or len(items) != len(self.running):
            return None
        for s in items:
            if (s.num_new != 1 or not s.samples or s.start != s.seq.num_computed_tokens
                    or s.seq.matcher is not None):
                return None
        if any(self._may_draft(s.seq, ahead=K0) for s in items):
            return None  # a draft is looked up on the host after every dispatch (schedule())
        items = [s for s in items if self._remaining(s.seq) > K0]  # the rest end by length in prev
        if not items:
            return None
        K = self._multi_step([s.seq for s in items], self.cfg.decode_steps, K0)
        if K < 1:
            return None
        need = sum(self.bm.blocks_needed(s.seq, self._slots_for(s.seq, K0 + K)) for s in items)
        if need > self.bm.num_free_blocks:
            return None
        for s in items:
            self.bm.append_slots(s.seq, self._slots_for(s.seq, K0 + K))
        return SchedulerOutput(scheduled=[ScheduledSeq(s.seq, s.start + K0, 1, ahead=True) for s in items],
                               decode_steps=K)

    # ---------------------------------------------------------------- results

    def _stops(self, seq: Sequence, tok: int, eos_check: Callable[[int], bool]) -> bool:
        p = seq.params
        if len(seq.output_token_ids) > p.min_tokens:
            if tok in p.stop_token_ids:
                seq.finish(FinishReason.STOP, tok)
                seq.ended_on_token = True
                return True
            if not p.ignore_eos and eos_check(tok):
                seq.finish(FinishReason.STOP)
                seq.ended_on_token = True
                return True
        if p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens:
            seq.finish(FinishReason.LENGTH)
            return True
        if seq.num_tokens >= self.cfg.max_model_len:
            seq.finish(FinishReason.LENGTH)
            return True
        return False

    @staticmethod
    def _grammar_stops(seq: Sequence, tok: int) -> bool:
        """Structured output: feed the token to the sequence's grammar; the output ends when the
        grammar is complete. A token the grammar refuses can only come from a row whose mask left
        nothing (min_tokens banning EOS where the grammar allows only EOS): it is dropped and the
        output ends there."""
        m = seq.matcher
        if m is None:
            return False
        if not m.accept(tok):
            log.warning("seq %d (request %s): token %d outside its grammar (%s); the output ends here",
                        seq.seq_id, seq.request_id, tok, m.error or "no token was allowed")
            seq.output_token_ids.pop()
            if len(seq.output_logprobs) > len(seq.output_token_ids):
                seq.output_logprobs.pop()
            seq.finish(FinishReason.STOP)
            return True
        if m.done:  # complete (EOS included): nothing more can follow
            seq.finish(FinishReason.STOP)
            return True
        return False

    def update(self, sched_out: SchedulerOutput, result: StepResult,
               eos_check: Callable[[int], bool]) -> list[Sequence]:
        """Apply one step's results. Returns the sequences that got tokens or finished."""
        changed: list[Sequence] = []
        K = sched_out.decode_steps
        drafted = accepted = 0
        for i, ss in enumerate(sched_out.scheduled):
            seq = ss.seq
            if seq.status != SeqStatus.RUNNING:
                continue  # aborted or stopped while the step ran: its blocks are already gone
            if ss.start != seq.num_computed_tokens:
                raise RuntimeError(f"seq {seq.seq_id}: step started at {ss.start} but "
                                   f"{seq.num_computed_tokens} tokens are computed")
            samples = ss.samples
            plp = result.prompt_logprobs[i] if result.prompt_logprobs else None
            if plp:
                self._add_prompt_logprobs(seq, ss.start, plp)
            seq.num_computed_tokens += ss.num_new - len(ss.draft)  # accepted drafts count below, as fed
            if samples:
                toks = result.tokens[i]
                if not toks:
                    raise RuntimeError(f"seq {seq.seq_id} was due a sampled token but got none")
                if ss.draft:
                    toks = self._verified(ss.draft, result.verify[i], toks[0])
                    speculative.after_verify(seq, len(ss.draft), len(toks) - 1)
                    drafted, accepted = drafted + len(ss.draft), accepted + len(toks) - 1
                lps = result.logprobs[i] if result.logprobs else None
                for j, tok in enumerate(toks if ss.draft else toks[:K]):
                    if j:
                        seq.num_computed_tokens += 1  # the previous sampled token was fed back
                    seq.output_token_ids.append(int(tok))
                    if lps is not None and j < len(lps):
                        seq.output_logprobs.append(lps[j])
                    if seq.first_token_time is None:
                        seq.first_token_time = time.monotonic()
                    # the grammar first: a token it refuses is dropped even where max_tokens ends the output
                    if self._grammar_stops(seq, int(tok)) or self._stops(seq, int(tok), eos_check):
                        break  # tokens after the stop are dropped
            # name newly full blocks before a finished seq gives them back, so they stay cached
            self.bm.commit_computed(seq)
            if seq.is_finished:
                self._remove_running(seq)
                self._release(seq)
            if samples or seq.is_finished:
                changed.append(seq)
        if self.cfg.num_speculative_tokens:
            self.spec_pause.after_step(K, drafted, accepted)
        return changed

    def _verified(self, draft: tuple[int, ...], argmax: list[int], bonus: int) -> list[int]:
        """A draft's tokens the model agrees with (its greedy token at each position), then the model's own
        token at the first disagreement, or the token sampled after the chunk when all agreed."""
        n = speculative.agreeing(draft, argmax)
        self.spec_proposed += len(draft)
        self.spec_accepted += n
        # all agreeing: the pick after the last draft token (sampled with the draft counted by the penalties,
        # unlike `bonus`, the step's own sample at the chunk's end)
        return list(draft[:n]) + [argmax[n] if n < len(argmax) else bonus]

    @staticmethod
    def _add_prompt_logprobs(seq: Sequence, start: int, plp: list) -> None:
        # entry j is for position start + 1 + j; keep only prompt positions not recorded yet
        # (a recompute after preemption sends them again)
        P = seq.num_prompt_tokens
        for j, entry in enumerate(plp):
            pos = start + 1 + j
            if pos >= P:
                break
            if pos == len(seq.prompt_logprobs) + 1:
                seq.prompt_logprobs.append(entry)
