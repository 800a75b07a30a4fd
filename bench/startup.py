"""Start-up time of the server: process start -> GET /health answers 200 (model loaded, every program
of the closed bucket set compiled), first with an empty compilation cache (cold), then with the cache
the first start filled (warm).

    python bench/startup.py --model random:llama-3.1-8b [--runs cold,warm] [-- extra jaxserve run flags]

Each start is a fresh `python -m jaxserve.cli run` process on a free port; it is stopped (SIGINT) once
healthy. Prints seconds to healthy and the server's own "ready in" line (load + compile).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.configs import append_json_rows  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(model: str, cache_dir: str | None, extra: list[str], timeout: float):
    """Start `jaxserve run --model MODEL` on a free port; yield (url, seconds until /health was 200,
    a function returning the server's log so far); stop it (SIGINT) on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli", "run", *(["--model", model] if model else []),
           "--port", str(port), *extra]
    if cache_dir:
        cmd += ["--compile-cache-dir", cache_dir]
    t0 = time.perf_counter()
    log = tempfile.TemporaryFile("w+")

    def read_log() -> str:
        log.seek(0)
        return log.read()

    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{read_log()[-3000:]}")
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"not healthy after {timeout}s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", time.perf_counter() - t0, read_log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def start_once(model: str, cache_dir: str, extra: list[str], timeout: float) -> tuple[float, str]:
    with launched_server(model, cache_dir, extra, timeout) as (_, dt, read_log):
        pass
    lines = read_log().splitlines()
    ready = [ln.strip() for ln in lines if any(w in ln for w in ("ready in", "compiled", "loaded in", "probe",
                                                                  "programs (lowered"))]
    # Why a compilation cache stays empty shows up as a warning from jax's cache module.
    for ln in [ln for ln in lines if "cache" in ln.lower() and ("warn" in ln.lower() or "error" in ln.lower())][:5]:
        print("  log:", ln.strip()[:300], flush=True)
    n = len(os.listdir(cache_dir)) if cache_dir and os.path.isdir(cache_dir) else 0
    return dt, " / ".join(ready)[-1500:] + f" [cache entries after: {n}]"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--runs", default="cold,warm")
    ap.add_argument("--timeout", type=float, default=500)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cache-dir", default=None, help="compilation cache to use (default: a new empty one)")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: flags for jaxserve run")
    args = ap.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]
    cache = args.cache_dir or tempfile.mkdtemp(prefix="jaxserve-startup-cache-")
    rows = []
    for kind in args.runs.split(","):
        dt, ready = start_once(args.model, cache, extra, args.timeout)
        rows.append(dict(model=args.model, cache=kind, seconds=dt, server_log=ready, flags=" ".join(extra)))
        print(f"{kind:5s}: healthy after {dt:.1f}s  [{ready}]", flush=True)
    append_json_rows(args.json, rows)


if __name__ == "__main__":
    main()
