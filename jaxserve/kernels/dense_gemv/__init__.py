"""Decode GEMV of dense (bf16/f16/f32) weights: `gemv(x, w, act=None, split_out=False)` = x [M, K] @ w [K, N]
for the few rows of a decode step, or, with `act`, (act(g) * u) @ w where x = [g | u] is the fused
gate/up output [M, 2K] (the SiLU/GELU-multiply done while x is loaded: one kernel fewer per layer).

  reference      plain jax.numpy; the oracle (returns the plain output, never a SplitSum)
  pallas_triton  one Pallas Triton-backend kernel (GPU): split over K; with split_out its f32 partials
                 go to the consumer kernel as a SplitSum (kernels/split_sum.py) instead of XLA's GEMM
                 and its split-K reduction kernel

`engine_matmul(packed)` is the runner's matmul (EngineConfig.dense_gemv): dense weights of the matmuls
whose output goes to a kernel that takes a SplitSum (q/k/v, o) or that take the activation (down) run
the Pallas GEMV for up to `max_m` rows; everything else is x @ w (dense) or `packed` (QWeight).
"""

from __future__ import annotations

import functools
import math

from jaxserve.kernels import registry
from jaxserve.kernels.registry import IMPLEMENTATIONS, default_for  # noqa: F401

ENGINE_MAX_M = 2
# The engine's default on one GPU (EngineConfig.dense_gemv None): only decode matmuls of at most
# ENGINE_MAX_M rows with at most this many output columns take the Pallas GEMV. XLA emits one-row
# matmuls of N <= 2,048 not as a GEMM but as a multiply that writes the whole x * W product, then a
# reduction of it: the weight's bytes moved three times (bench/RESULTS.md session 27, H100:
# Qwen3-30B-A3B's o projection 28 us a layer, its router 11 us; with this default Llama-3.2-1B bs1
# +8%, the MoE model's first 24 layers +28%). Wider matmuls stay XLA's GEMMs, which beat this kernel
# there (session 6).
AUTO_MAX_N = 2048


def get(name: str):
    return registry.load(__name__, name, "gemv", "dense_gemv")


def activation(name: str, g):
    """The gated MLP's activation (ModelConfig.hidden_act) in jnp: the model's function
    (transformer._act) and this op's fallback; the kernel's f32 formula is reference.act_f32."""
    import jax

    if name == "gelu_tanh":
        return jax.nn.gelu(g, approximate=True)
    if name == "silu":
        return jax.nn.silu(g)
    raise ValueError(f"unknown activation {name!r}")


def act_mul(act: str, x):
    """act(g) * u of x = [g | u]."""
    import jax.numpy as jnp

    g, u = jnp.split(x, 2, axis=-1)
    return activation(act, g) * u


def engine_matmul(packed=None, *, max_m: int = ENGINE_MAX_M, max_n: int | None = None, **tuning):
    """The runner's matmul (transformer.linear's `qmm`) with the dense decode GEMV on: packed
    weights go to `packed` (None: the platform's quantized matmul); dense 2-D weights of a call with
    at most max_m rows go to the Pallas GEMV (tuning: its keyword arguments) when the call asks for
    split_out or act (max_n None: every width), or, with max_n, when the weight has at most max_n
    columns (any call: the engine's default, AUTO_MAX_N); other dense calls are x @ w. A partial of
    a module function, so the program store's key names its arguments (program_store.stable_name)."""
    mm = functools.partial(_engine_mm, packed=packed, max_m=max_m, max_n=max_n,
                           tuning=tuple(sorted(tuning.items())))
    mm.takes_split_out = True
    mm.takes_dense = True  # transformer.linear hands it dense weights too
    mm.takes_act = True  # ... and the down projection's [g | u] input with the activation's name
    return mm


def _engine_mm(x, w, *, split_out: bool = False, act: str | None = None, packed=None, max_m: int,
               max_n: int | None = None, tuning):
    from jaxserve.kernels.dense_gemv import pallas_triton
    from jaxserve.models import kmajor
    from jaxserve.quant.qweight import QWeight

    if isinstance(w, kmajor.KMajor):  # XLA's reduction over [N, K] beats this kernel (models/kmajor)
        return kmajor.matmul(act_mul(act, x) if act is not None else x, w)
    if isinstance(w, QWeight):
        from jaxserve.kernels import quant_matmul

        return quant_matmul.apply(act_mul(act, x) if act is not None else x, w, packed, split_out)
    M = math.prod(x.shape[:-1])
    wanted = (split_out or act is not None) if max_n is None else (getattr(w, "ndim", 0) == 2 and w.shape[-1] <= max_n)
    if wanted and M <= max_m and pallas_triton.supports(x, w, act):
        return pallas_triton.gemv(x, w, act=act, split_out=split_out, **dict(tuning))
    x = act_mul(act, x) if act is not None else x
    return x @ w
