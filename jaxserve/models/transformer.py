"""The decoder shared by every supported family, as pure functions of (weights, kv cache, batch).

Llama 2/3, Mistral, Yi, SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k norm), Gemma 2 and Gemma 3 (scaled
embeddings, sandwich norms, GeGLU, sliding-window layers, soft-capping, local/global RoPE bases) differ
only in switches of ModelConfig, so one block function serves them all; the per-family files
(llama.py, gemma.py) hold what is specific to a family (defaults, chat quirks).

The batch is a flat ragged list of tokens (see kernels/paged_attention/reference.py): no padding to a
rectangle, no per-sequence Python work, one compiled program per (tokens, sequences) bucket.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.kernels.dense_gemv import activation
from jaxserve.kernels.paged_attention import reference as attn_ref
from jaxserve.kernels.quant_matmul import cpu_native
from jaxserve.kernels.quant_matmul.cpu_native import CpuQWeight
from jaxserve.kernels.rms_norm.reference import add_rms_norm as _add_rms_norm_ref
from jaxserve.kernels.rms_norm.reference import rms_norm  # noqa: F401  (the model's norm, re-exported)
from jaxserve.kernels.rope_kv.reference import apply_rope
from jaxserve.models import kmajor
from jaxserve.models import lora as lora_mod
from jaxserve.models import moe
from jaxserve.models.kmajor import KMajor
from jaxserve.models.rope import rope_tables
from jaxserve.quant.qweight import QWeight


def linear(x, w, qmm: Callable | None = None, split_out: bool = False):
    """x [T, K] @ w [K, N]; w a dense array, a packed QWeight (qmm, or the quantized matmul kernel
    of this platform: Pallas on GPU, dequantize + dot elsewhere) or a CpuQWeight (the native CPU
    kernel, kernels/quant_matmul/cpu_native). split_out: the caller's consumer takes a SplitSum
    (kernels/split_sum.py), so a qmm that `takes_split_out` may return its split-K partials."""
    if isinstance(w, CpuQWeight):
        return cpu_native.qmatmul(x, w)
    if isinstance(w, cpu_native.LayerOf):  # one layer of a stacked CpuQWeight, read in place
        return cpu_native.qmatmul(x, w.weight, layer=w.index)
    if isinstance(w, KMajor):  # held [N, K] (models/kmajor: XLA's reduction reads it once)
        return kmajor.matmul(x, w)
    if getattr(qmm, "takes_dense", False):  # the runner's decode matmul (kernels/dense_gemv.engine_matmul)
        return qmm(x, w, split_out=split_out)
    if isinstance(w, QWeight):
        from jaxserve.kernels import quant_matmul

        return quant_matmul.apply(x, w, qmm, split_out)
    return x @ w


def _act(cfg: ModelConfig, x):
    return activation(cfg.hidden_act, x)


def layer_constants(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Per-layer values that differ between layers (scanned alongside the stacked weights)."""
    inv_freq, attn_factor = rope_tables(cfg)
    windows = np.asarray([cfg.layer_window(i) for i in range(cfg.num_layers)], np.int32)
    return {"inv_freq": inv_freq, "attn_factor": attn_factor, "window": windows,
            "index": np.arange(cfg.num_layers, dtype=np.int32)}


