"""Paged attention: one contract (see reference.py), several implementations.

  reference      plain jax.numpy; the CPU path and the oracle of every other implementation
  pallas_triton  Pallas on the Triton backend (GPU); runs on CPU in the Pallas interpreter (slow,
                 tests only)
  cpu_native     per-token attention in the native CPU library (XLA FFI; the runner's CPU decode
                 region; prompt chunks keep the reference's tiled variant)

`get(name)` returns the implementation's `paged_attention` callable; kernels are imported lazily so
that importing this package stays light (no Pallas/Triton import on the CPU path).
"""

from __future__ import annotations

from jaxserve.kernels import registry
from jaxserve.kernels.registry import IMPLEMENTATIONS  # noqa: F401


def default_for(platform: str, *, one_device: bool = True) -> str:
    """The shared platform policy (registry.default_for), except that on one CPU device the native
    library's kernel serves the decode region when it builds (over a CPU mesh the custom call would
    not be partitioned: the reference)."""
    if platform == "cpu" and one_device:
        from jaxserve.kernels.quant_matmul import cpu_native

        if cpu_native.available():
            return "cpu_native"
    return registry.default_for(platform)


def get(name: str):
    if name == "cpu_native":  # CPU-only, outside the shared reference/Pallas registry
        from jaxserve.kernels.paged_attention import cpu_native

        return cpu_native.paged_attention
    return registry.load(__name__, name, "paged_attention", "paged attention")


def get_tiled(name: str, tile: int):
    """The prefill-region implementation: tokens in tiles of `tile` tokens of one sequence each."""
    import functools

    if name in ("reference", "cpu_native"):
        from jaxserve.kernels.paged_attention import reference

        return functools.partial(reference.paged_attention_tiled, tile=tile)
    if name == "pallas_triton":
        from jaxserve.kernels.paged_attention import pallas_triton

        return functools.partial(pallas_triton.paged_attention, mode="prefill")
    raise ValueError(f"unknown paged attention implementation {name!r}; known: {IMPLEMENTATIONS}")
