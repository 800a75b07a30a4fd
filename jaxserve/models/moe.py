"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) as a pure function of a layer's weights.

Each token's router picks `experts_per_token` experts (softmax over the router's logits in f32, top-k,
renormalized when the config says so, as transformers); the chosen experts' outputs, weighted by the
router, are added back to their tokens. Qwen2-MoE adds a shared expert scaled by a sigmoid gate.

How the experts run (XLA only, CPU and GPU): `jax.lax.ragged_dot` is a real grouped GEMM only on TPU;
elsewhere it expands its input to every expert (measured on the H200: 8.6 GB of temporaries and 16x
the work at Qwen3-30B-A3B's shape, 2,048 tokens). Instead the (token, expert) pairs are sorted by
expert and laid out in tiles of `tile` rows, each tile holding one expert's pairs (its group padded to
a multiple of the tile), and every projection is one batched matmul of the tiles against their
experts' gathered weights. A decode step (few pairs) uses tiles of one row: exactly the chosen
experts' weights are read. A model with few, wide experts (Mixtral: 8) and many pairs runs every
expert on every token instead (E/k times the MLP work, no gathered copies of wide weights).

On a GPU, tiles of up to KERNEL_MAX_TILE rows (decode steps and short prompt chunks) run through
kernels/moe_gemv instead: Pallas kernels that read each tile's expert weights in place (no gathered
copy). A decode step's one-row tiles need no sort either: one row per (token, choice) in the router's
order, and each token's k rows weighted and added. `moe_mlp(..., impl=)` picks the path by hand (the
tests run the kernel in the interpreter on CPU).

