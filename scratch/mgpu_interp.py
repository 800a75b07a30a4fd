import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
SHAPE=(128,128)
def body(x_gmem, o_gmem):
    def scoped(smem, bar):
        plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
        plgpu.barrier_wait(bar)
        v = smem[...]
        smem[...] = v * jax.lax.rsqrt(jnp.mean(v * v) + 1e-6)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(scoped, plgpu.SMEM(SHAPE, jnp.float32), plgpu.Barrier(num_arrivals=1))
k = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(SHAPE, jnp.float32), interpret=__import__("jax._src.pallas.mosaic_gpu.interpret.params", fromlist=["x"]).InterpretGPUParams())
x = jnp.arange(128*128, dtype=jnp.float32).reshape(SHAPE)/1e4
y = jax.jit(k)(x)
print(float(jnp.abs(y - x*jax.lax.rsqrt(jnp.mean(x*x)+1e-6)).max()))
