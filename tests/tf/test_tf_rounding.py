"""normkit.tf's rounding points survive XLA's excess precision on the JAX backend.

XLA drops a pair of casts (float32 -> half -> float32) on GPUs, so an H200 gave normkit.tf on
Keras' JAX backend gradients 2.7 ulp from the reference where the offset is added in the
weights' dtype. The layers round with ``lax.reduce_precision`` there (`normkit.tf._rounding`),
which XLA keeps. This reads the program handed to XLA (the CPU compiler keeps the casts), in a
process of its own on Keras' JAX backend: no half-precision value made by arithmetic or a cast
goes back to a wider float, except one cast from an already rounded value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="Keras' JAX backend needs JAX")

ROOT = Path(__file__).resolve().parents[2]
CASES = {
    "layer before_scale bias": ("dict(kind='layer', eps=1e-6, cast='before_scale')", "float32"),
    "layer before_scale autograd": (
        "dict(kind='layer', eps=1e-6, cast='before_scale', backward='autograd')", "float32"),
    "rms offset in the param dtype": (
        "dict(kind='rms', eps=1e-6, scale_offset=1.0, offset_dtype='param', cast='after_scale')",
        "bfloat16"),
    "rms residual rounded": ("dict(kind='rms', eps=1e-6, residual='rounded')", "float32"),
    "rms gate after, before_scale, groups": (
        "dict(kind='rms', eps=1e-6, gate='after', cast='before_scale', group_size=4)", "float32"),
}
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
from normkit import NormSpec
from normkit.conformance.targets_keras import build
from tests.helpers.hlo import dropped_roundings
found = {}
for name, (spec, params) in json.loads(sys.argv[1]).items():
    spec = NormSpec(**eval(spec))
    for dtype in ("bfloat16", "float16"):
        fn = build(spec, (4, 8), np.dtype(getattr(ml_dtypes, params, params)),
                   dtype=np.dtype(getattr(ml_dtypes, dtype, dtype)), device="cpu")
        x = jnp.ones((4, 8), dtype)
        weights = {"scale": jnp.ones(8, params)}
        if spec.bias:
            weights["bias"] = jnp.zeros(8, params)
        second = x if spec.residual or spec.gate else None

        def forward_and_backward(x, second, weights, cotangent):
            y, backward = jax.vjp(lambda x, s, w: fn(x, s, **w), x, second, weights)
            return y, backward(cotangent)

        cotangent = (x, x) if spec.residual else x
        hlo = jax.jit(forward_and_backward).lower(x, second, weights, cotangent).as_text(
            dialect="hlo")
        found[f"{name} {dtype}"] = dropped_roundings(hlo) + (
            [] if "reduce-precision" in hlo else ["no reduce-precision"])
print(json.dumps(found))
"""


def test_no_rounding_point_is_a_pair_of_casts_xla_may_drop() -> None:
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == 2 * len(CASES)
    assert {case: lines for case, lines in found.items() if lines} == {}
