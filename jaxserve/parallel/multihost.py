"""Multi-host serving through jax.distributed: one mesh over every process's devices.

Rank 0 runs the scheduler (and the HTTP server). Each step it publishes its decision — the program key
and the numpy inputs that ModelRunner.prepare produced — through jax.distributed's key-value store; the
other ranks run the identical compiled program on their shards, so XLA's collectives line up. Nothing
else crosses hosts: weights are loaded by every rank for its own devices, tokens are sampled from
replicated logits on every device.

Liveness: jax.distributed notices a dead task only after its heartbeat timeout, and a rank blocked in a
collective never returns. Every rank therefore writes a heartbeat counter into the store every second
and a watchdog thread checks its peers' (rank 0 watches all, the others watch rank 0); when one stops
for JAXSERVE_PEER_TIMEOUT seconds (default 8) the watchdog prints one line and ends the process with
status 1 — from a thread, because the main thread may be stuck in a collective.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("jaxserve.multihost")

PREFIX = "jaxserve"
STEP_KEY = PREFIX + "/step/{}"
POLL_MS = 1000  # how long a follower blocks on the store before re-checking it should go on


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def die(msg: str, code: int = 1) -> None:
    """One line on stderr, then exit at once (no atexit: jax's shutdown barrier would wait for the dead)."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    try:
        sys.stderr.write(f"jaxserve: error: {msg}\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


@dataclass
class Cluster:
    client: Any  # jax's DistributedRuntimeClient
    rank: int
    world: int
    address: str
    watchdog: "Watchdog"
    bus: "StepBus"

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


_CLUSTER: Cluster | None = None


def cluster() -> Cluster | None:
    return _CLUSTER


def init_distributed(num_nodes: int, node_rank: int, master_addr: str = "127.0.0.1",
                     master_port: int = 29500, local_device_ids=None) -> Cluster:
    """jax.distributed.initialize with short timeouts, plus our heartbeat watchdog. Call before any JAX
    computation. Idempotent for the same arguments."""
    global _CLUSTER
    import jax

    if _CLUSTER is not None:
        if (_CLUSTER.rank, _CLUSTER.world) != (node_rank, num_nodes):
            raise RuntimeError("jax.distributed is already initialized with another rank/size")
        return _CLUSTER
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"--node-rank {node_rank} must be in [0, {num_nodes})")
    address = f"{master_addr}:{master_port}"
    peer_timeout = _env_float("JAXSERVE_PEER_TIMEOUT", 8.0)
    # On CPU, cross-process collectives need an implementation (no-op for GPU/TPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    init_timeout = _env_float("JAXSERVE_INIT_TIMEOUT", 120)
    # jax.distributed ends the process with a long fatal log when start-up times out: our timer fires
    # first with one line that says what is missing.
    timer = threading.Timer(init_timeout, _startup_timeout, (master_addr, master_port, node_rank, num_nodes,
                                                             init_timeout))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            address, num_processes=num_nodes, process_id=node_rank,
            local_device_ids=list(local_device_ids) if local_device_ids else None,
            initialization_timeout=int(init_timeout + 30),
            # Longer than our own watchdog, so a dead peer is reported by us, in one line, first.
            heartbeat_timeout_seconds=int(peer_timeout + 12),
            shutdown_timeout_seconds=int(_env_float("JAXSERVE_SHUTDOWN_TIMEOUT_S", 15)))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"cannot join the cluster at {address} as rank {node_rank}/{num_nodes}: "
                           f"{first}") from e
    finally:
        timer.cancel()
    from jax._src import distributed as jd

    client = jd.global_state.client
    wd = Watchdog(client, node_rank, num_nodes, address, timeout=peer_timeout)
    wd.start()
    _CLUSTER = Cluster(client, node_rank, num_nodes, address, wd, StepBus(client))
    if node_rank == 0:
        # Registered after jax's own atexit hook, so it runs first: followers stop before the shutdown
        # barrier that waits for them.
        atexit.register(leader_shutdown)
    log.info("rank %d/%d joined %s (%d global devices, %d local)", node_rank, num_nodes, address,
             jax.device_count(), jax.local_device_count())
    return _CLUSTER


CHILD_ENV = "JAXSERVE_RANK_CHILD"


