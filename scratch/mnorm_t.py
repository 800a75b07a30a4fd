import jax, jax.numpy as jnp, numpy as np
from jaxserve.kernels.rms_norm import mosaic_gpu as M, reference as R
from jaxserve.kernels.split_sum import SplitSum
k = jax.random.split(jax.random.key(0), 4)
for T, D, kind in [(1, 256, "r"), (3, 512, "none"), (2, 256, "split")]:
    x = jax.random.normal(k[0], (T, D), jnp.bfloat16)
    w = jax.random.normal(k[1], (D,), jnp.bfloat16)
    r = None if kind == "none" else jax.random.normal(k[2], (T, D), jnp.bfloat16)
    if kind == "split":
        r = SplitSum(jax.random.normal(k[3], (3, T, D), jnp.float32), jnp.bfloat16)
    s1, h1 = M.add_rms_norm(x, r, w, 1e-5)
    s0, h0 = R.add_rms_norm(x, r, w, 1e-5)
    print(T, D, kind, float(jnp.abs(s1.astype(float)-s0.astype(float)).max()), float(jnp.abs(h1.astype(float)-h0.astype(float)).max()))
