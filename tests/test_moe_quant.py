"""Mixture-of-experts models with packed (quantized) experts: the expert stacks stay QWeights [E, K, N]
on the device (only the gathered experts are dequantized) or go to the native CPU kernel (each tile's
expert read in place), and compute the same function as the dequantized weights; ISQ quantizes the
experts (the router stays dense), through `LLM` and through a pre-quantized checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import make_tiny_model
from paged_model import PagedModel
from jaxserve.config import ModelConfig
from jaxserve.kernels.quant_matmul import cpu_native
from jaxserve.models import moe
from jaxserve.quant.isq import quantize
from jaxserve.quant.qweight import QWeight, dequantize, stack

D, F, S = 64, 96, 80
EXPERTS = ("experts_gate", "experts_up", "experts_down")
SHARED = ("shared_gate", "shared_up", "shared_down")


def _layer(experts: int, fmt: str, seed: int):
    """One Qwen2-MoE layer's weights: dense, and with experts + shared expert quantized to `fmt`."""
    rng = np.random.default_rng(seed)
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.3
    dense = {"router": r(D, experts), "experts_gate": r(experts, D, F), "experts_up": r(experts, D, F),
             "experts_down": r(experts, F, D), "shared_gate": r(D, S), "shared_up": r(D, S),
             "shared_down": r(S, D), "shared_expert_gate": r(D, 1)}
    packed = dict(dense)
    for n in EXPERTS:
        packed[n] = stack([quantize(e, fmt) for e in dense[n]])
    for n in SHARED:
        packed[n] = quantize(dense[n], fmt)
    # the function the packed weights compute: their exact dequantization
    deq = {n: (np.asarray(dequantize(a)) if isinstance(a, QWeight) else a) for n, a in packed.items()}
    return packed, deq


def _cfg(experts: int, k: int) -> ModelConfig:
    return ModelConfig(arch="qwen2_moe", vocab_size=10, hidden_size=D, intermediate_size=64, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=16, num_experts=experts, experts_per_token=k,
                       moe_intermediate_size=F, norm_topk_prob=False, shared_expert_size=S)


def _run(cfg, h, w):
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(lambda x, w: moe.moe_mlp(cfg, x, w, jax.nn.silu))(h, w))


# tokens chosen for each path: one-row tiles (decode), 16- and 64-row tiles, all experts on every token
# every path once per format: one-row tiles (3 tokens), all experts (8 experts, 40 tokens), 16-row
# (32 experts, 30 tokens) and 64-row tiles (300 tokens)
@pytest.mark.parametrize("fmt,experts,k,tokens", [("q8_0", 8, 2, 3), ("q4k", 8, 2, 40), ("q4k", 32, 4, 30),
                                                  ("q8_0", 32, 4, 300)])
def test_packed_experts_compute_their_dequantized_function(experts, k, tokens, fmt):
    cfg = _cfg(experts, k)
    packed, deq = _layer(experts, fmt, seed=experts + tokens)
    assert packed["experts_gate"].batch_shape == (experts,)
    h = np.random.default_rng(tokens).standard_normal((tokens, D)).astype(np.float32)
    want = _run(cfg, h, deq)
    np.testing.assert_allclose(_run(cfg, h, packed), want, atol=2e-4, rtol=2e-4)
    # the native CPU kernel: every expert stack and the shared expert as CpuQWeights
    if cpu_native.available():
        native = {n: (cpu_native.to_cpu(a) if isinstance(a, QWeight) else a) for n, a in packed.items()}
        assert all(isinstance(native[n], cpu_native.CpuQWeight) for n in EXPERTS + SHARED)
        got = _run(cfg, h, native)
        # the kernel rounds activations to 16 bits (cpu_native.act_bits)
        np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max(), rtol=0.02)


@pytest.mark.parametrize("tokens", [3, 40])
def test_projections_of_mixed_forms(tokens):
    """A layer whose expert projections come in different forms (a GGUF with dense IQ/F16 gate/up and a
    K-quant down; a packed QWeight next to a native one): each projection takes its own path, on the
    tiled (3 tokens) and every-expert (40 tokens, 8 experts) paths."""
    cfg = _cfg(8, 2)
    packed, deq = _layer(8, "q4k", seed=11)
    h = np.random.default_rng(tokens).standard_normal((tokens, D)).astype(np.float32)
    want = _run(cfg, h, deq)
    mixes = [dict(deq, experts_down=packed["experts_down"])]
    if cpu_native.available():
        mixes += [dict(deq, experts_down=cpu_native.to_cpu(packed["experts_down"])),
                  dict(packed, experts_gate=cpu_native.to_cpu(packed["experts_gate"]), experts_up=deq["experts_up"])]
    for w in mixes:
        np.testing.assert_allclose(_run(cfg, h, w), want, atol=0.02 * np.abs(want).max(), rtol=0.02)


