"""One group timed on JAX, for `normkit.bench.jax` and `normkit.bench.tf` on Keras' JAX backend.

The inputs and the copy floor's buffer are drawn on the group's device (no host copy of 32M
values) and the candidates built and timed there, so that their computations run on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from normkit.bench.core import Group, Sweep, time_group

__all__ = ["time_on_jax"]

Tasks = Callable[[jax.Array, jax.Array], Mapping[str, Callable[[], object]]]
"""The candidates of a group, given its ``x`` and ``dy``."""


def time_on_jax(group: Group, sweep: Sweep, device: Any, tasks: Tasks) -> list[dict[str, Any]]:
    """`time_group` of ``tasks(x, dy)`` on ``device``, ``x`` and ``dy`` standard normal of the
    group's shape and dtype, beside a jitted ``jnp.copy`` of the group's copy elements; each
    call waited on with ``jax.block_until_ready``."""
    with jax.default_device(device):
        keys = jax.random.split(jax.random.key(0), 3)
        x, dy = (jax.random.normal(k, group.shape).astype(group.dtype) for k in keys[:2])
        buffer = jax.random.normal(keys[2], (group.copy_elements,)).astype(group.dtype)
        candidates = tasks(x, dy)
        copy = jax.jit(jnp.copy)
        return time_group(
            group, sweep, candidates, ("copy (jnp.copy)", lambda: copy(buffer)),
            wait=jax.block_until_ready,
        )
