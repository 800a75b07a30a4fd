"""Residual add + RMSNorm: `add_rms_norm(x, r, w, eps) -> (x + r, rms_norm(x + r) * w)`; r may be None.

  reference      plain jax.numpy (XLA fuses it on CPU); the oracle
  pallas_triton  one Pallas Triton-backend kernel per call (GPU): on a decode step XLA runs the add,
                 the reduction and the scale as 2-3 separate ~2 us kernels; this is one

`get(name)` returns the implementation's `add_rms_norm`; kernels are imported lazily.
"""

from __future__ import annotations

from jaxserve.kernels import registry
from jaxserve.kernels.registry import IMPLEMENTATIONS, default_for  # noqa: F401


def get(name: str):
    return registry.load(__name__, name, "add_rms_norm", "rms_norm")
