"""Convert a model into a pre-quantized jaxserve checkpoint that `jaxserve run --model DIR` loads as is.

    python -m tools.convert.quantize --model HuggingFaceTB/SmolLM2-135M-Instruct --isq q4k --out smol-q4k

The matmul weights (q, k, v, o, gate, up, down) are quantized once, here, tensor by tensor; the
embeddings, LM head, norms and biases stay dense. Loading the directory does no quantization: on one
GPU the packed weights feed the quantized matmul kernel; elsewhere (CPU, tensor parallel) they are
dequantized at load. Format: jaxserve/loader/checkpoint.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxserve.config import ISQ_FORMATS  # JAX-free: --help imports no JAX
from tools.convert import add_common_args

DTYPES = ("auto", "float32", "bfloat16", "float16")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.convert.quantize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="source: HF model dir, .gguf file, Hub id or random:<preset>")
    p.add_argument("--isq", required=True, metavar="FMT", help=f"quantized format: {', '.join(ISQ_FORMATS)}")
    p.add_argument("--out", required=True, help="output directory (must be empty or not exist)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="dtype of the dense tensors (embeddings, LM head); auto: the source's. "
                        "Norms and biases are always float32")
    add_common_args(p, shard_help="largest weight file in GiB (default 4; 0: one file)",
                    force_help="write into a non-empty output directory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    fmt = args.isq.lower()
    if fmt not in ISQ_FORMATS:
        print(f"error: unknown --isq format {args.isq!r}; known: {', '.join(ISQ_FORMATS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not args.force)):
        print(f"error: {out} exists and is not an empty directory (use --force)", file=sys.stderr)
        return 2
    from jaxserve.loader.checkpoint import write_checkpoint
    from tools.convert import open_text_source

    src = open_text_source(args)
    if src is None:
        return 2
    shard = int(args.shard_size * (1 << 30)) or None
    write_checkpoint(out, src, fmt, dtype=args.dtype, source_name=args.model, shard_bytes=shard)
    print(f"wrote {out} ({fmt}); run it with: jaxserve run --model {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
