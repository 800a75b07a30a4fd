"""Benchmark helpers: the model presets (jaxserve/models/presets.py) and result output."""

from jaxserve.models.presets import (  # noqa: F401  (re-exported for the bench scripts)
    CONFIGS,
    kv_bytes_per_token,
    model_config,
)


def append_json_rows(path: str | None, rows: list[dict]) -> None:
    """--json PATH of every benchmark: one JSON object per line, appended."""
    if not path:
        return
    import json

    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def median_call_seconds(f, args, reps: int) -> float:
    """Median wall time of f(*args) over reps calls, after a compile call and a warm-up call."""
    import statistics
    import time

    import jax

    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
