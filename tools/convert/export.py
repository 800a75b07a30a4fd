"""Export a model that jaxserve runs to a llama.cpp GGUF file or a Hugging Face safetensors directory.

    python -m tools.convert.export --model smol-q4k --format gguf --out smol-f16.gguf --dtype f16
    python -m tools.convert.export --model model.gguf --format safetensors --out smol-hf --dtype bf16

gguf: llama-family models (Llama, Mistral, SmolLM2, Qwen2/3), Gemma 2/3 and the mixture-of-experts
Mixtral, Qwen2-MoE and Qwen3-MoE whose settings the GGUF keys can carry; tensors F32/F16/BF16 or Q8_0
(norms and MoE routers stay F32); tokenizer from a byte-level BPE
tokenizer (or copied from a GGUF source); BERT embedding models (F32/F16/Q8_0, llama.cpp's `bert`
architecture: tools/convert/gguf_encoder_export.py). safetensors: config.json, [out, in] weights under HF names,
tokenizer files: a directory transformers loads with from_pretrained. A quantized source (a jaxserve
checkpoint, a quantized GGUF) is written dequantized. Weights stream tensor by tensor.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tools.convert import add_common_args

FORMATS = ("gguf", "safetensors")
DTYPES = ("f32", "f16", "bf16", "q8_0")
_NP = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.convert.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="source: HF model dir, .gguf file, Hub id, jaxserve "
                                                  "checkpoint or random:<preset>")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="output .gguf file (gguf) or directory (safetensors)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weight dtype (default: f16 for gguf, bf16 for safetensors; q8_0: gguf only)")
    add_common_args(p, shard_help="safetensors: largest weight file in GiB (default 4; 0: one file)",
                    force_help="overwrite the output")
    return p


def export_safetensors(src, out: str | Path, dtype: str = "bf16", shard_bytes: int | None = None) -> Path:
    """Write `src` (an engine ModelSource opened with packed=False) as a Hugging Face model directory."""
    import ml_dtypes
    from tqdm.auto import tqdm

    from jaxserve.loader.checkpoint import SafetensorsWriter, header_bound, save_tokenizer
    from jaxserve.loader.hf_config import hf_config_from_model_config
    from jaxserve.loader.materialize import host_array
    from jaxserve.loader.safetensors_loader import hf_tensor_name
    from jaxserve.models.weights import iter_checked, weight_specs

    cfg, out = src.cfg, Path(out)
    hf_cfg = hf_config_from_model_config(cfg)  # first: refuse what config.json cannot say
    hf_cfg["dtype"] = _NP[dtype]  # (transformers < 4.56 called it torch_dtype)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bf16" else np.dtype(_NP[dtype])
    gemma = cfg.arch.startswith("gemma")
    specs = weight_specs(cfg)
    items = [(n, i) for n, s in specs.items() for i in (range(cfg.num_layers) if s.stacked else [None])]
    writer = SafetensorsWriter(out, header_bound(hf_tensor_name(n, i, cfg)[0] for n, i in items),
                               shard_bytes, {"format": "pt"})
    shard_of: dict[str, int] = {}
    total = 0
    for name, layer, arr in tqdm(iter_checked(cfg, src.tensors()), total=len(items), desc="writing safetensors",
                                 unit="tensor", disable=None):
        hf_name, kind = hf_tensor_name(name, layer, cfg)
        if kind == "linear":
            arr = arr.T  # canonical [in, out] -> torch Linear's [out, in]
        elif kind == "norm" and gemma:
            arr = np.asarray(arr, np.float32) - np.float32(1)  # HF Gemma stores w of x * (1 + w)
        data = host_array(arr, np_dtype)
        shard_of[hf_name] = writer.add({hf_name: data})
        total += data.nbytes
        del arr, data
    files = writer.close()
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: files[v] for k, v in sorted(shard_of.items())}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    save_tokenizer(src, out)
    if not (out / "generation_config.json").exists():
        eos = list(cfg.eos_token_ids)
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
               "pad_token_id": cfg.pad_token_id}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out)
    dtype = args.dtype or ("f16" if args.format == "gguf" else "bf16")
    if args.format == "safetensors" and dtype == "q8_0":
        print("error: --dtype q8_0 is for --format gguf", file=sys.stderr)
        return 2
    if out.exists() and not args.force and (out.is_file() or any(out.iterdir())):
        print(f"error: {out} exists (use --force)", file=sys.stderr)
        return 2
    from jaxserve.config import ConfigError
    from tools.convert import open_text_source
    from tools.convert.gguf_export import ExportError, export_gguf

    from jaxserve.loader.source import resolve_model
    from jaxserve.models import bert

    res = resolve_model(args.model, file=args.file, revision=args.revision)
    if res.kind != "gguf" and bert.is_encoder_dir(res.model_dir):  # a BERT embedding model
        if args.format != "gguf":
            print("error: an encoder model exports to --format gguf only", file=sys.stderr)
            return 2
        from tools.convert.gguf_encoder_export import export_encoder_gguf

        try:
            export_encoder_gguf(res.model_dir, out, dtype, name=Path(args.model).name)
        except (ConfigError, ExportError, bert.EncoderConfigError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {out}")
        return 0
    src = open_text_source(args)
    if src is None:
        return 2
    try:
        if args.format == "gguf":
            export_gguf(src, out, dtype, name=Path(args.model).name)
        else:
            export_safetensors(src, out, dtype, int(args.shard_size * (1 << 30)) or None)
    except (ConfigError, ExportError) as e:  # what the target format cannot say, named
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