Packed (quantized) experts: a QWeight stack [E, K, N] (GGUF, ISQ) runs on a GPU through the grouped
quantized matmul (tiles of up to PACKED_KERNEL_MAX_TILE rows, each tile's expert read packed, in
place); elsewhere, or for longer tiles, it is gathered packed and only the gathered experts are
dequantized (XLA); on CPU the
native quantized kernel (CpuQWeight, kernels/quant_matmul/cpu_native) reads each tile's expert in
place, one call per tile. Every expert on every token (`_all_experts`) dequantizes the whole stack
behind an optimization barrier tied to the step's activations, so that XLA cannot hoist it out of the
on-device decode loop (which would hold every layer's experts unpacked).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.kernels import moe_gemv, moe_route
from jaxserve.kernels.quant_matmul import cpu_native
from jaxserve.kernels.quant_matmul.cpu_native import CpuQWeight
from jaxserve.quant.qweight import KN_CODES, QWeight, dequantize, leaf_names

# Tiles of up to this many rows take the kernel by default on a GPU (16 is the design: longer prompt
# chunks keep XLA's batched matmuls, tensor-core bound there). Measured on an H100 (session 18,
# bench/RESULTS.md), Qwen3-30B-A3B expert shapes, one layer call: 40.8 vs XLA's 241.7 us at one token,
# 501 vs 1,434 us at 32 tokens (16-row tiles). 0 = XLA's gathered-weights path everywhere.
KERNEL_MAX_TILE = 16
# The same for packed (quantized) expert stacks and their kernel (quant_matmul.pallas_triton's
# grouped_qmatmul: 'fma' one-row tiles, 'dot' 16-64-row tiles). H100, q4k experts: 54.5 vs XLA's
# gather + dequantize 376 us a layer call at one token, 700 vs 3,200 us at 32 tokens; the engine (q4k
# Qwen3-30B-A3B shape) decodes 240 tok/s at batch 1 against 57 on XLA's path.
PACKED_KERNEL_MAX_TILE = 16
# Steps of up to this many tokens route in kernels/moe_route's Pallas kernel where the experts take
# the Pallas kernels (0: XLA's ops always).
ROUTE_KERNEL_MAX_TOKENS = 256


def route(cfg: ModelConfig, h, router, valid=None, impl: str = "reference", qmm: Callable | None = None):
    """h [T, D] -> (expert ids [T, k] int32, their weights [T, k] f32): kernels/moe_route (softmax in
    f32, top-k, renormalized when the config says so; padding tokens, valid False, parked on the first
    valid token's experts with weight 0). impl: its implementation; qmm: the runner's matmul when it
    takes dense weights (kernels/dense_gemv: the router's narrow one-row GEMV)."""
    from jaxserve.models.transformer import linear  # (transformer imports this module)

    # the layers' matmul dispatch: a [N, K] router (models/kmajor) or the runner's dense GEMV
    logits = linear(h, router.astype(h.dtype), qmm)
    return moe_route.get(impl)(logits, valid, k=cfg.experts_per_token, normalize=cfg.norm_topk_prob)


def _tile(pairs: int) -> int:
    """Rows per tile for this many (token, expert) pairs: 1 for decode-sized steps (only the chosen
    experts' weights are gathered), larger for prompt chunks (fewer gathered weight copies)."""
    return 1 if pairs <= 64 else 16 if pairs <= 1024 else 64 if pairs <= 16384 else 256


def experts_impl(impl: str | None, tile: int, packed: bool = False) -> str:
    """The expert path of tiles of `tile` rows: 'xla' (gathered weights, batched matmuls) or a
    kernels/moe_gemv implementation (packed experts: the grouped quantized matmul). None: the Pallas
    kernel on a GPU for tiles of up to KERNEL_MAX_TILE (packed: PACKED_KERNEL_MAX_TILE) rows, else XLA
    (decided when the step is traced)."""
    if impl is None:
        on_gpu = moe_gemv.default_for(jax.default_backend()) == "pallas_triton"
        limit = PACKED_KERNEL_MAX_TILE if packed else KERNEL_MAX_TILE  # (read when traced)
        return "pallas_triton" if on_gpu and tile <= limit else "xla"
    if impl != "xla" and impl not in moe_gemv.IMPLEMENTATIONS:
        raise ValueError(f"unknown MoE expert path {impl!r}; known: xla, {', '.join(moe_gemv.IMPLEMENTATIONS)}")
    return impl


def moe_mlp(cfg: ModelConfig, h, w: dict, act: Callable, impl: str | None = None, qmm: Callable | None = None,
            valid=None):
    """The MoE block's output [T, D] for the normed hidden states h [T, D]; w: one layer's weights
    (router [D, E], experts_gate / experts_up [E, D, F], experts_down [E, F, D], shared_* for Qwen2-MoE;
    experts and the shared expert may be packed). act: the activation (the kernel path applies
    cfg.hidden_act itself); impl: see experts_impl; qmm: the shared expert's quantized matmul.
    valid (bool [T], optional): False for a step's padding tokens, see kernels/moe_route."""
    T, D = h.shape
    E, K = cfg.num_experts, cfg.experts_per_token
    P = T * K
    packed = isinstance(w["experts_gate"], QWeight)
    # Steps whose experts run on the Pallas kernels route in one Pallas kernel too (XLA's softmax,
    # top-k and padding rule are several small kernels a layer); the kernel's per-token program reads
    # the step's valid mask whole, so only decode-sized steps.
    kernel_route = T <= ROUTE_KERNEL_MAX_TOKENS and experts_impl(impl, _tile(P), packed) != "xla"
    ids, weights = route(cfg, h, w["router"], valid, "pallas_triton" if kernel_route else "reference", qmm)
    dt = h.dtype
    if E <= 16 and P > 4 * E:
        # packed experts on their kernel: 16-row sorted tiles read each used expert about once
        if packed and experts_impl(impl, 16, packed) != "xla":
            out = tiled_experts(h, ids, weights, w, act, E, 16, experts_impl(impl, 16, packed), cfg.hidden_act)
        else:
            out = _all_experts(h, ids, weights, w, act, E)
    else:
        tile = _tile(P)
        out = tiled_experts(h, ids, weights, w, act, E, tile, experts_impl(impl, tile, packed), cfg.hidden_act)
    if cfg.shared_expert_size:
        from jaxserve.models.transformer import linear  # (transformer imports this module)

        lin = lambda x, m: linear(x, m if isinstance(m, (QWeight, CpuQWeight, cpu_native.LayerOf)) else m.astype(dt), qmm)
        s = lin(act(lin(h, w["shared_gate"])) * lin(h, w["shared_up"]), w["shared_down"])
        gate = jax.nn.sigmoid(jnp.dot(h, w["shared_expert_gate"].astype(dt)).astype(jnp.float32))
        out = out + gate * s.astype(jnp.float32)
    return out.astype(dt)


def _all_experts(h, ids, weights, w, act, E):
    """Every expert on every token, each output weighted by its router weight (0 where not chosen)."""
    dt = h.dtype
    coef = jnp.zeros((h.shape[0], E), jnp.float32).at[jnp.arange(h.shape[0])[:, None], ids].add(weights)
    every = jnp.arange(E, dtype=jnp.int32)
    x = jnp.broadcast_to(h, (E, *h.shape))  # [E, T, D]: each expert's tile is every token
    mm = lambda a, name, out=None: _expert_proj(a, w[name], every, dt, out, whole=h)  # noqa: E731
    y = mm(act(mm(x, "experts_gate")) * mm(x, "experts_up"), "experts_down", jnp.float32)
    return jnp.einsum("etd,te->td", y, coef)


def _expert_proj(a, w, idx, dt, out=None, live=None, whole=None):
    """a [n, t, K] @ expert idx[i] of the stack w -> [n, t, N] in `out` (default dt), whatever form
    this projection's stack has: the native CPU kernel per tile (tiles from `live` on skipped), else a
    batched matmul against dense expert weights — the whole stack in order when `whole` is given (the
    every-expert path; `whole` anchors a packed stack's dequantize, see _dense_experts), else the
    gathered experts idx."""
    if _native(w):
        return _native_proj(a, w, idx, live).astype(out or dt)
    ws = _dense_experts(w, whole, dt) if whole is not None else _gathered_experts(w, idx, dt)
    return jnp.einsum("ntk,nkf->ntf", a, ws, preferred_element_type=out)


def _native(w) -> bool:
    return isinstance(w, (CpuQWeight, cpu_native.LayerOf))


def _dense_experts(w, h, dt):
    """The whole expert stack [E, K, N] as dt; a packed one dequantized after a barrier on h (a value
    of this step), so the dequantize stays inside the decode loop instead of being hoisted out."""
    if isinstance(w, cpu_native.LayerOf):
        w = w.weight[w.index]
    if isinstance(w, (QWeight, CpuQWeight)):
        w, _ = jax.lax.optimization_barrier((w, h))
        return (dequantize(w) if isinstance(w, QWeight) else cpu_native.dequantize(w)).astype(dt)
    return w.astype(dt)


def _gathered_experts(w, idx, dt):
    """Experts `idx` [n] of the stack w as dense [n, K, N] in dt (a packed stack is gathered packed)."""
    if isinstance(w, QWeight):  # (only the leaves dequantize reads)
        keep = {*leaf_names(w.meta), KN_CODES}
        return dequantize(QWeight(w.meta, {n: jnp.take(a, idx, axis=0) for n, a in w.arrays.items()
                                           if n in keep})).astype(dt)
    return jnp.take(w, idx, axis=0).astype(dt)


def _native_proj(x, w, idx, live=None):
    """x [n, t, K] @ expert idx[i] of a native CPU stack (CpuQWeight [E, ...], or a LayerOf one of
    [L, E, ...] inside the scan over layers) -> [n, t, N] in x's dtype: one kernel call per tile,
    each reading its expert in place; live (int32 [1]): tiles from this index on are skipped (zeros)."""
    cw, idx = w, idx.astype(jnp.int32)
    if isinstance(w, cpu_native.LayerOf):  # [L, E, ...] -> [L * E, ...]: a free reshape
        cw = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), w.weight)
        idx = w.index * w.weight.batch_shape[1] + idx
    call = lambda xi, i: cpu_native.qmatmul(xi, cw, layer=i)  # noqa: E731
    if live is None:
        return jax.vmap(call)(x, idx)
    skip = lambda xi, i: jnp.zeros((*xi.shape[:-1], cw.meta.N), xi.dtype)  # noqa: E731
    n = jnp.arange(x.shape[0])  # a sequential map: the skipped tiles' calls are really not made
    return jax.lax.map(lambda a: jax.lax.cond(a[2] < live[0], call, skip, a[0], a[1]), (x, idx, n))


