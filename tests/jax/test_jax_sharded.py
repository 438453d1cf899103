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


# The extended spec under shard_map: the fast variance gathers each shard's pair sums (its means
# stay correctly rounded), a residual's gradients, and the autograd backward differentiating
# through psum (its rescaling's pmax a constant), on rows with a large mean.
EXTENDED = """
import jax, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from normkit import NormSpec, reference, tolerances
from normkit.jax import functional as F
mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("tp",))
rng = np.random.default_rng(0)
x = (rng.standard_normal((8, 64)) + 3e3).astype(np.float32)
res = rng.standard_normal((8, 64)).astype(np.float32)
dy, dh = rng.standard_normal((2, 8, 64)).astype(np.float32)
w = (1 + 0.3 * rng.standard_normal(64)).astype(np.float32)
cases = [
    NormSpec("layer", variance="fast", bias=False),
    NormSpec("layer", variance="fast", residual="float32", bias=False),
    NormSpec(residual="rounded", backward="autograd"),
    NormSpec("partial_rms", p=0.3, backward="autograd"),
]
for spec in cases:
    def apply(x, r, w, axis_name):
        if spec.residual is None:
            return F.normalize(x, spec, w, axis_name=axis_name)
        return F.add_norm(x, r, spec, w, axis_name=axis_name)
    out = (P(None, "tp"), P(None, "tp")) if spec.residual else P(None, "tp")
    sharded = jax.jit(jax.shard_map(lambda x, r, w: apply(x, r, w, "tp"), mesh=mesh,
                                    in_specs=(P(None, "tp"), P(None, "tp"), P("tp")), out_specs=out))
    got, vjp = jax.vjp(sharded, x, res, w)
    if spec.residual:
        y, h = got
        ry, rh = reference.add_normalize(x, res, spec, w)
        g = reference.add_normalize_vjp(x, res, dy, dh, spec, w)
        dx, dr, dw = vjp((dy, dh))
        pairs = [("y", y, ry), ("dx", dx, g.dx), ("dresidual", dr, g.dresidual)]
    else:
        ry = reference.normalize(x, spec, w)
        g = reference.normalize_vjp(x, dy, spec, w)
        dx, _, dw = vjp(dy)
        pairs = [("y", got, ry), ("dx", dx, g.dx)]
    for name, a, e in pairs:
        tolerances.assert_close(np.asarray(a), e, quantity="forward" if name == "y" else "grad", what=f"{spec} {name}")
    print("PASSED", spec.kind, spec.variance, spec.residual, spec.backward)
print("EXTENDED OK", len(cases))
"""


def test_extended_fields_sharded_match_the_reference() -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", EXTENDED], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "EXTENDED OK 4" in done.stdout, done.stdout
