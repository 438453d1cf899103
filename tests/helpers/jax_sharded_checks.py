"""Sharded (shard_map over 4 CPU devices, axis_name) equals unsharded, forward and gradients.

Run by tests/test_jax_sharded.py in a subprocess, because the device count must be fixed before
JAX starts: ``XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/helpers/jax_sharded_checks.py``.
Prints ``PASSED <case>`` per case and ``ALL <n> CHECKS PASSED`` at the end; any failure raises.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import normkit.jax as nkjax  # noqa: E402
from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.jax import functional  # noqa: E402

CASES = [
    # (spec, x shape, sharded axis of x)
    (NormSpec(kind="rms"), (8, 64), 1),
    (NormSpec(kind="rms", eps_placement="outside", scale_offset=1.0, bias=True), (8, 64), 1),
    (NormSpec(kind="layer"), (8, 64), 1),
    (NormSpec(kind="layer", eps_placement="outside", eps=1e-3), (8, 64), 1),
    (NormSpec(kind="partial_rms", p=0.3), (8, 64), 1),
    (NormSpec(kind="partial_rms", p=0.8, bias=True), (8, 64), 1),
    (NormSpec(kind="layer", axis=(-2, -1)), (4, 8, 16), 1),
    (NormSpec(kind="rms", axis=(-2, -1)), (4, 8, 16), 1),
]


def _spec_of(x_ndim: int, axis: int) -> P:
    return P(*[("tp" if a == axis else None) for a in range(x_ndim)])


def check(spec: NormSpec, shape: tuple[int, ...], sharded: int, mesh: Mesh, api: str) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) + 0.5).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    pshape = spec.param_shape(shape)
    w = (1 - spec.scale_offset + 0.5 * rng.standard_normal(pshape)).astype(np.float32)
    b = rng.standard_normal(pshape).astype(np.float32) if spec.bias else None
    axes = spec.resolve_axes(len(shape))
    x_spec = _spec_of(len(shape), sharded)
    p_spec = P(*[x_spec[a] for a in axes])

    def apply(x, w, b, axis_name):
        if api == "functional":
            return functional.normalize(x, spec, w, b, axis_name=axis_name)
        params = {"scale": w} if b is None else {"scale": w, "bias": b}
        if api == "linen":
            return nkjax.from_spec(spec, axis_name=axis_name).apply({"params": params}, x)
        module = nkjax.nnx.from_spec(spec, w.shape, axis_name=axis_name)
        state = nnx.State({name: nnx.Param(value) for name, value in params.items()})
        return nnx.merge(nnx.graphdef(module), state)(x)

    plain = jax.jit(lambda x, w, b: apply(x, w, b, None))
    sharded_fn = jax.jit(
        jax.shard_map(
            lambda x, w, b: apply(x, w, b, "tp"),
            mesh=mesh,
            in_specs=(x_spec, p_spec, None if b is None else p_spec),
            out_specs=x_spec,
        )
    )
    y, vjp = jax.vjp(plain, x, w, b)
    ys, vjps = jax.vjp(sharded_fn, x, w, b)
    tolerances.assert_close(ys, y, what="sharded y vs unsharded")
    tolerances.assert_close(ys, reference.normalize(x, spec, w, b), what="sharded y vs reference")
    ref_grads = reference.normalize_vjp(x, dy, spec, w, b)
    for name, g, gs, r in zip(("dx", "dscale", "dbias"), vjp(dy), vjps(dy), ref_grads):
        if r is None:
            assert g is None and gs is None, name
            continue
        tolerances.assert_close(gs, g, quantity="grad", what=f"sharded {name} vs unsharded")
        tolerances.assert_close(gs, r, quantity="grad", what=f"sharded {name} vs reference")


def _check_axis_name_matters(mesh: Mesh) -> None:
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    local = jax.shard_map(
        lambda x: functional.normalize(x, NormSpec(), None), mesh=mesh,
        in_specs=P(None, "tp"), out_specs=P(None, "tp"),
    )
    m = tolerances.measure(local(x), reference.normalize(x, NormSpec()))
    assert not m.passed, m.describe()


def main() -> int:
    devices = jax.devices("cpu")
    assert len(devices) == 4, f"expected 4 CPU devices, JAX sees {len(devices)}"
    mesh = Mesh(np.array(devices), ("tp",))
    count = 0
    for spec, shape, sharded in CASES:
        for api in ("functional", "linen", "nnx"):
            check(spec, shape, sharded, mesh, api)
            count += 1
            print(f"PASSED {api} {spec.kind} {spec.eps_placement} axis={spec.axis} shape={shape}")
    _check_axis_name_matters(mesh)
    count += 1
    print("PASSED without axis_name the per-shard statistics differ (the checks can fail)")
    print(f"ALL {count} CHECKS PASSED")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