def tiled_experts(h, ids, weights, w, act, E, tile, impl="xla", act_name="silu", **tuning):
    """[T, D] f32: the chosen experts' outputs weighted and added, by `impl` (experts_impl; the kernel
    path falls back to XLA for shapes it does not take). tuning: the kernel's keyword arguments."""
    names = ("experts_gate", "experts_up", "experts_down")
    if impl != "xla" and isinstance(w["experts_gate"], QWeight):
        from jaxserve.kernels.quant_matmul import pallas_triton as qmm_triton

        if impl == "pallas_triton" and all(qmm_triton.grouped_supports(w[n], tile) for n in names):
            return _packed_kernel_experts(qmm_triton.grouped_qmatmul, h, ids, weights, w, act, E, tile, tuning)
    elif impl != "xla":
        kernel = moe_gemv.get(impl)
        if all(kernel.supports(h.dtype, w[n], tile) for n in names):
            return _kernel_experts(kernel, h, ids, weights, w, act_name, E, tile, tuning)
    return _tiled_experts(h, ids, weights, w, act, E, tile)


def _packed_kernel_experts(grouped, h, ids, weights, w, act, E, tile, tuning):
    """Packed expert stacks through the grouped quantized matmul: the tile's input rows are gathered
    (activations: small), each tile's expert weights read packed in place."""
    dt = h.dtype
    if tile == 1:  # decode: one row per (token, choice), nothing sorted
        row_token, tile_expert = moe_gemv.pair_layout(ids)
        x, live = h[row_token], None
    else:
        order, token, dest, tile_expert, live = _sorted_tiles(ids, E, tile)
        x = jnp.zeros((tile_expert.shape[0] * tile, h.shape[1]), dt).at[dest].set(h[token])
    mm = lambda a, name: grouped(a, w[name], tile_expert, live_groups=live, **tuning)
    a = (act(mm(x, "experts_gate")) * mm(x, "experts_up")).astype(dt)
    y = mm(a, "experts_down")
    if tile == 1:
        return moe_gemv.combine_pairs(y, weights)
    return jnp.zeros(h.shape, jnp.float32).at[token].add(y[dest] * weights.reshape(-1)[order][:, None])


