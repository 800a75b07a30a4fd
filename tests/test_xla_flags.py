"""jaxserve's default XLA flags (jaxserve/xla_flags.py): added once, never over a user's own setting."""

import os
import subprocess
import sys

from jaxserve import xla_flags


def test_defaults_are_added_unless_the_user_set_the_flag():
    cb = "--xla_gpu_enable_command_buffer"
    assert xla_flags.with_defaults("") == " ".join(xla_flags.DEFAULTS)
    mine = f"--xla_dump_to=/tmp/x {cb}=FUSION"
    assert xla_flags.with_defaults(mine) == mine  # the user's value wins
    once = xla_flags.with_defaults("--xla_dump_to=/tmp/x")
    assert once.startswith("--xla_dump_to=/tmp/x ") and once.count(cb) == 1
    assert xla_flags.with_defaults(once) == once  # idempotent
    env = {"XLA_FLAGS": "", "JAXSERVE_XLA_DEFAULTS": "0"}
    xla_flags.apply(env)
    assert env["XLA_FLAGS"] == ""


def test_import_sets_them_and_jax_runs():
    """Importing jaxserve before JAX's backend starts puts the flags in XLA_FLAGS, and XLA accepts them."""
    code = ("import os, jaxserve, jax.numpy as jnp; "
            "print(os.environ['XLA_FLAGS']); print(float(jnp.arange(4.0).sum()))")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXSERVE_XLA_DEFAULTS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    flags, total = out.stdout.split("\n")[:2]
    assert flags.split() == list(xla_flags.DEFAULTS) and total == "6.0"


def test_not_applied_once_the_backend_runs(monkeypatch):
    """After JAX's backend started, XLA would not read new flags: XLA_FLAGS is left as it is."""
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()  # the backend runs in this process
    assert xla_flags._backend_started()
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    xla_flags.apply(env)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
