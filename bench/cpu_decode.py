"""CPU bs1 decode, side by side: jaxserve's server (streamed) vs llama-cpp-python, same GGUF, same machine.

    python bench/cpu_decode.py [--scan-layers off,on] [--packed auto] [--max-tokens 128] [--llama-cpp-path DIR]

Both decode greedily from the same prompt with EOS ignored; decode tok/s = tokens after the first
streamed chunk / (time from the first chunk to the last), i.e. prefill excluded (a jaxserve chunk
carries up to --decode-steps tokens: they are counted from its logprobs). llama-cpp-python is a benchmark-only
dependency (`pip install llama-cpp-python`, ~10 minutes to build here); never needed by jaxserve.
--packed: the server's `--packed` values to run (auto: the native quantized CPU kernel; off: weights
dequantized to f32 at load, the CPU path before it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.configs import append_json_rows  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def llama_cpp(path: str, n: int, threads: int) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_batch=64, verbose=False, seed=0)
    no_eos = {int(t): -1e4 for t in {llm.token_eos(), 0, 2} if t is not None and t >= 0}  # = ignore_eos
    llm.create_completion(PROMPT, max_tokens=4, temperature=0.0)  # warm
    times = []
    for chunk in llm.create_completion(PROMPT, max_tokens=n, temperature=0.0, stream=True, logit_bias=no_eos):
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def jaxserve_streamed(url: str, n: int) -> float:
    """Decode tok/s of one streamed completion. A chunk can carry several tokens (the engine runs
    several decode steps per dispatch), so tokens are counted from each chunk's logprobs."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": n, "temperature": 0.0, "stream": True,
                       "ignore_eos": True, "logprobs": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    times, counts = [], []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            lp = json.loads(line[6:])["choices"][0].get("logprobs") or {}
            k = len(lp.get("tokens") or [])
            if k:
                times.append(time.perf_counter())
                counts.append(k)
    return (sum(counts) - counts[0]) / (times[-1] - times[0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scan-layers", default="off,on")
    ap.add_argument("--packed", default="auto", help="comma-separated --packed values (auto, off)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--llama-cpp-path", default=None, help="sys.path entry holding llama_cpp")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--server-args", default="", help="more `jaxserve run` flags, e.g. '--decode-steps 8'")
    args = ap.parse_args(argv)
    from bench.startup import launched_server
    from jaxserve.loader.pip_models import ensure_smollm2

    gguf = str(ensure_smollm2())
    rows = []
    for packed in args.packed.split(","):
        for scan in args.scan_layers.split(","):
            extra = ["--scan-layers", scan, "--packed", packed, "--max-num-seqs", "4", "--max-model-len", "1024",
                     *args.server_args.split()]
            with launched_server("", None, extra, 900) as (url, dt, _):
                jaxserve_streamed(url, 8)  # warm
                r = [jaxserve_streamed(url, args.max_tokens) for _ in range(args.runs)]
            name = f"jaxserve run --scan-layers {scan} --packed {packed} {args.server_args}".strip()
            rows.append(dict(engine=name, tok_s=max(r), runs=r, startup_s=dt))
            print(f"{name}: {r} tok/s; start-up {dt:.0f}s", flush=True)
    if args.llama_cpp_path:
        sys.path.append(args.llama_cpp_path)  # after ours: its bundled numpy must not shadow ours
    try:
        r = [llama_cpp(gguf, args.max_tokens, args.threads) for _ in range(args.runs)]
        rows.append(dict(engine=f"llama-cpp-python ({args.threads} threads)", tok_s=max(r), runs=r))
        print(f"llama-cpp-python: {r} tok/s", flush=True)
    except ImportError as e:
        print(f"llama-cpp-python not importable ({e}); jaxserve figures only", flush=True)
    base = next((r["tok_s"] for r in rows if r["engine"].startswith("llama")), None)
    print("\n| engine | decode tok/s (best of runs) | vs llama-cpp-python |\n|---|---|---|")
    for r in rows:
        share = f"{r['tok_s'] / base:.2f}" if base else "-"
        print(f"| {r['engine']} | {r['tok_s']:.1f} | {share} |")
    append_json_rows(args.json, rows)


if __name__ == "__main__":
    main()