def decoder_layer(cfg: ModelConfig, x, w, c, kv, batch, attention: Callable, resid=None,
                  add_norm: Callable | None = None, rope_kv: Callable | None = None,
                  qmm: Callable | None = None, split_sums: bool = False,
                  rope_attend: Callable | None = None, moe_impl: str | None = None):
    """One block. x [T, D]; w: this layer's weights; c: this layer's constants; kv: (k_cache, v_cache).

    The block's input is x + resid (resid: the previous block's MLP output, or None) and its output
    (x', m, kv) means x' + m: each residual add is left to the next norm, so `add_norm` (a fused
    add + RMSNorm kernel on GPU, kernels/rms_norm) does add and norm in one pass. rope_kv: a fused
    RoPE + cache-write kernel (kernels/rope_kv) for fused q/k/v without q/k norms. qmm: the quantized
    matmul for packed weights (default: the platform's). split_sums: the q/k/v, o and down matmuls
    may return split-K partials (a SplitSum) to the kernels that consume them (rope_kv, add_norm), one
    reduction kernel less each; resid may then be one (not in a scan: its carry is a plain array).
    Both fused RoPE kernels also take Qwen3's / Gemma 3's per-head q/k RMSNorms.
    rope_attend: RoPE + K/V write + decode attention in one kernel (kernels/rope_attention), used
    with rope_kv in steps of decode tokens only (the decode program: no `decode_slots` region).
    moe_impl: the MoE experts' path (models/moe.experts_impl; the runner passes 'xla' on a mesh).
    Multi-LoRA (models/lora.py): w["lora"] holds the adapters' A/B of some targets and
    batch["lora_onehot"] each token's adapter; those targets' outputs get the delta added (whole
    arrays: no split-K partials, no activation fused into the down matmul)."""
    add_norm = add_norm or _add_rms_norm_ref
    eps = cfg.rms_norm_eps
    T = x.shape[0]
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    adapters = w.get("lora", {})

    def proj(x, name, split_out=False):
        if name not in adapters:
            return linear(x, w[name], qmm, split_out=split_out)
        return linear(x, w[name], qmm) + lora_mod.delta(x, adapters[name], batch["lora_onehot"])

    x, h = add_norm(x, resid, w["attn_norm"], eps)
    fused_kv = attended = False
    rope_pos = mrope_positions(cfg, batch) if cfg.mrope_section else batch["positions"]
    if "qkv" in w:  # fused projections (see fuse_projections): one GEMV instead of three
        # (the fused RoPE kernels take one position per token: multimodal RoPE stays on XLA's path)
        to_rope_kv = rope_kv is not None and not cfg.mrope_section
        norm = {"qk_norm": (w["q_norm"], w["k_norm"], eps)} if cfg.qk_norm else {}
        qkv = proj(h, "qkv", split_out=split_sums and to_rope_kv and not cfg.attention_bias)
        if cfg.attention_bias:
            qkv = qkv + w["qkv_bias"]
        if to_rope_kv and rope_attend is not None and kv is not None and "decode_slots" not in batch:
            o, k_cache, v_cache = rope_attend(
                qkv, batch["positions"], c["inv_freq"], c["attn_factor"], kv[0], kv[1], c["index"],
                batch["slots"], batch["block_tables"], batch["token_seq"], num_heads=H, num_kv_heads=KV,
                head_dim=hd, scale=cfg.attn_scale, window=c["window"], softcap=cfg.attn_logit_softcap, **norm)
            fused_kv = attended = True
        elif to_rope_kv:
            # One kernel: split, RoPE on q and k, k/v into the cache (kernels/rope_kv).
            q, k_cache, v_cache = rope_kv(qkv, batch["positions"], c["inv_freq"], c["attn_factor"],
                                          kv[0], kv[1], c["index"], batch["slots"], num_heads=H,
                                          num_kv_heads=KV, head_dim=hd, **norm)
            fused_kv = True
        else:
            q, k, v = jnp.split(qkv, [H * hd, (H + KV) * hd], axis=-1)
    else:
        q, k, v = proj(h, "q"), proj(h, "k"), proj(h, "v")
        if cfg.attention_bias:
            q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    if not fused_kv:
        q, k, v = q.reshape(T, H, hd), k.reshape(T, KV, hd), v.reshape(T, KV, hd)
        if cfg.qk_norm:
            q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, rope_pos, c["inv_freq"], c["attn_factor"])
        k = apply_rope(k, rope_pos, c["inv_freq"], c["attn_factor"])
        if kv is not None:
            k_cache, v_cache = attn_ref.write_kv(kv[0], kv[1], c["index"], k, v, batch["slots"])
    kw = dict(scale=cfg.attn_scale, window=c["window"], softcap=cfg.attn_logit_softcap)
    D = batch.get("decode_slots")
    if attended:
        pass
    elif kv is None:
        # No KV cache: one pass over whole inputs (pooling models, models/decoder_pooling.py), the
        # attention takes this step's own k and v.
        o = attention(q, k, v, batch["positions"], **kw)
        k_cache = v_cache = None
    elif D is None:
        o = attention(q, k_cache, v_cache, c["index"], batch["block_tables"], batch["token_seq"],
                      batch["positions"], **kw)
    else:
        # Runner layout: D single-token slots first (per-token keys), then prompt chunks aligned to
        # query tiles (keys gathered once per tile).
        args = (k_cache, v_cache, c["index"], batch["block_tables"])
        attention, tiled = attention
        # Gemma 3's image rows attend to their whole run (the runner's per-token key limits)
        lim = {"limits": batch["attn_limit"][D:]} if "attn_limit" in batch else {}
        o = jnp.concatenate([
            attention(q[:D], *args, batch["token_seq"][:D], batch["positions"][:D], **kw),
            tiled(q[D:], *args, batch["token_seq"][D:], batch["positions"][D:], **kw, **lim)])
    o = proj(o.reshape(T, H * hd), "o", split_out=split_sums and not cfg.sandwich_norms)
    if cfg.sandwich_norms:
        o = rms_norm(o, w["post_attn_norm"], cfg.rms_norm_eps)
    x, h = add_norm(x, o, w["ffn_norm"], eps)
    down_split = split_sums and not cfg.sandwich_norms
    native_down = not cfg.is_moe and isinstance(w["down"], (CpuQWeight, cpu_native.LayerOf))  # linear() keeps those
    if cfg.is_moe:
        m = moe.moe_mlp(cfg, h, w, lambda a: _act(cfg, a), impl=moe_impl, qmm=qmm, valid=batch.get("moe_valid"))
    elif "gate_up" in w and getattr(qmm, "takes_act", False) and not native_down and "down" not in adapters:
        # act(g) * u inside the down matmul's kernel (kernels/dense_gemv): one kernel fewer
        m = qmm(proj(h, "gate_up"), w["down"], act=cfg.hidden_act, split_out=down_split)
    else:
        if "gate_up" in w:
            g, u = jnp.split(proj(h, "gate_up"), 2, axis=-1)
        else:
            g, u = proj(h, "gate"), proj(h, "up")
        m = proj(_act(cfg, g) * u, "down", split_out=down_split)
    if cfg.sandwich_norms:
        m = rms_norm(m, w["post_ffn_norm"], cfg.rms_norm_eps)
    return x, m, None if kv is None else (k_cache, v_cache)


