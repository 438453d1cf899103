"""normkit.torch's conformance hook (normkit.conformance.targets_torch) as a hook: its devices,
the variants and inputs it refuses, and the case it skips. Its values against the reference, on
every option and edge, are tests/conformance/test_every_target.py's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from normkit import NormSpec  # noqa: E402
from normkit.conformance import targets_torch as conformance  # noqa: E402


def _x(shape: tuple[int, ...], dtype: np.dtype, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_devices_lists_cpu_first() -> None:
    assert conformance.devices()[0] == "cpu"


def test_evaluate_errors() -> None:
    spec = NormSpec()
    x = _x((2, 4), np.float32)
    # a variant the hook does not declare is refused, naming those it does
    with pytest.raises(
        ValueError, match=r"unknown variant options \['jit'\]; allowed: \['api', 'compiled', 'kernel'\]"
    ):
        conformance.evaluate(spec, x, x, jit=True)
    with pytest.raises(ValueError, match="kernel='numba' is invalid: expected one of"):
        conformance.evaluate(spec, x, x, kernel="numba")
    with pytest.raises(ValueError, match="api='eager' is invalid: expected one of"):
        conformance.evaluate(spec, x, x, api="eager")
    with pytest.raises(ValueError, match="api='module' is invalid for axis \\(0,\\)"):
        conformance.evaluate(NormSpec(axis=0), x, x, api="module")
    with pytest.raises(ValueError, match="bias was given but the spec has bias=False"):
        conformance.evaluate(spec, x, x, bias=np.zeros(4, np.float32))


def test_the_cpu_kernel_target_skips_a_gpu_case() -> None:
    """On a GPU machine torch[cpu-kernel] meets cuda:0 cases: a SKIP naming why, not a FAIL."""
    x = np.ones((2, 8), np.float32)
    with pytest.raises(NotImplementedError, match="kernel='cpu' runs on CPU tensors, not on cuda:0"):
        conformance.evaluate(NormSpec("rms"), x, x, device="gpu:0", kernel="cpu")
