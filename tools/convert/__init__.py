"""Model conversion scripts.

    python -m tools.convert.quantize --model SRC --isq q4k --out DIR   # pre-quantized jaxserve checkpoint
    python -m tools.convert.export --model SRC --format gguf --out F    # llama.cpp GGUF
    python -m tools.convert.export --model SRC --format safetensors --out DIR   # Hugging Face model dir

SRC is anything `jaxserve run --model` accepts: a HF model directory, a GGUF file, a Hub id, a jaxserve
checkpoint or `random:<preset>`.
"""


def add_common_args(p, *, shard_help: str, force_help: str) -> None:
    """Source-selection and output flags both scripts take."""
    p.add_argument("--file", default=None, help="which GGUF of a directory or Hub repo")
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit")
    p.add_argument("--shard-size", type=float, default=4.0, metavar="GIB", help=shard_help)
    p.add_argument("--force", action="store_true", help=force_help)
    p.add_argument("--text-only", action="store_true",
                   help="a multimodal model: write its language model alone (as llama.cpp's text GGUF, used with "
                        "an mmproj file for the images)")


def open_text_source(args):
    """The model source of args.model (engine/model_loading.open_model, dense), or None after printing why it
    cannot be converted: a multimodal model would lose its vision tower and projector (unless --text-only)."""
    import sys

    from jaxserve.engine.llm_engine import open_model

    src = open_model(args.model, file=args.file, revision=args.revision, packed=False)
    if src.vision is not None and not getattr(args, "text_only", False):
        print(f"error: {args.model} is a multimodal model: converting it would keep only its language model "
              "(--text-only does that)", file=sys.stderr)
        return None
    return src