def _loop_body_text(hlo: str) -> str:
    """The text of a compiled HLO module's (first) while loop body and of every computation it calls."""
    import re

    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):  # computations start at column 0
        m = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
        if m:
            comps[m.group(1)] = block
    body = re.search(r"body=%?([\w.\-]+)", hlo).group(1)
    seen, todo = set(), [body]
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        todo += re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)", comps[c])
    return "\n".join(comps[c] for c in seen)


def test_no_dequantize_hoisted_out_of_a_loop():
    """Every-expert path (few experts, many pairs) inside a loop like the on-device decode loop: the
    packed stack's dequantize must stay in the loop body (barrier), else XLA keeps every expert
    unpacked for the whole loop. Measured through the compiled program's temporaries."""
    experts, k, tokens = 8, 2, 40
    cfg = _cfg(experts, k)
    packed, deq = _layer(experts, "q4_0", seed=1)
    h = jnp.asarray(np.random.default_rng(0).standard_normal((tokens, D)).astype(np.float32))

    def loop(h, w):
        return jax.lax.fori_loop(0, 3, lambda i, x: x + 0.01 * moe.moe_mlp(cfg, x, w, jax.nn.silu), h)

    out = jax.jit(loop)(h, packed)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(loop)(h, deq)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-3, rtol=1e-3)
    hlo = jax.jit(loop).lower(h, packed).compile().as_text()
    # the loop body reads the expert stacks' packed codes (u8[8, ...]) and unpacks them itself
    body = _loop_body_text(hlo)
    assert "u8[8," in body and "shift-right-logical" in body


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from tiny_tokenizer import add_byte_tokenizer

    return add_byte_tokenizer(make_tiny_model("qwen2_moe", tmp_path_factory.mktemp("qmoe")))