def _kernel_experts(kernel, h, ids, weights, w, act_name, E, tile, tuning):
    wg, wu, wd = w["experts_gate"], w["experts_up"], w["experts_down"]
    if tile == 1:  # decode: one row per (token, choice), nothing sorted
        row_token, tile_expert = moe_gemv.pair_layout(ids)
        a = kernel.gate_up(h, row_token, tile_expert, wg, wu, act=act_name, **tuning)
        return moe_gemv.combine_pairs(kernel.down(a, tile_expert, wd, **tuning), weights)
    order, token, dest, tile_expert, live = _sorted_tiles(ids, E, tile)
    row_token = jnp.zeros((tile_expert.shape[0] * tile,), jnp.int32).at[dest].set(token)
    a = kernel.gate_up(h, row_token, tile_expert, wg, wu, act=act_name, live_tiles=live, **tuning)
    y = kernel.down(a, tile_expert, wd, live_tiles=live, **tuning)
    return jnp.zeros(h.shape, jnp.float32).at[token].add(y[dest] * weights.reshape(-1)[order][:, None])


def _sorted_tiles(ids, E, tile):
    """The pairs sorted by expert into tiles of `tile` rows of one expert each: (order: pair of each
    sorted position, token: its token, dest: its row, tile_expert [n_tiles], live: the number of used
    tiles [1]; the tile count is the worst case, the tiles past `live` hold no pair)."""
    K = ids.shape[1]
    P = ids.size
    n_tiles = -(-P // tile) + (min(E, P) if tile > 1 else 0)  # each used expert pads < one tile
    flat = ids.reshape(-1)  # pair p is token p // K's (p % K)-th choice
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    sizes = jnp.bincount(flat, length=E)
    padded = -(-sizes // tile) * tile
    pad_end = jnp.cumsum(padded)
    dest = (pad_end - padded)[expert] + jnp.arange(P) - (jnp.cumsum(sizes) - sizes)[expert]
    # tile i's expert: the one whose padded range holds row i * tile (unused tiles: the last expert)
    tile_expert = jnp.minimum(jnp.searchsorted(pad_end, jnp.arange(n_tiles) * tile, side="right"), E - 1)
    return order, order // K, dest, tile_expert.astype(jnp.int32), (pad_end[-1:] // tile).astype(jnp.int32)


def _tiled_experts(h, ids, weights, w, act, E, tile):
    """The pairs sorted by expert into tiles of one expert each; one batched matmul per projection over
    the tiles' gathered expert weights."""
    T, D = h.shape
    order, token, dest, tile_expert, live = _sorted_tiles(ids, E, tile)
    n_tiles = tile_expert.shape[0]
    rows = jnp.zeros((n_tiles * tile, D), h.dtype).at[dest].set(h[token])  # unused tiles: zero rows
    x = rows.reshape(n_tiles, tile, D)
    dt = h.dtype
    live = live if tile > 1 else None  # (one-row tiles: exactly the pairs, none unused)
    mm = lambda a, name, out=None: _expert_proj(a, w[name], tile_expert, dt, out, live)  # noqa: E731
    y = mm(act(mm(x, "experts_gate")) * mm(x, "experts_up"), "experts_down", jnp.float32)
    y = y.reshape(n_tiles * tile, D)[dest] * weights.reshape(-1)[order][:, None]
    return jnp.zeros((T, D), jnp.float32).at[token].add(y)
