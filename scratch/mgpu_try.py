import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

def make(pdl):
    def body(x_ref, o_ref):
        if pdl:
            plgpu.griddepcontrol_wait()
        o_ref[...] = x_ref[...] + 1.0
    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
                          compiler_params=plgpu.CompilerParams())
x = jnp.zeros((16, 128), jnp.float32)
for pdl in (False, True):
    f = jax.jit(make(pdl))
    try:
        txt = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        print(pdl, "lowered", len(txt), "uses_pdl" in txt, [l[:200] for l in txt.splitlines() if "custom_call" in l][:2])
    except Exception as e:
        print(pdl, "FAIL", type(e).__name__, str(e)[:600])
