"""Drive the pure model functions through a paged KV cache, the way the runner does (tests only)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import transformer as tf

BS = 4  # small blocks so sequences span many of them
_RUNS: dict = {}


class PagedModel:
    """Drives the pure model functions with a paged cache, the way the runner does (no sampling)."""

    def __init__(self, cfg, weights, num_blocks=64, max_blocks=32, qmm=None, kv_dtype=jnp.float32, **kernels):
        self.cfg, self.weights = cfg, weights
        self.consts = {k: jnp.asarray(v) for k, v in tf.layer_constants(cfg).items()}
        shape = (cfg.num_layers, num_blocks, BS, cfg.num_kv_heads, cfg.head_dim)
        self.kv = (jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype))
        self.free = list(range(1, num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.max_blocks = max_blocks

        key = (cfg, qmm, tuple(sorted(kernels.items())))
        if key not in _RUNS:  # one jitted function per model: same-shaped steps of other weights reuse it
            def run(weights, consts, kv, batch, scan):
                h, kv = tf.forward_hidden(cfg, weights, consts, kv, batch, scan_layers=scan, qmm=qmm, **kernels)
                return jax.nn.log_softmax(tf.logits_from_hidden(cfg, weights, h, qmm=qmm), axis=-1), kv

            _RUNS[key] = jax.jit(run, static_argnums=(4,))
        self._run = _RUNS[key]

    def step(self, chunks: list[tuple[int, list[int], int]], scan=True, extra: dict | None = None):
        """chunks: (seq id, token ids, start position). Returns log_softmax per chunk. extra: more batch
        entries (e.g. multi-LoRA's lora_onehot)."""
        ids, pos, seq_of, slots = [], [], [], []
        seq_ids = [c[0] for c in chunks]
        for i, (sid, toks, start) in enumerate(chunks):
            table = self.tables.setdefault(sid, [])
            for p in range(start, start + len(toks)):
                if p // BS >= len(table):
                    table.append(self.free.pop(0))
                slots.append(table[p // BS] * BS + p % BS)
            ids += toks
            pos += list(range(start, start + len(toks)))
            seq_of += [i] * len(toks)
        tables = np.zeros((len(chunks) + 1, self.max_blocks), np.int32)
        for i, sid in enumerate(seq_ids):
            tables[i, :len(self.tables[sid])] = self.tables[sid]
        batch = {"token_ids": jnp.asarray(ids, jnp.int32), "positions": jnp.asarray(pos, jnp.int32),
                 "token_seq": jnp.asarray(seq_of, jnp.int32), "slots": jnp.asarray(slots, jnp.int32),
                 "block_tables": jnp.asarray(tables), **(extra or {})}
        lp, self.kv = self._run(self.weights, self.consts, self.kv, batch, scan)
        lp = np.asarray(lp)
        out, t = [], 0
        for _, toks, _ in chunks:
            out.append(lp[t:t + len(toks)])
            t += len(toks)
        return out
