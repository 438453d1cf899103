"""normkit.jax (linen and nnx) against flax.linen.RMSNorm / LayerNorm, jitted.

``python -m normkit.bench.jax [--quick] [--device D] [--dtype T]`` prints the table;
`normkit.bench.core.run` of this module returns the rows in `normkit.bench`'s schema. Every group
also times a jitted ``jnp.copy`` of the same bytes (the copy floor). Forward+backward is one jitted
function returning ``y`` and the VJP (gradients of ``x`` and the parameters). A call dispatches
its computation and returns (JAX's asynchronous dispatch); the bench waits on the result with
``jax.block_until_ready``: after each call (latency) or after the last of a throughput sample,
whose computations JAX runs on the device in the order they were dispatched. Parameters are
float32; flax's modules get ``dtype=`` the input's so that they return it, as normkit's do. An
nnx module runs as its graph and state (``nnx.split``), merged inside the jitted function.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import normkit.jax as nkjax
from normkit.bench.core import EPS, Group, Sweep, backend_main, plan_groups
from normkit.bench.jax_timing import time_on_jax
from normkit.bridges import JaxBridge

__all__ = ["measure", "plan", "versions"]

MODE = "jax.jit"
_BRIDGE = JaxBridge()


Apply = Callable[[Any, jax.Array], Any]


def _linen(module: nn.Module, x: jax.Array) -> tuple[Apply, Any]:
    return module.apply, module.init(jax.random.key(0), x[:1])


def _nnx(module: nnx.Module) -> tuple[Apply, Any]:
    graph, state = nnx.split(module)
    return lambda state, x: nnx.merge(graph, state)(x), state


def _layers(dtype: Any, x: jax.Array) -> dict[str, tuple[Apply, Any]]:
    """Each implementation's ``(apply, params)``: ``apply(params, x) -> y``."""
    n, rngs = x.shape[-1], nnx.Rngs(0)
    return {
        # normkit's spec defaults (output in the input dtype, two-pass variance), as measured
        # before the modules took Flax's defaults.
        "normkit.jax.RMSNorm": _linen(nkjax.RMSNorm(epsilon=EPS, output_dtype="input"), x),
        "normkit.jax.nnx.RMSNorm": _nnx(
            nkjax.nnx.RMSNorm(n, epsilon=EPS, output_dtype="input", rngs=rngs)
        ),
        "flax.linen.RMSNorm": _linen(nn.RMSNorm(epsilon=EPS, dtype=dtype), x),
        "normkit.jax.LayerNorm": _linen(
            nkjax.LayerNorm(epsilon=EPS, output_dtype="input", variance="two_pass"), x
        ),
        "normkit.jax.nnx.LayerNorm": _nnx(
            nkjax.nnx.LayerNorm(
                n, epsilon=EPS, output_dtype="input", variance="two_pass", rngs=rngs
            )
        ),
        "flax.linen.LayerNorm": _linen(nn.LayerNorm(epsilon=EPS, dtype=dtype), x),
    }


def _task(
    apply: Apply, params: Any, x: jax.Array, dy: jax.Array, backward: bool
) -> Callable[[], object]:
    @jax.jit
    def forward(params: Any, x: jax.Array) -> Any:
        return apply(params, x)

    @jax.jit
    def forward_backward(params: Any, x: jax.Array, dy: jax.Array) -> Any:
        y, vjp = jax.vjp(apply, params, x)
        return y, vjp(dy)

    if backward:
        return lambda: forward_backward(params, x, dy)
    return lambda: forward(params, x)


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
    """Time one group: the six modules, interleaved with a jitted copy of the same bytes."""
    dtype = jnp.dtype(group.dtype)

    def tasks(x: jax.Array, dy: jax.Array) -> dict[str, Callable[[], object]]:
        return {
            k: _task(apply, params, x, dy, group.backward)
            for k, (apply, params) in _layers(dtype, x).items()
        }

    return time_on_jax(group, sweep, _BRIDGE.device(group.device), tasks)


if __name__ == "__main__":
    backend_main(sys.modules[__name__])
