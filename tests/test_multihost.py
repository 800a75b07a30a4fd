"""Two JAX processes on 127.0.0.1 (jax.distributed, gloo CPU collectives), tp=2 across them: rank 0 schedules
and publishes each step, rank 1 runs it on its shard. Same greedy tokens as one process; killing rank 1 makes
rank 0 exit with a one-line error instead of hanging in a collective."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hf_tiny import make_tiny_model
from par_util import complete, free_port, wait_healthy
from tiny_tokenizer import add_byte_tokenizer

HERE = Path(__file__).parent
WORKER = HERE / "mh_worker.py"


def _env():
    env = dict(os.environ, JAXSERVE_NO_PROGRESS="1", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(HERE) + os.pathsep + str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    return env


ENGINE_FLAGS = ["--max-model-len", "64", "--max-num-seqs", "2", "--prefill-chunk-size", "16", "--block-size", "4"]


def _cli(model_dir, cmd, rank, port, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", cmd, "--model", str(model_dir), "--tp", "2", "--num-nodes", "2",
         "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port), *ENGINE_FLAGS, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_byte_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("mh"), num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=8))


@pytest.fixture(scope="module")
def reference(model_dir):
    """One process, one device."""
    ref = subprocess.run([sys.executable, str(WORKER), str(model_dir), "single", "0", "0"], capture_output=True,
                         text=True, env=_env(), timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return json.loads(ref.stdout.strip().splitlines()[-1])


def _worker(model_dir, mode, rank, port, **kw):
    return subprocess.Popen([sys.executable, str(WORKER), str(model_dir), mode, str(rank), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), **kw)


def _kill(*procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_two_processes_match_one(model_dir, reference):
    port = free_port()
    # Rank 1 through the CLI (checks the --tp/--num-nodes/... flags); rank 0 through the offline LLM.
    follower = _cli(model_dir, "generate", 1, port, "--prompt", "x")
    leader = _worker(model_dir, "gen", 0, port)
    try:
        out, err = leader.communicate(timeout=300)
        assert leader.returncode == 0, err[-3000:]
        fout, ferr = follower.communicate(timeout=60)
        assert follower.returncode == 0, ferr[-3000:]
    finally:
        _kill(leader, follower)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["devices"] == 2
    assert got["tokens"] == reference["tokens"]
    assert got["text"] == reference["text"]
    assert got["pen"] == reference["pen"] and got["pen_cached"] == reference["pen_cached"] >= 16
    np.testing.assert_allclose(got["logprobs"], reference["logprobs"], atol=1e-5)


def test_http_served_through_rank0(model_dir, reference):
    port, http = free_port(), free_port()
    follower = _cli(model_dir, "run", 1, port)
    server = _cli(model_dir, "run", 0, port, "--port", str(http))
    try:
        wait_healthy(http, server)
        got = complete(http, str(model_dir), "Hello world, this is")
        assert got["choices"][0]["text"] == reference["text"]
        server.send_signal(signal.SIGTERM)  # rank 0 stops; it tells rank 1 to stop too
        assert server.wait(timeout=60) == 0, server.stderr.read()[-3000:]
        assert follower.wait(timeout=60) == 0, follower.stderr.read()[-3000:]
    finally:
        _kill(server, follower)


def _kill_rank(model_dir, victim: int, follower_cli: bool = False):
    """Start both ranks generating in a loop, SIGKILL `victim`, return (survivor's rc, stderr, seconds).
    follower_cli: rank 1 is `jaxserve run --node-rank 1` (the CLI) instead of the offline LLM."""
    port = free_port()
    follower = _cli(model_dir, "run", 1, port) if follower_cli else _worker(model_dir, "hold", 1, port)
    leader = _worker(model_dir, "hold", 0, port)
    survivor = follower if victim == 0 else leader
    try:
        deadline = time.monotonic() + 240
        line = ""
        while "READY" not in line:  # rank 0 is generating in a loop from here on
            assert time.monotonic() < deadline and leader.poll() is None, leader.stderr.read()[-3000:]
            line = leader.stdout.readline()
        time.sleep(1)
        (leader if victim == 0 else follower).send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        survivor.wait(timeout=40)
        took = time.monotonic() - t0
        err = survivor.stderr.read()
    finally:
        _kill(leader, follower)
    return survivor.returncode, err, took


def test_dead_rank_stops_rank0(model_dir):
    rc, err, took = _kill_rank(model_dir, victim=1)
    assert rc not in (0, None)
    last = err.strip().splitlines()[-1]
    assert "node rank 1 stopped responding" in last, err[-3000:]
    assert took < 20, took


def test_unreachable_coordinator(model_dir):
    env = dict(_env(), JAXSERVE_INIT_TIMEOUT="3")
    r = subprocess.run([sys.executable, "-m", "jaxserve.cli", "generate", "--model", str(model_dir), "--prompt", "x",
                        "--tp", "2", "--num-nodes", "2", "--node-rank", "1", "--master-port", str(free_port())],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0
    assert "coordinator 127.0.0.1:" in r.stderr.strip().splitlines()[-1] and "unreachable" in r.stderr, r.stderr[-2000:]


def test_dead_rank0_stops_follower(model_dir):
    """When rank 0 (the coordinator) dies, a `jaxserve` follower exits with status 1 within seconds, its
    last line our one-line message, not jax.distributed's multi-line fatal abort."""
    rc, err, took = _kill_rank(model_dir, victim=0, follower_cli=True)
    assert rc == 1, (rc, err[-3000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith("jaxserve: error: ") and ("lost the coordinator" in last
                                                     or "node rank 0 stopped responding" in last), err[-3000:]
    assert took < 20, took


class _FlakyStore:
    """The coordinator's key-value store as the watchdog sees it; `down` = the service is gone."""

    def __init__(self):
        self.kv, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        self.kv[key] = value

    def key_value_try_get(self, key):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        if key not in self.kv:
            raise RuntimeError("NOT_FOUND: no such key")
        return self.kv[key]


def _beats(store, rank, deadline=5.0):
    from jaxserve.parallel import multihost

    end = time.monotonic() + deadline
    while store.kv.get(f"{multihost.PREFIX}/hb/{rank}") in (None, "0") and time.monotonic() < end:
        time.sleep(0.01)
    return store.kv.get(f"{multihost.PREFIX}/hb/{rank}") not in (None, "0")


@pytest.mark.parametrize("leaving", [False, True])
def test_watchdog_on_a_lost_coordinator(monkeypatch, leaving):
    """Losing the coordinator is fatal while serving; once rank 0 has told the followers to stop (its own
    service then goes away at exit) it ends the watch quietly instead of failing a clean shutdown."""
    from jaxserve.parallel import multihost

    died = []
    store = _FlakyStore()
    wd = multihost.Watchdog(store, rank=0, world=2, address="127.0.0.1:1", period=0.02)
    monkeypatch.setattr(multihost, "die", lambda msg, code=1: (died.append(msg), wd.stop()))
    wd.start()
    assert _beats(store, 0)
    if leaving:
        wd.leaving()
    store.down = True
    wd._thread.join(timeout=5)
    assert not wd._thread.is_alive()
    assert died == [] if leaving else (len(died) == 1 and "lost the coordinator" in died[0])


def test_watchdog_still_reports_a_silent_follower_while_leaving(monkeypatch):
    """leaving() only forgives the coordinator going away: a follower that stops beating is still fatal."""
    from jaxserve.parallel import multihost

    died = []
    store = _FlakyStore()
    store.kv[f"{multihost.PREFIX}/hb/1"] = "0"  # the follower beat once, then went silent
    wd = multihost.Watchdog(store, rank=0, world=2, address="127.0.0.1:1", timeout=0.2, period=0.02)
    monkeypatch.setattr(multihost, "die", lambda msg, code=1: (died.append(msg), wd.stop()))
    wd.leaving()
    wd.start()
    wd._thread.join(timeout=5)
    assert not wd._thread.is_alive() and len(died) == 1 and "node rank 1 stopped responding" in died[0]
