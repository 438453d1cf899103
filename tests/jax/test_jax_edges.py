"""normkit.jax's own at the edges: the eps its functions refuse for a dtype, and the sizes its
nnx modules refuse.

The values at the edges (overflowing statistics, large means, large cotangents, k = 1, NaN and
infinity) are cases of tests/conformance/test_every_target.py, on every target."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from normkit.jax import functional as F
from normkit.jax import nnx


@pytest.mark.parametrize("eps, dtype", [(1e-46, "float32"), (1e-39, "bfloat16"), (1e39, "float32")])
def test_eps_out_of_range_for_the_dtype_is_refused(eps: float, dtype: str) -> None:
    with pytest.raises(ValueError, match=f"out of range for a {dtype} input"):
        F.rms_norm(jnp.zeros((2, 4), dtype), eps=eps, eps_placement="outside")


@pytest.mark.parametrize("shape", [True, (4, False)], ids=["bool", "tuple-with-bool"])
def test_nnx_refuses_a_bool_size(shape: object) -> None:
    with pytest.raises(ValueError, match=r"must give one positive size .*\(ints, not bools\)"):
        nnx.RMSNorm(shape, axis=-1 if shape is True else (-2, -1))  # type: ignore[arg-type]