def mrope_positions(cfg: ModelConfig, batch):
    """Multimodal RoPE (Qwen2-VL): batch["rope_pos"] [3, T] (temporal, height, width positions; equal for
    text tokens) -> [T, head_dim / 2], each frequency's position taken from its section's axis."""
    axis = np.repeat(np.arange(3), cfg.mrope_section)
    return batch["rope_pos"][axis].T


def unstack_layers(weights) -> dict:
    """Weights with `layers` as a list of per-layer dicts (for unrolled steps). Done one weight at a
    time, freeing each stacked array as soon as it is split, so the peak is one extra weight."""
    stacked = dict(weights["layers"])
    L = next(iter(stacked.values())).shape[0]
    per_layer = [dict() for _ in range(L)]
    for name in list(stacked):
        a = stacked.pop(name)
        for i in range(L):  # (the `lora` subtree is a dict of stacked arrays)
            per_layer[i][name] = jax.tree.map(lambda v: v[i], a) if isinstance(a, dict) else a[i]
        free_arrays(a)
    return dict(weights, layers=per_layer)


def free_arrays(a) -> None:
    for leaf in jax.tree.leaves(a):  # a (Cpu)QWeight frees every packed leaf
        leaf.delete() if hasattr(leaf, "delete") else None


def _concat_out(srcs):
    """Concatenate weights along the output axis N; None when they cannot be (mixed packed formats:
    a Q4_K_M file keeps some layers' v in Q6_K; NVFP4's per-tensor scales)."""
    if all(isinstance(a, CpuQWeight) for a in srcs):
        return cpu_native.concat_out(srcs)
    if any(isinstance(a, KMajor) for a in srcs):  # weights an earlier runner held [N, K] (models/kmajor)
        return KMajor(jnp.concatenate([a.wt for a in srcs], axis=-2)) if all(isinstance(a, KMajor) for a in srcs) else None
    if not any(isinstance(a, (QWeight, CpuQWeight)) for a in srcs):
        return jnp.concatenate(srcs, axis=-1)
    if not all(isinstance(a, QWeight) for a in srcs):
        return None
    metas = {dataclasses.replace(a.meta, N=0) for a in srcs}
    if len(metas) != 1 or srcs[0].meta.gscale:  # per-tensor global scales (NVFP4) differ: no concat
        return None
    meta = dataclasses.replace(srcs[0].meta, N=sum(a.meta.N for a in srcs))
    names = srcs[0].arrays
    return QWeight(meta, {n: jnp.concatenate([a.arrays[n] for a in srcs], axis=-1) for n in names})


_FUSED = {"qkv": ("q", "k", "v"), "qkv_bias": ("q_bias", "k_bias", "v_bias"), "gate_up": ("gate", "up")}


def fuse_projections(weights, free: bool = True) -> dict:
    """Concatenate q/k/v (and their biases) and gate/up along the output axis: fewer, larger matmuls
    per layer (on a GPU each matmul of a decode step is a separately launched, partly idle kernel).
    For one device only: a tensor-parallel split of the fused axis would mix q, k and v columns.
    Works on stacked layers (dict) and per-layer lists; each source array is freed once fused
    (unless free=False). LoRA stacks of the parts are joined likewise (models/lora.fuse)."""
    def fuse(layer: dict) -> dict:
        layer = dict(layer)
        for new, parts in _FUSED.items():
            if all(p in layer for p in parts):
                fused = _concat_out([layer[p] for p in parts])
                if fused is None:
                    continue
                srcs = [layer.pop(p) for p in parts]
                layer[new] = fused
                if "lora" in layer:
                    layer["lora"] = lora_mod.fuse(layer["lora"], parts, new, [a.shape[-1] for a in srcs])
                for a in srcs if free else ():
                    free_arrays(a)
        return layer

    layers = weights["layers"]
    layers = [fuse(w) for w in layers] if isinstance(layers, list) else fuse(layers)
    return dict(weights, layers=layers)


