"""The multimodal models on a GPU against their CPU runs: tiny random checkpoints (Qwen2-VL, Qwen2.5-VL, Gemma 3
with images; made by tests/hf_tiny.py, whose CPU runs the tests compare with transformers), served with the
GPU's defaults (unrolled layers, Pallas attention and kernels, CUDA graphs) in float32 and bfloat16; each
prompt's log-probabilities and greedy tokens against the reference file written on the CPU. No torch needed
on the GPU machine.

    python bench/mm_gpu_check.py --write DIR     # on the CPU: the checkpoints, images and reference.json
    python bench/mm_gpu_check.py --check DIR     # on the GPU: prints max |logprob diff| and token agreement
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {  # name -> (prompt with placeholders, image sizes (h, w))
    "qwen2_vl": ("<|im_start|>user\nLook:<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|>"
                 "<|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n", [(40, 52), (30, 90)]),
    "qwen2_5_vl": ("<|im_start|>user\nLook:<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
                   "<|im_start|>assistant\n", [(64, 70)]),
    "gemma3": ("<start_of_turn>user\nA picture:<start_of_image>What is in it?<end_of_turn>\n<start_of_turn>model\n",
               [(40, 52)]),
}
N_TOKENS = 8


def _image(seed: int, hw):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*hw, 3), dtype=np.uint8))


def _run(path: Path, prompt: str, sizes, dtype: str, attention=None, **kw) -> dict:
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    ecfg = EngineConfig(dtype=dtype, max_model_len=256, max_num_seqs=2, prefill_chunk_size=16, block_size=4,
                        num_blocks=256, **kw)
    llm = LLM.from_engine(LLMEngine(str(path), engine_config=ecfg, attention=attention))
    imgs = [_image(i, hw) for i, hw in enumerate(sizes)]
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": imgs}},
                       SamplingParams(temperature=0, max_tokens=N_TOKENS, min_tokens=N_TOKENS, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return {"prompt_ids": out.prompt_token_ids, "logprobs": [lp for lp, _ in out.prompt_logprobs[1:]],
            "tokens": list(out.outputs[0].token_ids)}


def write(root: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from hf_tiny import make_tiny_gemma3_vision, make_tiny_qwen_vl

    root.mkdir(parents=True, exist_ok=True)
    dirs = {"qwen2_vl": make_tiny_qwen_vl(root, "qwen2_vl"), "qwen2_5_vl": make_tiny_qwen_vl(root, "qwen2_5_vl"),
            "gemma3": make_tiny_gemma3_vision(root)}
    ref = {name: dict(_run(dirs[name], *CASES[name], "float32"), dir=dirs[name].name) for name in CASES}
    (root / "reference.json").write_text(json.dumps(ref))
    print("wrote", root / "reference.json")


def check(root: Path) -> int:
    import jaxserve  # noqa: F401  (before jax: its XLA flag defaults)
    import jax

    ref = json.loads((root / "reference.json").read_text())
    print("device:", jax.devices()[0].device_kind)
    bad = 0
    # f32 with XLA's default (TF32) matmuls, then at "highest" precision: alone, with XLA's reference attention
    # instead of the Pallas kernels, and without the fused RoPE + K/V-write kernel (which of them moves it)
    # (on an H100, session 23: "highest" matched the CPU to 6e-6..3e-5; TF32's default moved Gemma 3's by 5.5e-2)
    variants = (("float32", 0.1, "default", {}), ("float32", 1e-3, "highest", {}),
                ("float32", 1e-3, "highest", {"attention": "reference"}),
                ("float32", 1e-3, "highest", {"fused_rope_kv": False, "fused_decode_attention": False}),
                ("bfloat16", 0.5, "default", {}))
    for name, r in ref.items():
        for dtype, tol, precision, kw in variants:
            jax.config.update("jax_default_matmul_precision", None if precision == "default" else precision)
            got = _run(root / r["dir"], *CASES[name], dtype, **kw)
            same_ids = got["prompt_ids"] == r["prompt_ids"]
            diff = float(np.abs(np.array(got["logprobs"]) - np.array(r["logprobs"])).max()) if same_ids else float("inf")
            agree = sum(a == b for a, b in zip(got["tokens"], r["tokens"]))
            ok = same_ids and diff < tol and (dtype == "bfloat16" or got["tokens"] == r["tokens"])
            bad += not ok
            what = f"{dtype} {precision} {','.join(f'{k}={v}' for k, v in kw.items())}"
            print(f"{name:11s} {what:58s} ids equal {same_ids}, max |logprob diff| {diff:.2e} (tol {tol}), "
                  f"greedy {agree}/{len(r['tokens'])}: {'OK' if ok else 'FAIL'}", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="DIR")
    g.add_argument("--check", metavar="DIR")
    a = ap.parse_args(argv)
    if a.write:
        write(Path(a.write))
        return 0
    return check(Path(a.check))


if __name__ == "__main__":
    sys.exit(main())
