"""Benchmark helpers: the model presets (jaxserve/models/presets.py) and result output."""

from jaxserve.models.presets import (  # noqa: F401  (re-exported for the bench scripts)
    CONFIGS,
    kv_bytes_per_token,
    model_config,
    weight_bytes_per_token,
)


def append_json_rows(path: str | None, rows: list[dict]) -> None:
    """--json PATH of every benchmark: one JSON object per line, appended."""
    if not path:
        return
    import json

    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