def embed(cfg: ModelConfig, weights, token_ids, dtype):
    x = weights["embed"][token_ids].astype(dtype)
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, dtype)
    return x


def forward_hidden(cfg: ModelConfig, weights, consts, kv, batch, *, scan_layers: bool,
                   attention: Callable = attn_ref.paged_attention, add_norm: Callable | None = None,
                   rope_kv: Callable | None = None, qmm: Callable | None = None,
                   rope_attend: Callable | None = None, moe_impl: str | None = None):
    """Run all layers. Returns (final-normed hidden [T, D], (k_cache, v_cache)).

    batch: token_ids [T], positions [T], slots [T], token_seq [T], block_tables [S, MB]; multimodal
    models' mixed steps also mm_embeds [T, D] and mm_mask [T] (rows that replace the token embeddings).
    add_norm: fused residual add + RMSNorm (kernels/rms_norm; default the jnp reference).
    """
    add_norm = add_norm or _add_rms_norm_ref
    layers = weights["layers"]
    dtype = (layers[0] if isinstance(layers, list) else layers)["attn_norm"].dtype
    x = embed(cfg, weights, batch["token_ids"], dtype)
    if "mm_embeds" in batch:  # multimodal models: image features replace their placeholders' embeddings
        x = jnp.where(batch["mm_mask"][:, None], batch["mm_embeds"].astype(dtype), x)
        batch = {k: v for k, v in batch.items() if k not in ("mm_embeds", "mm_mask")}
    if scan_layers:
        # Stacked native CPU weights are not scanned over (a scanned slice feeding a custom call is
        # copied every step): the kernel reads layer `index` of the whole stack in place.
        native = {k: v for k, v in layers.items() if isinstance(v, CpuQWeight)}
        scanned = {k: v for k, v in layers.items() if k not in native}

        def body(carry, xs):
            x, resid, kv = carry
            w, c = xs
            w = dict(w, **{k: cpu_native.LayerOf(v, c["index"]) for k, v in native.items()})
            x, resid, kv = decoder_layer(cfg, x, w, c, kv, batch, attention, resid, add_norm, rope_kv, qmm,
                                         rope_attend=rope_attend, moe_impl=moe_impl)
            return (x, resid, kv), None

        # The first block's residual is zero (x + 0 == x exactly): one carry structure for the scan.
        (x, resid, kv), _ = jax.lax.scan(body, (x, jnp.zeros_like(x), kv), (scanned, consts))
    else:
        # Python-unrolled layers, each a call of one jitted block: JAX traces and lowers the block (and
        # its Pallas kernels) once per program instead of once per layer — that was most of the start-up
        # time, and the compilation cache does not skip it. XLA inlines the calls, so the compiled
        # program is the same. The layer's constants (index, window, RoPE table) are arguments.
        static = {k: v for k, v in batch.items() if v is None or isinstance(v, int)}
        arrays = {k: v for k, v in batch.items() if k not in static}

        @jax.jit
        def block(x, resid, w, c, kv, arrays):
            return decoder_layer(cfg, x, w, c, kv, {**arrays, **static}, attention, resid, add_norm, rope_kv,
                                 qmm, split_sums=True, rope_attend=rope_attend, moe_impl=moe_impl)

        # The layer constants are compile-time literals here (numpy from the static config), not
        # slices of the traced `consts`: on the GPU each slice was a kernel (4 per layer, ~1 us each)
        # feeding the Pallas calls their layer index, window and RoPE table.
        static_consts = layer_constants(cfg)
        resid = None
        for i in range(cfg.num_layers):
            # Per-layer arrays (see unstack_layers): slicing a stacked weight inside the on-device
            # decode loop makes XLA copy it every step.
            w = layers[i] if isinstance(layers, list) else jax.tree.map(lambda a: a[i], layers)
            c = {k: np.asarray(v[i]) for k, v in static_consts.items()}
            x, resid, kv = block(x, resid, w, c, kv, arrays)
    return add_norm(x, resid, weights["final_norm"], cfg.rms_norm_eps)[1], kv


def logits_from_hidden(cfg: ModelConfig, weights, h, qmm: Callable | None = None):
    """h [N, D] -> f32 logits [N, V] (final soft-cap applied)."""
    if "lm_head" in weights:
        logits = linear(h, weights["lm_head"], qmm)
    else:
        logits = h @ weights["embed"].T
    logits = logits.astype(jnp.float32)
    if cfg.final_logit_softcap:
        cap = cfg.final_logit_softcap
        logits = jnp.tanh(logits / cap) * cap
    return logits
