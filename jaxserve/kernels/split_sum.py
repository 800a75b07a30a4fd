"""A matmul output left as its split-K partial sums, for the consumer kernel to add.

A decode GEMV split over K writes f32 partials [P, ..., N]; adding them is one more ~1.2 us XLA kernel
per matmul (3 per layer on the H200 profile). Producers: the int8 kernel (quant_matmul/pallas_dp4a.py,
used by the model), 'bdot' and the dense GEMV (kernels/dense_gemv) when asked (both measured slower in
the model than without: bench/RESULTS.md). The consumers that are
kernels themselves — the fused add + RMSNorm and RoPE + K/V write — take a SplitSum and add the parts
while they load the row. `total()` is the plain output, rounded to the matmul's dtype exactly as the
matmul would have, so a consumer given a SplitSum computes the same function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class SplitSum:
    def __init__(self, parts, dtype):
        self.parts = parts  # [P, ..., N] f32
        self.dtype = jnp.dtype(dtype)

    @property
    def shape(self):
        return self.parts.shape[1:]

    def total(self):
        return add_parts(self.parts).astype(self.dtype)

    def tree_flatten(self):
        return (self.parts,), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        return cls(children[0], dtype)


def add_parts(parts):
    """parts[0] + parts[1] + ... in that order: the order the consumer kernels add them in, so a
    consumer given a SplitSum and one given its total see the same f32 values (jnp.sum's order is
    XLA's choice)."""
    acc = parts[0]
    for p in range(1, parts.shape[0]):
        acc = acc + parts[p]
    return acc


def total(y):
    """y itself, or a SplitSum's total."""
    return y.total() if isinstance(y, SplitSum) else y


def finish_parts(out, split_out: bool, x, N: int):
    """A split-K GEMV's [splits, M, N] output in x's shape: one split as it is (the kernel wrote x's
    dtype), else a SplitSum for the consumer (split_out) or the parts added here."""
    if out.shape[0] == 1:
        return out[0].reshape(*x.shape[:-1], N)
    if split_out:
        return SplitSum(out.reshape(out.shape[0], *x.shape[:-1], N), x.dtype)
    return add_parts(out).astype(x.dtype).reshape(*x.shape[:-1], N)
