"""Dense matmul weights held [N, K] (K contiguous, the checkpoints' own [out, in] order) for the
matmuls that XLA computes as a multiply + reduce on a GPU.

XLA's GPU simplifier rewrites every dot whose two operand matrices together hold fewer than 10M
elements into a multiply and a reduction over K (`ShouldStrengthReduceDotToReduce` with
`IsMatrixMultiplicationTooSmallForRewriting(dot, 10000000)`), whatever the rows. Over a [K, N] weight
that reduction runs down the columns, and for a decode row XLA writes the whole x * W product out and
reads it back (bench/RESULTS.md session 27). Over [N, K] it is a row reduction that reads each weight
once. One row, H100 (session 28, `bench/gemv_layout.py`): a 2,048 x 2,048 weight 17.2 us held [K, N],
**3.1 us held [N, K]**, 5.4 us in the Pallas dense GEMV. Larger matmuls keep [K, N]: there XLA's GEMM
is 5-9% faster than over [N, K] (same table).

`KMajor(wt)` is the weight as a pytree node: `.shape` is the logical [..., K, N], `.wt` the array
[..., N, K]. `transformer.linear` (and the MoE router) compute x @ W as a dot_general over K of both.
`to_kmajor(every=True)` (EngineConfig.kmajor_weights "all"; the default on one GPU when the engine runs
one sequence at a time without speculation, `auto_mode`) converts the large weights too; their one-row matmuls are then the
f32 multiply + row reduction (`matmul`): Llama-8B bs1 +3.3-3.6%, 32 sequences -3% (H100, session 29).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# XLA's threshold (elements of the two operand matrices) and the rows a decode step may add to it.
XLA_SMALL_DOT = 10_000_000
DECODE_ROWS = 64
# The dense 2-D weights of a decoder layer that go through transformer.linear or the MoE router.
NAMES = ("q", "k", "v", "o", "qkv", "gate", "up", "gate_up", "down", "router", "shared_gate", "shared_up",
         "shared_down")


@jax.tree_util.register_pytree_node_class
class KMajor:
    """A dense weight W [..., K, N] held transposed, wt = W^T [..., N, K]."""

    def __init__(self, wt):
        self.wt = wt

    def tree_flatten(self):
        return (self.wt,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0])

    @property
    def shape(self) -> tuple[int, ...]:
        s = tuple(self.wt.shape)
        return (*s[:-2], s[-1], s[-2])

    @property
    def ndim(self) -> int:
        return self.wt.ndim

    @property
    def dtype(self):
        return self.wt.dtype

    def astype(self, dtype) -> "KMajor":
        return KMajor(self.wt.astype(dtype))

    def __getitem__(self, i) -> "KMajor":
        """Index the leading (stacked-layer) dims."""
        return KMajor(self.wt[i])

    def dense(self):
        """W [..., K, N] (tests, conversions)."""
        return jnp.swapaxes(self.wt, -1, -2)


def matmul(x, w: KMajor):
    """x [..., K] @ W -> [..., N]. One row of a weight above XLA's threshold: an f32 multiply +
    reduction over K, XLA's row reduction, which reads the weight once faster than its GEMV (H100,
    session 28: the Llama-8B q/k/v 19.2 -> 16.6 us, o 13.2 -> 11.2, down 41.1 -> 39.0); more rows: a
    dot over the last axis of both (a reduction reads the weight once per row)."""
    if w.wt.ndim != 2:
        raise ValueError(f"KMajor matmul takes one layer's weight, not {w.wt.shape}")
    N, K = w.wt.shape
    if math.prod(x.shape[:-1]) == 1 and not is_small(K, N):  # (below it XLA makes the same reduction itself)
        f32 = jnp.float32
        return jnp.sum(x.astype(f32)[..., None, :] * w.wt.astype(f32), axis=-1).astype(jnp.result_type(x, w.wt))
    return lax.dot_general(x, w.wt, (((x.ndim - 1,), (1,)), ((), ())))


def auto_mode(platform: str, single_device: bool, max_num_seqs: int, num_speculative_tokens: int):
    """EngineConfig.kmajor_weights=None: off but on one GPU (the strength reduction is XLA's GPU
    compiler's); there "all" when every decode matmul has one row (one sequence at a time, no drafts to
    verify): the 8B's one-row matmuls as row reductions, bs1 +3.3-3.6% device-only on an H100, prefill
    the same (bench/RESULTS.md session 29), while at 32 rows [N, K] GEMMs cost 3-9% — so only the
    small weights when sequences batch."""
    if platform != "gpu" or not single_device:
        return False
    return "all" if max_num_seqs == 1 and num_speculative_tokens == 0 else True


def is_small(K: int, N: int, rows: int = DECODE_ROWS) -> bool:
    """Whether XLA strength-reduces a [rows, K] x [K, N] dot (then [N, K] is the faster layout)."""
    return rows * K + K * N < XLA_SMALL_DOT


def to_kmajor(weights: dict, free: bool = False, every: bool = False) -> dict:
    """The weights with each small dense decoder-layer matmul weight (NAMES, `is_small`; every: all of
    them) as a KMajor, the others [K, N]: `set_layout(weights, "all" if every else True, free)`."""
    return set_layout(weights, "all" if every else True, free)


def set_layout(weights: dict, mode, free: bool = False) -> dict:
    """The weights with each dense decoder-layer matmul weight (NAMES) in the layout `mode` asks for —
    False: every one [K, N]; True: the small ones (`is_small`) [N, K]; "all": every one [N, K] — whatever
    layout an earlier engine on the same model left them in (the engine's layout follows its config,
    not the model's history). Stacked ([L, K, N]) or per-layer lists alike; other leaves untouched.
    free: delete each source array once relaid (the runner's copy), so the peak is one extra weight —
    an engine built on a LoadedModel thus takes its weights over: one live engine per loaded model."""
    def wanted(K: int, N: int) -> bool:
        return mode == "all" or (bool(mode) and is_small(K, N))

    def convert(layer: dict) -> dict:
        layer = dict(layer)
        for name in NAMES:
            w = layer.get(name)
            if isinstance(w, KMajor) and not wanted(*w.shape[-2:]):
                src, layer[name] = w.wt, w.dense()
            elif (isinstance(w, jax.Array) and w.ndim in (2, 3) and jnp.issubdtype(w.dtype, jnp.floating)
                  and wanted(*w.shape[-2:])):
                src, layer[name] = w, KMajor(jnp.swapaxes(w, -1, -2))
            else:  # already as wanted, or not a dense matmul weight
                continue
            if free and isinstance(src, jax.Array):
                src.delete()
        return layer

    layers = weights["layers"]
    new = [convert(lw) for lw in layers] if isinstance(layers, list) else convert(layers)
    return dict(weights, layers=new)