def supervise(argv: list[str], rank: int, address: str) -> int:
    """Run this follower's command (`jaxserve ... --node-rank R`, R > 0) in a child process and relay
    its output.

    When rank 0 dies, jax.distributed's client in a follower notices first (its error poll fails as
    soon as the coordinator's socket closes) and aborts the process with a multi-line fatal log; its
    error callback cannot be replaced from Python (jaxlib 0.10 aborts converting the status). The thin
    parent, which imports no JAX, turns that end into the same one-line message and status 1 as our
    watchdog's."""
    import signal
    import subprocess

    def child_setup():  # the child dies with its parent (Linux), and gets signals only through it
        os.setpgrp()
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass

    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", *argv], env=dict(os.environ, **{CHILD_ENV: "1"}),
                            stderr=subprocess.PIPE, text=True, errors="replace", preexec_fn=child_setup)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    reported = jax_fatal = False
    for line in proc.stderr:
        reported |= line.startswith("jaxserve: error:")
        jax_fatal |= "detected fatal errors" in line or "Polled an error from coordination service" in line
        sys.stderr.write(line)
        sys.stderr.flush()
    rc = proc.wait()
    if rc == 0 or reported:
        return rc if rc >= 0 else 1
    why = ("jax.distributed reported a fatal error: node rank 0 died or is unreachable" if jax_fatal
           else f"exit status {rc}" if rc > 0 else f"killed by signal {-rc}")
    sys.stderr.write(f"jaxserve: error: lost the coordinator at {address} ({why}); rank {rank} exiting\n")
    return 1


def _reachable(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _startup_timeout(host: str, port: int, rank: int, world: int, waited: float) -> None:
    if rank != 0 and not _reachable(host, port):
        die(f"coordinator {host}:{port} unreachable after {waited:.0f}s: is rank 0 running, and is "
            f"--master-addr reachable from this host?")
    die(f"rank {rank}: not all {world} ranks joined the cluster at {host}:{port} within {waited:.0f}s "
        f"(set JAXSERVE_INIT_TIMEOUT to wait longer)")


class Watchdog:
    """Heartbeat counter in the store every `period` s; exits the process when a watched peer's counter
    stops moving for `timeout` s or the store (rank 0's coordinator) becomes unreachable."""

    def __init__(self, client, rank: int, world: int, address: str, timeout: float = 8.0,
                 period: float = 1.0):
        self.client, self.rank, self.address = client, rank, address
        self.peers = [r for r in range(world) if r != rank] if rank == 0 else [0]
        self.timeout, self.period = timeout, period
        self._stop = threading.Event()
        self._leaving = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxserve-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def leaving(self) -> None:
        """Rank 0 told the followers to stop: from now on its own coordinator service goes away when
        jax shuts down at exit, so a lost connection ends the watch instead of failing the process
        (a follower that stops answering still does, as before)."""
        self._leaving.set()

    def _get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(key)
        except Exception as e:
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def _run(self) -> None:
        n = 0
        # A peer that has not written its first heartbeat yet gets a longer grace (it may still be
        # finishing jax.distributed's start-up).
        t0 = time.monotonic() + max(0.0, 30.0 - self.timeout)
        seen = {p: (None, t0) for p in self.peers}
        while not self._stop.is_set():
            try:
                self.client.key_value_set(f"{PREFIX}/hb/{self.rank}", str(n), allow_overwrite=True)
                n += 1
                now = time.monotonic()
                for p in self.peers:
                    v = self._get(f"{PREFIX}/hb/{p}")
                    if v is not None and v != seen[p][0]:
                        seen[p] = (v, now)
                    elif now - seen[p][1] > self.timeout and not self._stop.is_set():
                        what = "never answered" if seen[p][0] is None else "stopped responding"
                        die(f"node rank {p} {what} (no heartbeat for {self.timeout:.0f}s); "
                            f"rank {self.rank} exiting")
            except Exception as e:
                if self._stop.is_set() or self._leaving.is_set():
                    return
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                die(f"lost the coordinator at {self.address} (node rank 0 died or is unreachable: "
                    f"{first[:200]}); rank {self.rank} exiting")
            self._stop.wait(self.period)


class StepBus:
    """Rank 0 -> followers: one pickled message per step under an increasing key."""

    def __init__(self, client):
        self.client = client
        self.n = 0

    def publish(self, msg: tuple) -> None:
        self.client.key_value_set_bytes(STEP_KEY.format(self.n), pickle.dumps(msg, protocol=5))
        # Every follower ran step n-1 (its collectives finished before rank 0 could publish step n):
        # older messages are no longer needed.
        if self.n >= 2:
            try:
                self.client.key_value_delete(STEP_KEY.format(self.n - 2))
            except Exception:
                pass
        self.n += 1

    def receive(self, stop: threading.Event | None = None) -> tuple:
        key = STEP_KEY.format(self.n)
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, POLL_MS)
            except Exception as e:
                s = str(e)
                if "DEADLINE" in s or "imed out" in s or "timeout" in s.lower():
                    continue  # rank 0 is idle; the watchdog decides whether it is alive
                raise
            self.n += 1
            return pickle.loads(data)


