"""Scheduler driven by a fake runner (host only, no model).

The fake runner stands in for the device: it checks that every position a step touches has a KV
slot, writes the token id of each processed position into a fake KV cache, checks that everything
attention would read ([0, start)) holds the sequence's own tokens (this is what catches a wrong
prefix-cache hit or a block reused too early), and "samples" a deterministic token that depends only
on (sequence, position), so preemption by recompute must reproduce the same outputs.
"""

import collections
import random
import subprocess
import sys

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.batch import StepResult
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import FinishReason, Sequence, SeqStatus

EOS = 2


def default_token(seq, pos):
    return 10 + (seq.seq_id * 7919 + pos * 104729) % 5000  # never EOS


class FakeRunner:
    def __init__(self, bm: BlockManager, token_fn=default_token, prompt_logprobs=False):
        self.bm = bm
        self.bs = bm.block_size
        self.kv = [[None] * bm.block_size for _ in range(bm.num_blocks)]
        self.token_fn = token_fn
        self.prompt_logprobs = prompt_logprobs

    def _slot(self, seq, pos):
        assert pos < len(seq.block_table) * self.bs, f"seq {seq.seq_id}: no slot for position {pos}"
        return seq.block_table[pos // self.bs], pos % self.bs

    def _write(self, seq, pos, tok, dropped=False):
        if dropped and pos >= len(seq.block_table) * self.bs:
            # as the real runner: block tables are padded with the null block 0, where the K/V of a
            # sequence's tokens past its max_tokens (never kept) may land inside a multi-step decode
            self.kv[0][pos % self.bs] = tok
            return
        b, o = self._slot(seq, pos)
        assert b != 0
        self.kv[b][o] = tok

    def _check_prefix(self, seq, upto):
        for pos in range(upto):
            b, o = self._slot(seq, pos)
            assert self.kv[b][o] == seq.token_at(pos), (
                f"seq {seq.seq_id} position {pos}: cache holds {self.kv[b][o]}, token is {seq.token_at(pos)}")

    def run(self, out):
        tokens, logprobs, plps = [], [], []
        K = out.decode_steps
        for ss in out.scheduled:
            seq = ss.seq
            assert ss.start == seq.num_computed_tokens
            assert 0 not in seq.block_table
            self._check_prefix(seq, ss.start)
            for pos in range(ss.start, ss.start + ss.num_new):
                self._write(seq, pos, seq.token_at(pos))
            if self.prompt_logprobs:
                plps.append([(-0.5, [])] * ss.num_new)
            else:
                plps.append(None)
            if not ss.samples:
                tokens.append([])
                logprobs.append(None)
                continue
            n = seq.num_tokens
            toks = [self.token_fn(seq, n + j) for j in range(K)]
            # tokens the host keeps at most (max_tokens); the K/V of the last kept one and later is
            # never read, so only those writes may lack a slot
            keep = K if seq.params.max_tokens is None else seq.params.max_tokens - len(seq.output_token_ids)
            for j in range(1, K):  # steps 2..K process the token sampled before them
                self._write(seq, n - 1 + j, toks[j - 1], dropped=j >= keep)
            tokens.append(toks)
            logprobs.append([(-1.0, [(t, -1.0)]) for t in toks] if seq.params.logprobs is not None else None)
        return StepResult(tokens, logprobs, plps)


def check_invariants(sched: Scheduler, out=None):
    bm, cfg = sched.bm, sched.cfg
    bm.check_consistency()
    holders = collections.Counter()
    where = {}
    for s in sched.running:
        assert s.status == SeqStatus.RUNNING
        assert len(set(s.block_table)) == len(s.block_table), "block twice in one table"
        assert 0 not in s.block_table
        for i, b in enumerate(s.block_table):
            holders[b] += 1
            # a block in several tables is a shared, named prefix block at the same depth
            if b in where:
                assert bm.is_cached(b), f"block {b} shared but not a cached prefix block"
                assert where[b] == i
            where[b] = i
    for b in range(1, bm.num_blocks):
        assert bm.ref_count(b) == holders[b], f"block {b}: ref {bm.ref_count(b)} vs {holders[b]} tables"
    assert bm.num_used_blocks == len(holders)
    rows = [s.row for s in sched.running]
    assert len(set(rows)) == len(rows) and all(0 <= r < cfg.max_num_seqs for r in rows)
    assert len(sched.running) <= cfg.max_num_seqs
    for s in sched.waiting:
        assert s.status == SeqStatus.WAITING and s.block_table == [] and s.row == -1
    if out is not None:
        assert out.num_tokens <= cfg.max_step_tokens
        ids = [ss.seq.seq_id for ss in out.scheduled]
        assert len(set(ids)) == len(ids)
        for ss in out.scheduled:
            assert ss.num_new >= 1
            assert ss.start + ss.num_new <= ss.seq.num_tokens
            if out.decode_steps > 1:
                assert ss.num_new == 1 and ss.samples


def make(cfg_kw=None, num_blocks=64, enable_prefix_cache=True, max_cached_blocks=None):
    # attn_tile 1: budgets below count plain tokens (tile padding has its own test)
    cfg = EngineConfig(**{"max_model_len": 128, "max_num_seqs": 4, "block_size": 4,
                          "prefill_chunk_size": 16, "decode_steps": 1, "attn_tile": 1, **(cfg_kw or {})})
    bm = BlockManager(num_blocks, cfg.block_size, enable_prefix_cache, max_cached_blocks)
    return cfg, bm, Scheduler(cfg, bm)


def seq(prompt, rid="r", **kw):
    kw.setdefault("max_tokens", 8)
    return Sequence(rid, list(prompt), SamplingParams(**kw))


def step(sched, runner, eos=lambda t: t == EOS):
    out = sched.schedule()
    check_invariants(sched, out)
    res = runner.run(out)
    changed = sched.update(out, res, eos)
    check_invariants(sched)
    return out, changed


def drain(sched, runner, max_steps=5000, **kw):
    steps = 0
    while sched.has_unfinished():
        out, _ = step(sched, runner, **kw)
        steps += 1
        assert steps < max_steps, "no progress"
        assert not out.is_empty or not sched.has_unfinished(), "empty step with work left"
    assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks, "leaked blocks"
    return steps


def expected_outputs(s, n):
    return [default_token(s, s.num_prompt_tokens + i) for i in range(n)]


# ------------------------------------------------------------------------------------------------


def test_host_modules_do_not_import_jax():
    code = ("import sys; import jaxserve.engine.block_manager, jaxserve.engine.scheduler, jaxserve.engine.structured, "
            "jaxserve.engine.lora_slots; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_single_request_runs_to_max_tokens():
    cfg, bm, sched = make()
    s = seq(range(10), max_tokens=5, logprobs=1)
    sched.add(s)
    runner = FakeRunner(bm)
    out, changed = step(sched, runner)
    assert [(x.start, x.num_new, x.reset_row) for x in out.scheduled] == [(0, 10, True)]
    assert changed == [s] and s.row == 0 and s.first_token_time is not None
    drain(sched, runner)
    assert s.finish_reason == FinishReason.LENGTH
    assert s.output_token_ids == expected_outputs(s, 5)
    assert len(s.output_logprobs) == 5
    assert s.row == -1 and s.block_table == [] and not sched.has_unfinished()


def test_prefix_hits_across_requests_sharing_a_system_prompt():
    cfg, bm, sched = make()
    runner = FakeRunner(bm)
    system = list(range(500, 513))  # 13 tokens: 3 full blocks
    a = seq(system + [1, 2], "a")
    sched.add(a)
    step(sched, runner)  # a's prompt is computed and committed
    b = seq(system + [3, 4, 5], "b")
    c = seq([7] + system[1:] + [3], "c")  # first block differs: no hit at all
    sched.add(b)
    sched.add(c)
    out, _ = step(sched, runner)
    got = {x.seq.request_id: (x.start, x.num_new) for x in out.scheduled}
    assert got["b"] == (12, 4) and b.num_cached_tokens == 12
    assert got["c"] == (0, 11) and c.num_cached_tokens == 0  # the rest of the 16-token budget
    assert b.block_table[:3] == a.block_table[:3]
    assert bm.prefix_hits_tokens == 12
    drain(sched, runner)
    assert b.output_token_ids == expected_outputs(b, 8)


def test_chunked_prefill_splits_a_long_prompt_while_decode_continues():
    cfg, bm, sched = make({"prefill_chunk_size": 16})
    runner = FakeRunner(bm)
    a = seq(range(5), "a", max_tokens=50)
    sched.add(a)
    step(sched, runner)
    long = seq(range(100, 160), "long", max_tokens=2)  # 60 tokens
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 60 and not long.is_finished:
        before = len(a.output_token_ids)
        out, _ = step(sched, runner)
        assert out.num_tokens <= 16
        got = {x.seq.request_id: x for x in out.scheduled}
        assert got["a"].num_new == 1 and len(a.output_token_ids) == before + 1
        chunks.append(got["long"].num_new)
    assert chunks == [15, 15, 15, 15]
    assert len(long.output_token_ids) == 1  # the last chunk sampled
    drain(sched, runner)
    assert long.output_token_ids == expected_outputs(long, 2)


def test_whole_prompts_when_chunking_is_off():
    cfg, bm, sched = make({"prefill_chunk_size": 0, "max_model_len": 128}, num_blocks=128)
    runner = FakeRunner(bm)
    s = seq(range(100), max_tokens=2)
    sched.add(s)
    out, _ = step(sched, runner)
    assert out.scheduled[0].num_new == 100 and cfg.max_step_tokens == 128


def test_preemption_under_a_tiny_cache_then_everything_completes():
    # 8 usable blocks of 4 = 32 slots; each request needs 6 + 20 = 26 positions
    cfg, bm, sched = make({"max_num_seqs": 4}, num_blocks=9)
    runner = FakeRunner(bm)
    seqs = [seq(range(10 * i, 10 * i + 6), f"r{i}", max_tokens=20) for i in range(4)]
    for s in seqs:
        sched.add(s)
    preempted = 0
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        preempted += len(out.preempted)
        for p in out.preempted:
            assert p.num_computed_tokens == 0 and p.status == SeqStatus.WAITING
    assert preempted > 0 and sum(s.num_preemptions for s in seqs) == preempted
    for s in seqs:
        assert s.finish_reason == FinishReason.LENGTH
        assert s.output_token_ids == expected_outputs(s, 20)
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_preempted_sequence_gets_reset_row_again():
    cfg, bm, sched = make({"max_num_seqs": 2}, num_blocks=5)  # 16 slots
    runner = FakeRunner(bm)
    a, b = seq(range(6), "a", max_tokens=9), seq(range(20, 26), "b", max_tokens=9)
    sched.add(a)
    sched.add(b)
    resets = collections.Counter()
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        for x in out.scheduled:
            resets[x.seq.request_id] += x.reset_row
    assert b.num_preemptions >= 1 and resets["b"] == 1 + b.num_preemptions
    assert resets["a"] == 1 + a.num_preemptions
    assert a.output_token_ids == expected_outputs(a, 9) and b.output_token_ids == expected_outputs(b, 9)


def test_lone_sequence_larger_than_the_cache_ends_with_length():
    cfg, bm, sched = make({"max_model_len": 64}, num_blocks=5)  # 16 slots
    runner = FakeRunner(bm)
    assert sched.check_prompt_fits(10, 100) is None
    s = seq(range(10), max_tokens=100)
    sched.add(s)
    drain(sched, runner)
    assert s.finish_reason == FinishReason.LENGTH
    assert s.num_tokens == 17  # 16 computed slots + the last sampled token


def test_check_prompt_fits_messages():
    cfg, bm, sched = make({"max_model_len": 64}, num_blocks=5)
    msg = sched.check_prompt_fits(64, 10)
    assert "64" in msg and "max_model_len" in msg
    msg = sched.check_prompt_fits(16, 10)
    assert "16 tokens" in msg and "16" in msg
    assert sched.check_prompt_fits(15, None) is None
    assert sched.check_prompt_fits(0, 1) is not None


def test_multi_step_decode_only_when_everything_decodes():
    cfg, bm, sched = make({"decode_steps": 4, "max_num_seqs": 2})
    runner = FakeRunner(bm)
    a = seq(range(6), "a", max_tokens=30)
    sched.add(a)
    out, _ = step(sched, runner)
    assert out.decode_steps == 1  # a prefill step
    out = sched.schedule()
    assert out.decode_steps == 4
    assert len(a.block_table) * 4 >= a.num_computed_tokens + 4  # lookahead slots exist
    sched.update(out, runner.run(out), lambda t: t == EOS)
    assert len(a.output_token_ids) == 5 and a.num_computed_tokens == a.num_tokens - 1
    # a newcomer's prefill forces single steps
    b = seq(range(40, 50), "b", max_tokens=30)
    sched.add(b)
    out, _ = step(sched, runner)
    assert out.decode_steps == 1 and len(out.scheduled) == 2
    out, _ = step(sched, runner)
    assert out.decode_steps == 4
    drain(sched, runner)
    assert a.output_token_ids == expected_outputs(a, 30)
    assert b.output_token_ids == expected_outputs(b, 30)


def test_multi_step_and_the_waiting_queue():
    # waiting but no free seat: nobody could be admitted, so multi-step is fine
    cfg, bm, sched = make({"decode_steps": 4, "max_num_seqs": 1})
    runner = FakeRunner(bm)
    a, b = seq(range(6), "a", max_tokens=30), seq(range(6), "b")
    sched.add(a)
    sched.add(b)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert sched.num_waiting == 1 and out.decode_steps == 4
    # a free seat but no blocks for the newcomer yet: single steps so it gets in soon
    cfg, bm, sched = make({"decode_steps": 4, "max_num_seqs": 2}, num_blocks=5)  # 16 slots
    runner = FakeRunner(bm)
    a, b = seq(range(6), "a", max_tokens=6), seq(range(50, 62), "b", max_tokens=2)
    sched.add(a)
    step(sched, runner)
    sched.add(b)
    out, _ = step(sched, runner)
    assert sched.num_waiting == 1 and out.decode_steps == 1
    drain(sched, runner)
    assert b.output_token_ids == expected_outputs(b, 2)


def test_multi_step_capped_by_remaining_tokens():
    cfg, bm, sched = make({"decode_steps": 8})
    runner = FakeRunner(bm)
    a = seq(range(6), max_tokens=4)
    sched.add(a)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.decode_steps == 3  # 1 generated, 3 left
    assert a.is_finished and a.output_token_ids == expected_outputs(a, 4)
    cfg, bm, sched = make({"decode_steps": 8, "max_model_len": 10})
    runner = FakeRunner(bm)
    b = seq(range(6), max_tokens=100)
    sched.add(b)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.decode_steps == 3 and b.num_tokens == 10 and b.finish_reason == FinishReason.LENGTH


def test_multi_step_falls_back_when_lookahead_blocks_are_missing():
    cfg, bm, sched = make({"decode_steps": 4}, num_blocks=4)  # 12 slots
    runner = FakeRunner(bm)
    a = seq(range(8), max_tokens=20)
    sched.add(a)
    step(sched, runner)  # 2 blocks used, 1 free
    assert bm.num_free_blocks == 1
    out = sched.schedule()  # position 8 needs block 3; 9..11 fit in it too: K=4 fits
    assert out.decode_steps == 4
    sched.update(out, runner.run(out), lambda t: False)
    assert bm.num_free_blocks == 0
    out = sched.schedule()  # position 12 has no block and nobody to preempt: LENGTH
    assert out.is_empty and a.finish_reason == FinishReason.LENGTH

    cfg, bm, sched = make({"decode_steps": 4, "max_num_seqs": 2}, num_blocks=5)  # 16 slots
    runner = FakeRunner(bm)
    a, b = seq(range(7), "a", max_tokens=20), seq(range(20, 27), "b", max_tokens=20)
    sched.add(a)
    sched.add(b)
    step(sched, runner)  # 4 blocks used; both decode next at position 7 (block 1 of each)
    out = sched.schedule()
    assert out.decode_steps == 1  # K=4 needs positions 7..10: 2 more blocks, none free
    sched.update(out, runner.run(out), lambda t: False)


def test_multi_step_not_cut_short_by_one_sequence_ending():
    """A sequence that reaches max_tokens inside a multi-step does not shorten it for the others: it
    gets slots only for its own tokens, its extra tokens are dropped, the others take all K."""
    cfg, bm, sched = make({"decode_steps": 4, "max_num_seqs": 2})
    runner = FakeRunner(bm)
    a, b = seq(range(6), "a", max_tokens=3), seq(range(20, 26), "b", max_tokens=30)
    sched.add(a)
    sched.add(b)
    step(sched, runner)  # both prefilled: one token each
    out = sched.schedule()
    assert out.decode_steps == 4
    assert len(a.block_table) * 4 == 8  # positions 6, 7 (a's last two tokens): no slot past them
    sched.update(out, runner.run(out), lambda t: t == EOS)
    assert a.finish_reason == FinishReason.LENGTH and a.output_token_ids == expected_outputs(a, 3)
    assert len(b.output_token_ids) == 5
    drain(sched, runner)
    assert b.output_token_ids == expected_outputs(b, 30)
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_multi_step_ends_with_the_first_ending_while_someone_waits():
    """All rows taken and a request waiting: the multi-step ends when the first sequence ends by
    length, so the waiting request gets its row then, not up to K-1 steps later."""
    cfg, bm, sched = make({"decode_steps": 4, "max_num_seqs": 2})
    runner = FakeRunner(bm)
    a, b = seq(range(6), "a", max_tokens=2), seq(range(20, 26), "b", max_tokens=30)
    sched.add(a)
    sched.add(b)
    step(sched, runner)  # both prefilled
    c = seq(range(40, 46), "c", max_tokens=5)
    sched.add(c)
    out, _ = step(sched, runner)
    assert out.decode_steps == 1 and a.is_finished  # a's one remaining token: c is admitted next
    out, _ = step(sched, runner)
    assert c.num_computed_tokens > 0 and any(ss.seq is c for ss in out.scheduled)
    drain(sched, runner)
    assert c.output_token_ids == expected_outputs(c, 5) and b.output_token_ids == expected_outputs(b, 30)


def test_staggered_lengths_keep_steps_ahead():
    """Requests that end by length one after another (as a batch admitted over several prefill steps
    does): the step ahead leaves out whoever ends inside the step in flight, so the host is not asked
    for a step every time one ends; outputs equal the step-by-step run's."""
    def run(pipelined):
        cfg, bm, sched = make({"decode_steps": 4, "max_num_seqs": 6}, num_blocks=64)
        runner = FakeRunner(bm, token_fn=_eos_at(set()))  # tokens by request id: the runs compare
        seqs = [seq(range(10 * i, 10 * i + 6), chr(97 + i), max_tokens=20 + i) for i in range(6)]
        for s in seqs:
            sched.add(s)
        step(sched, runner)  # all prefilled in one step
        ahead = _drain_ahead(sched, runner) if pipelined else (drain(sched, runner), 0)[1]
        return [s.output_token_ids for s in seqs], ahead

    want, _ = run(False)
    got, ahead = run(True)
    assert got == want and [len(o) for o in got] == [20 + i for i in range(6)]
    # the longest wants 24 after its first: 6 steps of 4, all but the first ahead (4 when one ending cut the step short)
    assert ahead == 5, ahead


def test_eos_in_the_middle_of_k_tokens_drops_the_rest():
    def tok(s, pos):
        return EOS if pos == s.num_prompt_tokens + 2 else default_token(s, pos)

    cfg, bm, sched = make({"decode_steps": 4})
    runner = FakeRunner(bm, tok)
    a = seq(range(6), max_tokens=30)
    sched.add(a)
    step(sched, runner)
    out, changed = step(sched, runner)
    assert out.decode_steps == 4 and changed == [a]
    assert a.output_token_ids == [tok(a, 6), tok(a, 7), EOS]
    assert a.finish_reason == FinishReason.STOP and a.stop_reason is None
    assert a.block_table == [] and not sched.has_unfinished()
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_stop_tokens_min_tokens_and_ignore_eos():
    def tok(s, pos):
        return EOS if (pos - s.num_prompt_tokens) % 2 == 0 else 77

    cfg, bm, sched = make({"decode_steps": 4})
    runner = FakeRunner(bm, tok)
    a = seq(range(6), "a", max_tokens=30, min_tokens=3)
    b = seq(range(6), "b", max_tokens=5, ignore_eos=True)
    c = seq(range(6), "c", max_tokens=30, stop_token_ids=[77], ignore_eos=True)
    for s in (a, b, c):
        sched.add(s)
    drain(sched, runner)
    assert a.output_token_ids == [EOS, 77, EOS, 77, EOS]  # EOS only counts from the 4th token
    assert a.finish_reason == FinishReason.STOP
    assert b.output_token_ids == [EOS, 77, EOS, 77, EOS] and b.finish_reason == FinishReason.LENGTH
    assert c.output_token_ids == [EOS, 77] and c.finish_reason == FinishReason.STOP and c.stop_reason == 77


def test_abort_waiting_running_and_in_flight():
    cfg, bm, sched = make({"max_num_seqs": 1})
    runner = FakeRunner(bm)
    a, b, c = seq(range(6), "a", max_tokens=50), seq(range(6), "b"), seq(range(9), "c")
    for s in (a, b, c):
        sched.add(s)
    step(sched, runner)
    assert sched.num_running == 1 and sched.num_waiting == 2
    got = sched.abort("b")
    assert got == [b] and b.finish_reason == FinishReason.ABORT and sched.num_waiting == 1
    out = sched.schedule()
    res = runner.run(out)
    assert sched.abort("a") == [a]  # aborted while its step is on the device
    assert bm.num_free_blocks == bm.num_usable_blocks and a.row == -1
    changed = sched.update(out, res, lambda t: False)
    assert changed == [] and a.finish_reason == FinishReason.ABORT
    assert sched.abort("nope") == []
    drain(sched, runner)
    assert c.finish_reason == FinishReason.LENGTH


def test_finish_seq_from_the_engine_frees_blocks_and_row():
    cfg, bm, sched = make()
    runner = FakeRunner(bm)
    a = seq(range(6), max_tokens=50)
    sched.add(a)
    step(sched, runner)
    sched.finish_seq(a, FinishReason.STOP, "###")
    assert a.stop_reason == "###" and a.block_table == [] and a.row == -1
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_usable_blocks


def test_prompt_logprobs_are_collected_once_across_chunks_and_preemption():
    cfg, bm, sched = make({"prefill_chunk_size": 8, "max_num_seqs": 2}, num_blocks=9)
    runner = FakeRunner(bm, prompt_logprobs=True)
    a = seq(range(20), "a", max_tokens=12, prompt_logprobs=1)
    b = seq(range(20), "b", max_tokens=12, prompt_logprobs=1)
    sched.add(a)
    sched.add(b)
    drain(sched, runner)
    assert a.num_preemptions + b.num_preemptions > 0
    assert len(a.prompt_logprobs) == 19 and len(b.prompt_logprobs) == 19


def test_rows_stay_within_max_num_seqs_and_are_reused():
    cfg, bm, sched = make({"max_num_seqs": 2})
    runner = FakeRunner(bm)
    seqs = [seq(range(i, i + 5), str(i), max_tokens=3) for i in range(6)]
    for s in seqs:
        sched.add(s)
    rows = set()
    while sched.has_unfinished():
        step(sched, runner)
        rows |= {s.row for s in sched.running}
    assert rows <= {0, 1}


@pytest.mark.parametrize("seed,num_blocks,arrivals", [(0, 30, [0, 0, 1, 2, 3]),
                                                      (1, 30, [0, 0, 1, 2, 3]),
                                                      (2, 90, [0] * 12 + [1, 3])])
def test_randomized_stress(seed, num_blocks, arrivals):
    rng = random.Random(seed)
    cfg, bm, sched = make({"max_model_len": 96, "max_num_seqs": 6, "prefill_chunk_size": 24,
                           "decode_steps": 4}, num_blocks=num_blocks, max_cached_blocks=12)

    def tok(s, pos):
        # EOS now and then, deterministic per (sequence, position)
        return EOS if (s.seq_id * 31 + pos * 17) % 23 == 0 else default_token(s, pos)

    runner = FakeRunner(bm, tok)
    systems = [[rng.randrange(3, 9000) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    all_seqs, pending, steps, multi = [], 300, 0, 0
    while pending or sched.has_unfinished():
        for _ in range(rng.choice(arrivals)):
            if not pending:
                break
            pending -= 1
            prompt = rng.choice(systems) + [rng.randrange(3, 9000) for _ in range(rng.randrange(1, 40))]
            prompt = prompt[:80]
            mt, ie, mn = rng.randrange(1, 40), rng.random() < 0.3, rng.choice([0, 0, 2])
            s = seq(prompt, f"q{pending}", max_tokens=mt, ignore_eos=ie, min_tokens=min(mn, mt))
            assert sched.check_prompt_fits(len(prompt), s.params.max_tokens) is None
            sched.add(s)
            all_seqs.append(s)
        out = sched.schedule()
        check_invariants(sched, out)
        assert not out.is_empty or not sched.has_unfinished(), "stalled with work left"
        multi += out.decode_steps > 1
        res = runner.run(out)
        if rng.random() < 0.05 and all_seqs:  # abort something, possibly in flight
            sched.abort(rng.choice(all_seqs).request_id)
            check_invariants(sched)
        sched.update(out, res, lambda t: t == EOS)
        check_invariants(sched)
        steps += 1
        assert steps < 20000
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(s.is_finished for s in all_seqs)
    assert multi > 0 and bm.prefix_hits_tokens > 0
    if num_blocks < 40:
        assert sum(s.num_preemptions for s in all_seqs) > 0
    for s in all_seqs:
        if s.finish_reason == FinishReason.ABORT:
            continue
        n = len(s.output_token_ids)
        assert s.output_token_ids == [tok(s, s.num_prompt_tokens + i) for i in range(n)]
        assert n <= s.params.max_tokens and s.num_tokens <= cfg.max_model_len
        if s.finish_reason == FinishReason.STOP:
            assert s.output_token_ids[-1] == EOS and n > s.params.min_tokens
        else:
            assert n == s.params.max_tokens or s.num_tokens == cfg.max_model_len or \
                not bm.can_fit_alone(s.num_tokens)


def test_chunks_are_charged_in_whole_query_tiles():
    """The runner pads each multi-token chunk to whole attention tiles: the scheduler charges that
    padded size, so the step's layout never outgrows the largest compiled bucket."""
    cfg, bm, sched = make({"prefill_chunk_size": 32, "attn_tile": 8})
    runner = FakeRunner(bm)
    a = seq(range(100, 130), "a", max_tokens=3)   # 30 tokens
    b = seq(range(200, 213), "b", max_tokens=3)   # 13 tokens
    sched.add(a)
    sched.add(b)
    for _ in range(40):
        if not sched.has_unfinished():
            break
        out, _ = step(sched, runner)
        padded = sum(x.num_new if x.num_new == 1 else -(-x.num_new // 8) * 8 for x in out.scheduled)
        assert padded <= 32
        for x in out.scheduled:
            # a chunk that does not finish its prompt is a whole number of tiles
            if x.num_new > 1 and x.start + x.num_new < len(x.seq.prompt_token_ids):
                assert x.num_new % 8 == 0
    assert not sched.has_unfinished()
    assert a.output_token_ids == expected_outputs(a, 3) and b.output_token_ids == expected_outputs(b, 3)


# ------------------------------------------------------------------ steps scheduled ahead (async)


def _eos_at(stops):
    """token_fn: EOS at the given absolute positions of the given sequences, else default_token."""
    def fn(seq, pos):  # by request id (seq ids differ between the two runs compared)
        return EOS if (seq.request_id, pos) in stops else 10 + (ord(seq.request_id) * 7919 + pos * 104729) % 5000
    return fn


def _drain_ahead(sched, runner):
    """The engine's async loop on the host: while a multi-step decode is in flight, the next one is
    scheduled ahead (before its results are applied). The fake device skips sequences that ended
    meanwhile (the real one computes them and the host drops the result)."""
    pending, steps, ahead = None, 0, 0
    while sched.has_unfinished() or pending is not None:
        out, pending = (pending if pending is not None else sched.schedule()), None
        if out.is_empty:
            continue
        nxt = sched.schedule_ahead(out)
        if nxt is not None:
            ahead += 1
            check_invariants(sched)
        live = [ss for ss in out.scheduled if ss.seq.status == SeqStatus.RUNNING]
        res = runner.run(type(out)(scheduled=live, decode_steps=out.decode_steps))
        idx = {id(ss): i for i, ss in enumerate(live)}
        full = StepResult([res.tokens[idx[id(ss)]] if id(ss) in idx else [] for ss in out.scheduled],
                          [res.logprobs[idx[id(ss)]] if id(ss) in idx else None for ss in out.scheduled],
                          [None] * len(out.scheduled))
        sched.update(out, full, lambda t: t == EOS)
        check_invariants(sched)
        pending = nxt
        steps += 1
        assert steps < 5000
    assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks, "leaked blocks"
    return ahead


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_steps_scheduled_ahead_give_the_same_outputs(prefix_cache):
    stops = {("b", 6 + 9), ("c", 5 + 4)}  # b stops inside a multi-step, c right after its prefill

    def run(pipelined):
        cfg, bm, sched = make({"decode_steps": 4, "max_num_seqs": 4}, enable_prefix_cache=prefix_cache)
        runner = FakeRunner(bm, token_fn=_eos_at(stops))
        seqs = [seq(range(6), "a", max_tokens=30), seq(range(20, 26), "b", max_tokens=40),
                seq(range(40, 45), "c", max_tokens=25), seq(range(6), "d", max_tokens=13)]
        for s in seqs:
            sched.add(s)
        ahead = _drain_ahead(sched, runner) if pipelined else (drain(sched, runner), 0)[1]
        return [(s.output_token_ids, s.finish_reason) for s in seqs], ahead

    want, _ = run(False)
    got, ahead = run(True)
    assert got == want
    assert ahead > 3
    assert want[1][1] == FinishReason.STOP and len(want[1][0]) == 10  # b: stopped at its EOS
    assert want[3][1] == FinishReason.LENGTH and len(want[3][0]) == 13


def test_schedule_ahead_only_when_nothing_needs_the_host():
    cfg, bm, sched = make({"decode_steps": 4, "max_num_seqs": 2})
    runner = FakeRunner(bm)
    a = seq(range(6), "a", max_tokens=30)
    sched.add(a)
    step(sched, runner)  # prefill
    out = sched.schedule()
    assert out.decode_steps == 4
    nxt = sched.schedule_ahead(out)
    assert nxt is not None and nxt.decode_steps == 4
    assert [(ss.start, ss.ahead, ss.samples) for ss in nxt.scheduled] == [(out.scheduled[0].start + 4, True, True)]
    assert len(a.block_table) * 4 >= a.num_computed_tokens + 8  # slots for both steps
    # someone waiting for a free seat: the next step must be scheduled by the host
    sched.add(seq(range(50, 55), "b"))
    assert sched.schedule_ahead(out) is None
    # a single-step (prefill/mixed) step is never followed ahead
    cfg, bm, sched = make({"decode_steps": 4})
    sched.add(seq(range(6), "c", max_tokens=30))
    first = sched.schedule()
    assert first.decode_steps == 1 and sched.schedule_ahead(first) is None
    # a sequence that ends by length inside the step in flight: no step ahead
    cfg, bm, sched = make({"decode_steps": 4})
    runner = FakeRunner(bm)
    d = seq(range(6), "d", max_tokens=5)
    sched.add(d)
    step(sched, runner)
    out = sched.schedule()
    assert out.decode_steps == 4 and sched.schedule_ahead(out) is None


def test_sequence_token_slice():
    seq = Sequence(request_id="r", prompt_token_ids=[1, 2, 3, 4], params=SamplingParams(),
                   output_token_ids=[5, 6, 7])
    for a in range(8):
        for b in range(a, 10):
            assert seq.token_slice(a, b) == seq.all_token_ids[a:b], (a, b)


def test_image_run_of_two_way_attention_is_one_chunk_and_does_not_starve():
    """Gemma 3's image runs: a chunk stops before a run and the next holds all of it; that chunk goes before
    the decodes (which fill the rest of the budget), else a run as long as the budget would wait for as
    long as anyone decodes."""
    from jaxserve.engine.multimodal import ImageInput, MultiModalPrompt

    cfg, bm, sched = make({"prefill_chunk_size": 16})
    runner = FakeRunner(bm)
    a = seq(range(5), "a", max_tokens=60)
    sched.add(a)
    step(sched, runner)
    img = seq(range(100, 140), "img", max_tokens=2)
    img.mm = MultiModalPrompt(list(img.prompt_token_ids), [ImageInput(6, 16, None, b"x")], bidirectional=True)
    sched.add(img)
    chunks = []
    while img.num_computed_tokens < 40:
        out, _ = step(sched, runner)
        got = {x.seq.request_id: x for x in out.scheduled}
        if "img" in got:
            chunks.append((got["img"].start, got["img"].num_new))
        assert not a.is_finished, "the image run waited for the decodes to end"
    assert chunks[:2] == [(0, 6), (6, 16)]  # before the run, then the whole run (a's decode sat out that step)
    drain(sched, runner)
    assert a.output_token_ids == expected_outputs(a, 60)


def test_waiting_request_at_an_image_run_after_a_cache_hit_does_not_starve():
    """A new Gemma 3 request whose prefix-cache hit ends where an image run begins must take the whole run as
    its first chunk: it is admitted before the decodes take the budget (else it waits for as long as anyone
    decodes)."""
    from jaxserve.engine.multimodal import ImageInput, MultiModalPrompt

    cfg, bm, sched = make({"prefill_chunk_size": 16})
    runner = FakeRunner(bm)

    def image_seq(rid, image_hash):
        s = seq(list(range(100, 108)) + [7] * 16 + list(range(200, 210)), rid, max_tokens=2)
        s.mm = MultiModalPrompt(list(s.prompt_token_ids), [ImageInput(8, 16, None, image_hash)], bidirectional=True)
        return s

    first = image_seq("first", b"x")
    sched.add(first)
    drain(sched, runner)  # its blocks before the image (positions 0-7) stay cached
    a = seq(range(5), "a", max_tokens=60)
    sched.add(a)
    step(sched, runner)
    other = image_seq("other", b"y")  # the same text before another image: a hit of 8 tokens, then the run
    sched.add(other)
    out, _ = step(sched, runner)
    got = {x.seq.request_id: x for x in out.scheduled}
    assert "other" in got and (got["other"].start, got["other"].num_new) == (8, 16), "waited for the decodes"
    assert other.num_cached_tokens == 8
    drain(sched, runner)
    assert a.output_token_ids == expected_outputs(a, 60) and other.is_finished
