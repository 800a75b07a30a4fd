"""AsyncEngine against a fake LLMEngine (no JAX, no model): the threading and failure contracts."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from jaxserve.engine.async_engine import AsyncEngine, EngineStopped, QueueFull, RequestFailed
from jaxserve.engine.output import SeqOutput
from jaxserve.engine.sampling_params import SamplingParams, SamplingParamsError
from jaxserve.engine.sequence import FinishReason, Sequence, SeqStatus

POISON = 666  # a prompt containing this token makes the next step raise


class FakeEngine:
    """One token per running sequence per step; the first `rows` sequences run, the rest wait."""

    def __init__(self, rows: int = 2, step_s: float = 0.005):
        self.rows, self.step_s = rows, step_s
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.requests: dict[str, list[Sequence]] = {}
        self.text_states: dict = {}
        self.scheduler = SimpleNamespace(num_running=0, waiting=self.waiting)
        self.freed: list[str] = []
        self.steps = 0
        self.thread_ids: set[int] = set()

    def validate(self, ids, params):
        if not ids:
            raise SamplingParamsError("the prompt is empty", "prompt")

    def add_request(self, rid, ids, params, arrival_time=None, lora_request=None):
        import threading

        self.thread_ids.add(threading.get_ident())
        seqs = [Sequence(request_id=rid, prompt_token_ids=list(ids), params=params, choice_index=i)
                for i in range(params.n)]
        self.requests[rid] = seqs
        self.waiting.extend(seqs)
        return seqs

    def abort_request(self, rid):
        for s in self.requests.pop(rid, []):
            if s in self.running:
                self.running.remove(s)
            if s in self.waiting:
                self.waiting.remove(s)
            s.finish(FinishReason.ABORT)
        self.freed.append(rid)

    def has_unfinished(self):
        return bool(self.running or self.waiting)

    def step(self):
        import threading

        self.thread_ids.add(threading.get_ident())
        while self.waiting and len(self.running) < self.rows:
            s = self.waiting.pop(0)
            s.status = SeqStatus.RUNNING
            self.running.append(s)
        self.scheduler.num_running = len(self.running)
        time.sleep(self.step_s)
        self.steps += 1
        if any(POISON in s.prompt_token_ids for s in self.running):
            raise RuntimeError("poisoned batch")
        outs = []
        for s in list(self.running):
            s.output_token_ids.append(7)
            done = len(s.output_token_ids) >= s.params.max_tokens
            if done:
                s.finish(FinishReason.LENGTH)
                self.running.remove(s)
            outs.append(SeqOutput(s, [7], "x", done))
        return outs

    def _retire(self, seq):
        pass

    def stats(self):
        return {"num_running": len(self.running), "num_waiting": len(self.waiting)}


async def collect(stream):
    texts, errors, reasons = {}, [], {}
    async for rid, item in stream:
        if isinstance(item, BaseException):
            errors.append((rid, item))
            continue
        key = (rid, item.seq.choice_index)
        texts[key] = texts.get(key, "") + item.new_text
        if item.finished:
            reasons[key] = item.seq.finish_reason.value
    return texts, errors, reasons


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_requests_stream_and_engine_runs_on_its_own_thread():
    import threading

    async def go():
        fake = FakeEngine()
        ae = AsyncEngine(fake, max_queue=10)
        ae.start()
        s1, s2 = ae.open_stream(), ae.open_stream()
        ae.submit(s1, [("a", [1, 2], SamplingParams(max_tokens=3, n=2))])
        ae.submit(s2, [("b", [1], SamplingParams(max_tokens=5)), ("c", [2], SamplingParams(max_tokens=1))])
        r1, r2 = await asyncio.gather(collect(s1), collect(s2))
        await ae.shutdown(1)
        return fake, r1, r2

    fake, (t1, e1, f1), (t2, e2, f2) = run(go())
    assert t1 == {("a", 0): "xxx", ("a", 1): "xxx"} and not e1 and set(f1.values()) == {"length"}
    assert t2 == {("b", 0): "xxxxx", ("c", 0): "x"} and not e2
    assert fake.thread_ids and threading.get_ident() not in fake.thread_ids


def test_validation_errors_are_synchronous():
    async def go():
        ae = AsyncEngine(FakeEngine(), max_queue=10)
        ae.start()
        with pytest.raises(SamplingParamsError):
            ae.submit(ae.open_stream(), [("ok", [1], SamplingParams()), ("bad", [], SamplingParams())])
        await asyncio.sleep(0.05)
        assert ae.num_live == 0  # all or nothing: the good prompt was not queued either
        await ae.shutdown(1)

    run(go())


def test_a_failing_step_fails_its_requests_but_not_the_loop():
    async def go():
        fake = FakeEngine(rows=1)
        ae = AsyncEngine(fake, max_queue=10)
        ae.start()
        bad, good = ae.open_stream(), ae.open_stream()
        ae.submit(bad, [("bad", [POISON], SamplingParams(max_tokens=3))])
        ae.submit(good, [("good", [1], SamplingParams(max_tokens=3))])
        rb, rg = await asyncio.gather(collect(bad), collect(good))
        later = ae.open_stream()
        ae.submit(later, [("later", [1], SamplingParams(max_tokens=2))])
        rl = await collect(later)
        await ae.shutdown(1)
        return fake, ae, rb, rg, rl

    fake, ae, rb, rg, rl = run(go())
    assert len(rb[1]) == 1 and isinstance(rb[1][0][1], RequestFailed)
    assert "bad" in fake.freed
    assert rg[0] == {("good", 0): "xxx"} and not rg[1]
    assert rl[0] == {("later", 0): "xx"}
    assert ae.steps_failed == 1


def test_abort_ends_the_stream_and_frees_at_once():
    async def go():
        fake = FakeEngine(rows=1, step_s=0.01)
        ae = AsyncEngine(fake, max_queue=10)
        ae.start()
        s = ae.open_stream()
        ae.submit(s, [("long", [1], SamplingParams(max_tokens=10_000))])
        n = 0
        async for rid, out in s:
            n += 1
            if n == 3:
                s.abort()
            if out.finished:
                assert out.seq.finish_reason == FinishReason.ABORT
        assert "long" in fake.freed and not fake.has_unfinished()
        await ae.shutdown(1)

    run(go())


def test_queue_full_and_shutdown():
    async def go():
        fake = FakeEngine(rows=1, step_s=0.02)
        ae = AsyncEngine(fake, max_queue=2)
        ae.start()
        streams = []
        with pytest.raises(QueueFull):
            for i in range(10):
                st = ae.open_stream()
                ae.submit(st, [(f"r{i}", [1], SamplingParams(max_tokens=50))])
                streams.append(st)
        with pytest.raises(SamplingParamsError):  # more prompts than the queue can ever hold
            ae.submit(ae.open_stream(), [(f"m{i}", [1], SamplingParams()) for i in range(3)])
        t0 = time.monotonic()
        task = asyncio.gather(*[collect(st) for st in streams])
        await ae.shutdown(0.05)  # no time to finish: the rest is aborted
        res = await task
        with pytest.raises(EngineStopped):
            ae.submit(ae.open_stream(), [("late", [1], SamplingParams())])
        return res, time.monotonic() - t0

    res, dt = run(go())
    assert dt < 10
    assert all(set(r[2].values()) <= {"abort", "length"} and r[2] for r in res)
    assert any("abort" in r[2].values() for r in res)


def test_a_call_posted_as_the_engine_stops_is_refused_not_lost():
    """AsyncEngine.call racing the engine thread's last drain: the caller gets EngineStopped (it used to
    wait for ever), and a call after the stop is refused at once."""
    import threading

    async def go():
        fake = FakeEngine()
        entered, gate = threading.Event(), threading.Event()
        add = fake.add_request

        def held_add(*a, **k):  # keeps the engine thread inside the commands it has drained
            entered.set()
            gate.wait(10)
            return add(*a, **k)

        fake.add_request = held_add
        ae = AsyncEngine(fake)
        ae.start()
        st = ae.open_stream()
        ae.submit(st, [("r", [1], SamplingParams(max_tokens=3))])
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        call = asyncio.ensure_future(ae.call(lambda: 42))
        await asyncio.sleep(0.01)  # posted behind the drained add
        with ae._cv:  # the stop shutdown() sets, here without its grace period
            ae._stop = True
        gate.set()
        with pytest.raises(EngineStopped):
            await asyncio.wait_for(call, 10)
        with pytest.raises(EngineStopped):
            await ae.call(lambda: 1)
        _, _, reasons = await asyncio.wait_for(collect(st), 10)
        await asyncio.get_running_loop().run_in_executor(None, ae._thread.join, 10)
        return reasons, ae._thread.is_alive()

    reasons, alive = run(go())
    assert reasons == {("r", 0): "abort"} and not alive
