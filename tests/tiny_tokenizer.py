"""A byte-level tokenizer.json for the tiny random models of hf_tiny (vocab 256: one token per byte)."""

import json
from pathlib import Path


def add_byte_tokenizer(model_dir, special: tuple[str, ...] = ()) -> Path:
    """special: added (not special: they stay in decoded text, as Qwen3's) tokens after the 256 bytes
    (ids 256, 257, ...), e.g. ("<think>", "</think>")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if special:
        tok.add_tokens(list(special))
    d = Path(model_dir)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "add_eos_token": False}))
    return d
