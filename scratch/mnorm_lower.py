import jax, jax.numpy as jnp
from jaxserve.kernels.rms_norm import mosaic_gpu as M
from jaxserve.kernels.split_sum import SplitSum
for T, P in [(1, 0), (1, 7), (32, 0), (1, -1)]:
    x = jax.ShapeDtypeStruct((T, 4096), jnp.bfloat16); w = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    if P > 0:
        f = lambda x, p, w: M.add_rms_norm(x, SplitSum(p, jnp.bfloat16), w, 1e-5, interpret=False)
        args = (x, jax.ShapeDtypeStruct((P, T, 4096), jnp.float32), w)
    elif P == 0:
        f = lambda x, r, w: M.add_rms_norm(x, r, w, 1e-5, interpret=False); args = (x, x, w)
    else:
        f = lambda x, w: M.add_rms_norm(x, None, w, 1e-5, interpret=False); args = (x, w)
    try:
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        print(T, P, "ok", txt.count("mosaic_gpu"), "griddepcontrol" in txt)
    except Exception as e:
        import traceback; traceback.print_exc(limit=-2); print(T, P, "FAIL", type(e).__name__, str(e)[:400])