@pytest.mark.parametrize("packed,scan", [(None, True), (True, False)])
def test_isq_moe_through_llm(tiny_moe, packed, scan):
    """ISQ q8_0 of a Qwen2-MoE (experts, shared expert, attention quantized; router dense): packed
    experts on the native CPU kernel (packed None, scanned and unrolled layers) and on the jnp reference
    (packed True) give the prompt logprobs of the same weights dequantized at load (packed False)."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.engine.llm_engine import load_model

    loaded = load_model(str(tiny_moe), isq="q8_0", packed=packed)
    layer = loaded.weights["layers"][0] if isinstance(loaded.weights["layers"], list) else None
    if layer is not None:
        kind = cpu_native.CpuQWeight if packed is None and cpu_native.available() else QWeight
        assert isinstance(layer["experts_down"], kind) and not isinstance(layer["router"], (QWeight,
                                                                                           cpu_native.CpuQWeight))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    prompt = "the experts are quantized"
    kw = dict(max_model_len=64, num_blocks=32, isq="q8_0", max_num_seqs=1,
              prefill_chunk_size=32, token_buckets=(32,), seq_buckets=(1,))
    ref = LLM(str(tiny_moe), packed_weights=False, **kw).generate([prompt], params)[0]
    got = LLM(str(tiny_moe), packed_weights=packed, scan_layers=scan, **kw).generate([prompt], params)[0]
    lp = lambda out: np.array([v for v, _ in out.prompt_logprobs[1:]])
    tol = 5e-3 if packed is None else 1e-4  # the native kernel's 16-bit activations
    np.testing.assert_allclose(lp(got), lp(ref), atol=tol)
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids


def test_isq_moe_quality_and_checkpoint(tiny_moe, tmp_path):
    """q8_0 experts stay close to f32 (mean KL of the prompt's next-token distributions), and a
    pre-quantized checkpoint (tools/convert/quantize.py) loads the same packed experts back."""
    from jaxserve.engine.llm_engine import load_model, open_model
    from jaxserve.loader.checkpoint import write_checkpoint

    src = open_model(str(tiny_moe), packed=False)
    ck = write_checkpoint(tmp_path / "ck", src, "q8_0")
    a = load_model(str(ck), packed=True)
    b = load_model(str(tiny_moe), isq="q8_0", packed=True)
    la, lb = a.weights["layers"][1]["experts_up"], b.weights["layers"][1]["experts_up"]
    assert isinstance(la, QWeight) and la.batch_shape == (a.cfg.num_experts,)
    for n in la.arrays:
        np.testing.assert_array_equal(np.asarray(la.arrays[n]), np.asarray(lb.arrays[n]))

    ids = a.tokenizer.encode("a fixed text for the quality check of quantized experts")
    f32 = load_model(str(tiny_moe), packed=False)
    with jax.default_matmul_precision("highest"):
        p, q = (PagedModel(m.cfg, m.weights).step([(0, ids, 0)], scan=False)[0] for m in (f32, a))
    kl = float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))  # (PagedModel returns log_softmax)
    assert 0 < kl < 0.01, kl


def test_int8_activation_copies_skip_expert_stacks():
    """The int8 kernel's K-major code copy (pallas_dp4a.attach) goes on ordinary packed weights only:
    expert stacks are gathered and dequantized, a copy would be dead weight."""
    from jaxserve.kernels.quant_matmul import pallas_dp4a

    packed, _ = _layer(8, "q4_0", seed=2)
    out = pallas_dp4a.attach({"layers": [packed]})["layers"][0]
    assert pallas_dp4a.COPY in out["shared_up"].arrays
    assert all(pallas_dp4a.COPY not in out[n].arrays for n in EXPERTS)


# ------------------------------------------------- the grouped quantized matmul (Pallas, interpreted)
# one of each layout: one 4-bit plane with an offset, 2+1 planes with signed sub-scales, 4+2 planes,
# 2-bit with nibble factors, 8-bit
@pytest.mark.parametrize("fmt", ["q4_1", "q3k", "q6k", "q2k", "q8_0"])
def test_grouped_qmatmul_matches_the_dequantized_experts(fmt):
    """grouped_qmatmul (quant_matmul/pallas_triton, interpreted on CPU): each group of rows through its
    expert's packed weights = x @ dequantize(expert); groups past live_groups are skipped."""
    from jaxserve.kernels.quant_matmul.pallas_triton import grouped_qmatmul, grouped_supports

    rng = np.random.default_rng(len(fmt))
    E, K, N = 4, 256, 48
    qw = stack([quantize(rng.standard_normal((K, N)).astype(np.float32), fmt) for _ in range(E)])
    W = np.asarray(dequantize(qw))
    for R, G in ((1, 6), (16, 3)):
        assert grouped_supports(qw, R)
        x = rng.standard_normal((G * R, K)).astype(np.float32)
        g = rng.integers(0, E, G).astype(np.int32)
        y = np.asarray(grouped_qmatmul(jnp.asarray(x), qw, jnp.asarray(g), live_groups=jnp.asarray([G - 1])))
        live = (G - 1) * R
        want = np.concatenate([x[i * R:(i + 1) * R] @ W[g[i]] for i in range(G)])[:live]
        # compiled on a GPU, 'dot' tiles multiply f32 x on the tensor cores (TF32-like: measured up to
        # 5e-4 of the largest output); a wrong expert or scale is off by O(1) of it
        tol = 1e-4 if jax.default_backend() == "cpu" else 2e-3
        np.testing.assert_allclose(y[:live], want, atol=tol * np.abs(want).max(), rtol=1e-4)
    assert not grouped_supports(qw, 3) and not grouped_supports(qw[0], 1)


@pytest.mark.parametrize("experts,k,tokens", [(8, 2, 3), (8, 2, 40), (32, 4, 30)])
def test_packed_kernel_path_of_moe_mlp(experts, k, tokens):
    """moe_mlp with the packed kernel (impl='pallas_triton', interpreted): decode one-row tiles,
    16-row sorted tiles, and the few-experts-many-pairs case (16-row tiles instead of every expert)
    compute the XLA path's function."""
    cfg = _cfg(experts, k)
    packed, deq = _layer(experts, "q4k", seed=experts * tokens)
    h = np.random.default_rng(tokens).standard_normal((tokens, D)).astype(np.float32)
    want = _run(cfg, h, deq)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(lambda x, w: moe.moe_mlp(cfg, x, w, jax.nn.silu, impl="pallas_triton"))(h, packed))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


def test_padding_tokens_are_parked_on_real_experts():
    """moe_mlp(valid=...): padding tokens use only experts a real token chose (no extra expert read)
    and the real tokens' outputs do not change."""
    experts, k, tokens = 32, 4, 12
    cfg = _cfg(experts, k)
    _, deq = _layer(experts, "q8_0", seed=5)
    h = np.random.default_rng(3).standard_normal((tokens, D)).astype(np.float32)
    valid = np.arange(tokens) % 3 != 0  # token 0 is padding too: the first real one is token 1
    ids, _ = moe.route(cfg, jnp.asarray(h), deq["router"])
    pid, pw = (np.asarray(a) for a in moe.route(cfg, jnp.asarray(h), deq["router"], jnp.asarray(valid)))
    assert set(pid[~valid].ravel()) <= set(np.asarray(ids)[valid].ravel())
    assert np.all(pw[~valid] == 0) and np.array_equal(pid[valid], np.asarray(ids)[valid])
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(lambda x, w, v: moe.moe_mlp(cfg, x, w, jax.nn.silu, valid=v))(h, deq, valid))
    np.testing.assert_allclose(got[valid], _run(cfg, h, deq)[valid], atol=1e-5, rtol=1e-5)
