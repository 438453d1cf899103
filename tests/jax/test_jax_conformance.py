"""normkit.jax's conformance hook (normkit.conformance.targets_jax) as a hook: its devices and
the inputs it refuses. Its values against the reference, for every API under jit, on every
option and edge, are tests/conformance/test_every_target.py's."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from normkit import NormSpec  # noqa: E402
from normkit.conformance import targets_jax as conformance  # noqa: E402


def _x(shape: tuple[int, ...], dtype: np.dtype, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_devices_lists_cpu() -> None:
    assert conformance.devices()[0] == "cpu"


def test_evaluate_errors() -> None:
    spec = NormSpec()
    x = _x((2, 4), np.float32)
    with pytest.raises(ValueError, match="api='keras' is invalid"):
        conformance.evaluate(spec, x, x, api="keras")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"device 'tpu:7' is not one jax sees: \['cpu'\]"):
        conformance.evaluate(spec, x, x, device="tpu:7")
    with pytest.raises(ValueError, match="dy has shape"):
        conformance.evaluate(spec, x, x[:1])
    with pytest.raises(ValueError, match="bias was given but the spec has bias=False"):
        conformance.evaluate(spec, x, x, bias=np.zeros(4, np.float32))
