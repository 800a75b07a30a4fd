"""Mixture-of-experts routing of a step: `route(logits [T, E], valid [T] bool | None, *, k, normalize)
-> (ids [T, k] int32, weights [T, k] f32)`: softmax over the router's logits in f32, the k largest
probabilities (ties: the lower expert id first, as lax.top_k), divided by their sum when `normalize`;
a token with valid False (a step's padding) takes the first valid token's experts with weight 0
(models/moe.park_padding: padding then reads no expert that no real token uses).

  reference      the model's own jnp ops (softmax, lax.top_k, the renormalization, park_padding)
  pallas_triton  one program per token (GPU; interpreted on CPU in the tests): on a decode step XLA
                 runs softmax, top-k, the renormalization and the padding rule as several small
                 kernels a layer; this is one

`get(name)` returns the implementation's `route`; kernels are imported lazily.
"""

from __future__ import annotations

from jaxserve.kernels import registry
from jaxserve.kernels.registry import IMPLEMENTATIONS, default_for  # noqa: F401


def get(name: str):
    return registry.load(__name__, name, "route", "moe_route")
