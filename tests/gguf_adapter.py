"""Test helper: a PEFT LoRA adapter directory written as llama.cpp's LoRA GGUF (what
convert_lora_to_gguf.py produces for a `llama` base: general.type 'adapter', adapter.type 'lora',
adapter.lora.alpha, blk.N.<tensor>.weight.lora_a [r, in] / .lora_b [out, r], q/k rows of B in llama.cpp's
permuted order). Written independently of the loader: names from llama.cpp's tensor table, the permute
as llama.cpp's converter applies it."""

import json
import re
from pathlib import Path

import numpy as np

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def _llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permute (HF rotate-half -> interleaved pairs), applied to rows of w."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_adapter(adapter_dir, out, num_heads: int, num_kv_heads: int, dtype=np.float32) -> Path:
    import gguf
    from safetensors.numpy import load_file

    conf = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(conf["lora_alpha"]))
    for name, t in sorted(load_file(str(Path(adapter_dir) / "adapter_model.safetensors")).items()):
        m = re.match(r"base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$", name)
        t = np.asarray(t, np.float32)
        if m[3] == "B" and m[2] in ("self_attn.q_proj", "self_attn.k_proj"):
            t = _llama_permute(t, num_heads if m[2] == "self_attn.q_proj" else num_kv_heads)
        w.add_tensor(f"blk.{m[1]}.{_NAMES[m[2]]}.weight.lora_{m[3].lower()}", t.astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)
