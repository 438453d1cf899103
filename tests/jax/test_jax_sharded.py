"""axis_name: sharded (shard_map over 4 CPU devices) equals unsharded, forward and gradients.

The device count is fixed when JAX starts, so the checks run in a subprocess
(tests/helpers/jax_sharded_checks.py) with XLA_FLAGS=--xla_force_host_platform_device_count=4.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("jax")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "jax_sharded_checks.py"


def test_sharded_equals_unsharded_on_four_cpu_devices() -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    passed = re.findall(r"^PASSED ", done.stdout, flags=re.MULTILINE)
    summary = re.search(r"^ALL (\d+) CHECKS PASSED$", done.stdout, flags=re.MULTILINE)
    assert summary is not None, done.stdout
    assert int(summary.group(1)) == len(passed) == 25, done.stdout


# The closed-form backward of degenerate rows must follow the GLOBAL row size: a LayerNorm row of
# 2 split over 2 shards is degenerate (its d - mean(d) is psum-reduced), rows of 4 split into
# shards of 1 are not, and a row of 1 on a 1-device mesh is. Reuses jax_sharded_checks.check.
DEGENERATE = """
import jax, numpy as np
from jax.sharding import Mesh
from normkit import NormSpec
import tests.helpers.jax_sharded_checks as c
cpus = jax.devices("cpu")
cases = [
    (NormSpec(kind="layer", eps_placement=pl, scale_offset=off), (6, 2), 2)
    for pl in ("inside", "outside") for off in (0.0, 1.0)
] + [
    (NormSpec(kind="rms"), (6, 4), 4),
    (NormSpec(kind="partial_rms", p=0.25, eps_placement="outside"), (6, 4), 4),
    (NormSpec(kind="layer"), (6, 4), 4),
    (NormSpec(kind="rms", eps_placement="outside", scale_offset=1.0), (6, 1), 1),
    (NormSpec(kind="partial_rms", p=0.5), (6, 1), 1),
]
for spec, shape, devices in cases:
    mesh = Mesh(np.array(cpus[:devices]), ("tp",))
    for api in ("functional", "linen", "nnx"):
        c.check(spec, shape, 1, mesh, api)
print("DEGENERATE OK", len(cases))
"""


def test_degenerate_rows_follow_the_global_row_size() -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    code = DEGENERATE
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DEGENERATE OK 9" in done.stdout, done.stdout
