import sys; sys.argv=["x"]
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp
import pdl_probe as P
x = jnp.zeros(P.SHAPE, jnp.float32)
for w,l in ((False,False),(True,False),(True,True)):
    f = jax.jit(P.mosaic_kernel(w,l))
    try:
        txt = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        print(w,l,"lowered", "griddepcontrol" in txt, "uses_pdl" in txt)
    except Exception as e:
        import traceback; traceback.print_exc(limit=-3); print("FAIL", type(e).__name__, str(e)[:500])