def put_replicated(tree, sharding):
    """Host numpy tree -> global arrays replicated on `sharding`, each process filling its own devices.

    jax.device_put of a numpy array onto devices of several processes first checks that every process
    passed the same value — an all-gather per array, every step. Rank 0 and the followers hold the same
    bytes by construction (the step message), so the arrays are assembled from local copies instead."""
    import jax
    import numpy as np

    def put(x):
        if isinstance(x, jax.Array):  # already a global array (the runner's all-ones token mask)
            return x
        x = np.asarray(x)
        devs = list(sharding.addressable_devices_indices_map(x.shape))
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [jax.device_put(x, d) for d in devs])

    return jax.tree.map(put, tree)


def _pack_step(inp: dict) -> dict:
    """The step message without the structured-output mask when no row is constrained (its all-ones
    [S, vocab/32] words would be most of the message): its shape stands in for it."""
    st = inp["st"]
    if not st["constrained"].any():
        inp = dict(inp, st=dict(st, allowed=("ones", st["allowed"].shape)))
    return inp


def _unpack_step(inp: dict, ones_mask) -> dict:
    """A step message back into the runner's inputs; ones_mask(rows): the follower's own all-ones mask."""
    a = inp["st"].get("allowed")
    if isinstance(a, tuple):
        inp = dict(inp, st=dict(inp["st"], allowed=ones_mask(a[1][0])))
    return inp


def leader_runner_cls(bus: StepBus):
    """A ModelRunner whose every prepared step is also published to the followers."""
    from jaxserve.engine.runner import ModelRunner

    class LeaderRunner(ModelRunner):
        def prepare(self, sched):
            # (key, numpy inputs, slots, seeding calls): the keys and inputs cross hosts, seeding first.
            key, inp, offsets, seeds = super().prepare(sched)
            for skey, sinp in seeds:
                bus.publish(("seed", skey, sinp))
            bus.publish(("step", key, _pack_step(inp)))
            # Already global arrays: dispatch's device_put onto the same sharding is then a no-op.
            return key, put_replicated(inp, self._replicated), offsets, seeds

    return LeaderRunner


def leader_shutdown() -> None:
    """Tell the followers to stop (rank 0, at exit or when the server stops)."""
    c = _CLUSTER
    if c is None or not c.is_leader or getattr(c, "_stopped", False):
        return
    c._stopped = True
    # The watchdog keeps running: if a follower is already dead, jax's shutdown barrier would wait for it,
    # and the watchdog's one-line error and exit end that wait. Once the stop is published, losing the
    # coordinator is no longer an error: it is this process's own service, stopped by jax's shutdown at
    # exit (that race made the server exit with status 1 after a clean stop, once in CI).
    try:
        c.bus.publish(("stop",))
    except Exception:
        log.debug("could not publish stop", exc_info=True)
    else:
        c.watchdog.leaving()


def follow(runner) -> int:
    """Followers' loop: run rank 0's steps on this process's shards until it says stop."""
    import jax

    c = _CLUSTER
    assert c is not None and not c.is_leader
    steps = 0
    while True:
        msg = c.bus.receive()
        if msg[0] == "stop":
            c.watchdog.stop()
            log.info("rank %d: rank 0 stopped after %d steps", c.rank, steps)
            return steps
        kind, key, inp = msg
        if kind == "seed":  # a penalized sequence's cached prefix, counted into its row
            runner.apply_seed(key, inp)
            continue
        inp = _unpack_step(inp, runner.ones_mask)
        exe = runner.compile(key)
        inp = put_replicated(inp, runner._replicated)
        runner.state, out = exe(runner.consts, runner.weights, runner.state, inp)
        jax.block_until_ready(out)  # keep pace with rank 0; surfaces device errors here
        steps += 1


def agree_num_blocks(num_blocks: int) -> int:
    """The smallest KV cache any rank can hold: every rank must allocate the same global cache."""
    c = _CLUSTER
    if c is None or c.world == 1:
        return num_blocks
    c.client.key_value_set(f"{PREFIX}/num_blocks/{c.rank}", str(int(num_blocks)), allow_overwrite=True)
    vals = [int(c.client.blocking_key_value_get(f"{PREFIX}/num_blocks/{r}", 600_000)) for r in range(c.world)]
    return min(vals)
