"""HTTP load client for `jaxserve run` (or any OpenAI-compatible server).

    python bench/serve.py --url http://127.0.0.1:2000 --concurrency 1,16 --input-len 128 --output-len 64
    python bench/serve.py --random-weights --config llama-3.1-8b --concurrency 1,32,256 \
        --server-args "--max-num-seqs 256"     # starts `jaxserve run --model random:llama-3.1-8b` itself

For each concurrency N: N workers send streaming /v1/completions requests back to back (random
token-id prompts of exactly --input-len tokens, --output-len tokens each with ignore_eos) until
--num-requests (default 4 N) are done. Prints TTFT and TPOT p50/p99, end-to-end latency and the
aggregate output tokens/s, and each level's speed-up over the first one. Only stdlib + aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import aiohttp


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def vocab_sample(session: aiohttp.ClientSession, url: str, model: str | None) -> list[int]:
    """Real token ids to draw prompts from (random ids can be special or unused tokens)."""
    words = ("time person year way day thing man world life hand part child eye woman place work week case "
             "point government company number group problem fact river mountain garden window music "
             "science history story picture language computer kitchen morning evening summer winter").split()
    rng = random.Random(0)
    text = " ".join(rng.choice(words) + rng.choice(["", ",", ".", " and", " of the"]) for _ in range(600))
    body = {"prompt": text, **({"model": model} if model else {})}
    async with session.post(f"{url}/tokenize", json=body) as r:
        if r.status != 200:
            raise SystemExit(f"/tokenize failed ({r.status}): {await r.text()}")
        ids = (await r.json())["tokens"]
    return sorted(set(ids))


async def one_request(session, url: str, model: str | None, prompt: list[int], output_len: int,
                      temperature: float) -> dict:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    first = last = None
    usage = None
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"{r.status}: {(await r.text())[:200]}"}
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            now = time.perf_counter()
            if ev.get("usage"):
                usage = ev["usage"]
            if any(c.get("text") for c in ev.get("choices", [])):
                if first is None:
                    first = now
                last = now
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    res = {"tokens": n, "e2e": end - t0, "ttft": (first - t0) if first else None}
    if first is not None and n > 1:
        res["tpot"] = (last - first) / (n - 1)
    return res


async def run_level(url: str, model: str | None, conc: int, num: int, vocab: list[int], input_len: int,
                    output_len: int, temperature: float, headers: dict, seed: int) -> dict:
    rng = random.Random(seed + conc)
    prompts = [[rng.choice(vocab) for _ in range(input_len)] for _ in range(num)]
    queue = list(range(num))
    results: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker():
            while queue:
                i = queue.pop()
                results.append(await one_request(session, url, model, prompts[i], output_len, temperature))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(conc)])
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    toks = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    tpot = [r["tpot"] for r in ok if "tpot" in r]
    e2e = [r["e2e"] for r in ok]
    return {"concurrency": conc, "requests": len(ok), "errors": len(errors), "first_error": errors[:1],
            "wall_s": wall, "output_tokens": toks, "output_tok_s": toks / wall if wall else 0.0,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "tpot_p50_ms": 1e3 * pct(tpot, 50), "tpot_p99_ms": 1e3 * pct(tpot, 99),
            "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99)}


async def main_async(a) -> list[dict]:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    async with aiohttp.ClientSession(headers=headers) as s:
        vocab = await vocab_sample(s, a.url, a.model)
        if a.warmup:  # the first requests of a fresh server pay for lazy work; keep them out
            await asyncio.gather(*[one_request(s, a.url, a.model, vocab[:8], 4, 0.0) for _ in range(2)])
    out = []
    for conc in a.concurrency:
        num = a.num_requests or 4 * conc
        r = await run_level(a.url, a.model, conc, num, vocab, a.input_len, a.output_len, a.temperature,
                            headers, a.seed)
        out.append(r)
        base = out[0]["output_tok_s"] or float("nan")
        print(f"N={conc:<4d} req={r['requests']:<4d} err={r['errors']:<3d} "
              f"TTFT p50 {r['ttft_p50_ms']:8.1f} ms p99 {r['ttft_p99_ms']:8.1f} ms | "
              f"TPOT p50 {r['tpot_p50_ms']:7.1f} ms p99 {r['tpot_p99_ms']:7.1f} ms | "
              f"e2e p50 {r['e2e_p50_s']:6.2f} s | {r['output_tok_s']:8.1f} out tok/s "
              f"(x{r['output_tok_s'] / base:.2f} vs N={out[0]['concurrency']})", flush=True)
        if r["errors"]:
            print(f"  first error: {r['first_error'][0]}", file=sys.stderr)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:2000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,16", help="comma-separated levels, e.g. 1,4,16")
    p.add_argument("--num-requests", type=int, default=0, help="requests per level (default 4 x concurrency)")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--random-weights", action="store_true",
                   help="start a server on a random-weight model (--config) instead of using --url")
    p.add_argument("--config", default="llama-3.1-8b", help="model preset for --random-weights")
    p.add_argument("--server-args", default="", help="extra `jaxserve run` flags for --random-weights")
    a = p.parse_args(argv)
    a.concurrency = [int(x) for x in a.concurrency.split(",") if x.strip()]
    if a.random_weights:
        import os
        import shlex

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from bench.startup import launched_server

        with launched_server(f"random:{a.config}", None, shlex.split(a.server_args), 900) as (url, dt, _):
            print(f"# server on random:{a.config} healthy after {dt:.1f}s", flush=True)
            a.url = url
            res = asyncio.run(main_async(a))
    else:
        a.url = a.url.rstrip("/")
        res = asyncio.run(main_async(a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "api_key"}, "results": res}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
