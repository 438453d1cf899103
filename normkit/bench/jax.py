"""normkit.jax against flax.linen.RMSNorm / LayerNorm, jitted.

``python -m normkit.bench.jax [--quick] [--device D] [--dtype T]`` prints the table;
`normkit.bench.core.run` of this module returns the rows in `normkit.bench`'s schema. Every group
also times a jitted ``jnp.copy`` of the same bytes (the copy floor). Forward+backward is one jitted
function returning ``y`` and the VJP (gradients of ``x`` and the parameters). Parameters are
float32; flax's modules get ``dtype=`` the input's so that they return it, as normkit's do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import normkit.jax as nkjax
from normkit.bench.core import EPS, Group, Sweep, backend_main, plan_groups, time_group
from normkit.bridges import JaxBridge

__all__ = ["measure", "plan", "versions"]

MODE = "jax.jit"
_BRIDGE = JaxBridge()


def _modules(dtype: Any) -> dict[str, nn.Module]:
    return {
        # normkit's spec defaults (output in the input dtype, two-pass variance), as measured
        # before the modules took Flax's defaults.
        "normkit.jax.RMSNorm": nkjax.RMSNorm(epsilon=EPS, output_dtype="input"),
        "flax.linen.RMSNorm": nn.RMSNorm(epsilon=EPS, dtype=dtype),
        "normkit.jax.LayerNorm": nkjax.LayerNorm(
            epsilon=EPS, output_dtype="input", variance="two_pass"
        ),
        "flax.linen.LayerNorm": nn.LayerNorm(epsilon=EPS, dtype=dtype),
    }


def _task(module: nn.Module, x: jax.Array, dy: jax.Array, backward: bool) -> Callable[[], object]:
    params = module.init(jax.random.key(0), x[:1])

    @jax.jit
    def forward(params: Any, x: jax.Array) -> Any:
        return module.apply(params, x)

    @jax.jit
    def forward_backward(params: Any, x: jax.Array, dy: jax.Array) -> Any:
        y, vjp = jax.vjp(module.apply, params, x)
        return y, vjp(dy)

    if backward:
        return lambda: jax.block_until_ready(forward_backward(params, x, dy))
    return lambda: jax.block_until_ready(forward(params, x))


def versions() -> dict[str, str]:
    """The versions this benchmark ran with."""
    return {"jax": jax.__version__, "flax": flax.__version__}


def plan(sweep: Sweep) -> list[Group]:
    """Every device x dtype x shape x pass, jitted."""
    return plan_groups("jax", sweep, devices(), lambda *_: (MODE,))


def devices() -> list[str]:
    """The devices JAX sees (`normkit.backends` names)."""
    return _BRIDGE.devices()


def measure(group: Group, sweep: Sweep) -> list[dict[str, Any]]:
    """Time one group: the four modules, interleaved with a jitted copy of the same bytes."""
    device = _BRIDGE.device(group.device)
    dtype = jnp.dtype(group.dtype)
    rng = np.random.default_rng(0)

    def put(shape: Any) -> jax.Array:
        return jax.device_put(
            jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype), device
        )

    x, dy, buffer = put(group.shape), put(group.shape), put(group.copy_elements)
    candidates = {k: _task(m, x, dy, group.backward) for k, m in _modules(dtype).items()}
    copy = jax.jit(jnp.copy)
    return time_group(
        group, sweep, candidates, ("copy (jnp.copy)", lambda: jax.block_until_ready(copy(buffer)))
    )


if __name__ == "__main__":
    backend_main(sys.modules[__name__])
