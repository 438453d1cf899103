"""NormSpec validation at the edges: huge integers, numpy scalars, eps against the dtype."""

from __future__ import annotations

import json
import re

import ml_dtypes
import numpy as np
import pytest

from normkit import NormSpec, reference
from normkit.spec import EPS_RANGE


@pytest.mark.parametrize("field, value", [("eps", 10**400), ("scale_offset", -(10**400))])
def test_integer_beyond_float_range_is_a_value_error(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"NormSpec.{field}=.* is invalid: .*beyond the float"):
        NormSpec(**{field: value})


def test_json_integer_beyond_float_range_is_a_value_error() -> None:
    data = json.loads('{"kind": "rms", "eps": 1' + "0" * 400 + "}")
    with pytest.raises(ValueError, match=r"NormSpec.eps=1000.* is invalid: .*beyond the float"):
        NormSpec.from_dict(data)


def test_partial_fraction_beyond_float_range_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"NormSpec.p=.* is invalid: .*beyond the float"):
        NormSpec("partial_rms", p=10**400)


@pytest.mark.parametrize("scalar", [np.float32, np.float64, np.float16])
def test_numpy_scalars_are_accepted(scalar: type) -> None:
    spec = NormSpec("partial_rms", eps=scalar(1e-3), p=scalar(0.25), scale_offset=scalar(1.0))
    assert spec.eps == float(scalar(1e-3)) and type(spec.eps) is float
    assert spec.p == 0.25 and type(spec.p) is float
    assert spec.scale_offset == 1.0 and type(spec.scale_offset) is float
    assert NormSpec(eps=np.int64(1)).eps == 1.0


@pytest.mark.parametrize("value", [np.bool_(True), True, "1e-6", complex(1e-6, 0)])
def test_non_real_eps_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"NormSpec.eps=.* is invalid: expected a positive"):
        NormSpec(eps=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "eps, dtype, compute",
    [
        (1e-46, "float32", "float32"),  # rounds to 0 in float32
        (1e-39, "float32", "float32"),  # subnormal: 1 / eps overflows float32
        (1e-39, "bfloat16", "float32"),
        (1e-39, "float16", "float32"),
        (1e39, "float32", "float32"),  # not a float32
        (1e-320, "float64", "float64"),  # subnormal: 1 / eps overflows float64
    ],
)
def test_eps_out_of_the_compute_dtypes_range_is_refused(
    eps: float, dtype: str, compute: str
) -> None:
    spec = NormSpec(eps=eps, eps_placement="outside")
    pattern = re.escape(
        f"NormSpec.eps={eps!r} is out of range for a {dtype} input, which is computed in {compute}"
    )
    with pytest.raises(ValueError, match=pattern):
        spec.check_eps(dtype)
    x = np.zeros((2, 4), dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    with pytest.raises(ValueError, match=pattern):
        reference.normalize(x, spec)
    with pytest.raises(ValueError, match=pattern):
        reference.normalize_vjp(x, x, spec)


@pytest.mark.parametrize("compute", ["float32", "float64"])
@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_eps_at_the_ends_of_the_range_gives_finite_outputs(compute: str, placement: str) -> None:
    """The extreme eps on an all-zero row and a tiny row: finite outputs."""
    low, high = EPS_RANGE[compute]
    for eps in (low, high):
        spec = NormSpec(eps=eps, eps_placement=placement)
        spec.check_eps(compute)
        x = np.zeros((2, 5), compute)
        x[1] = np.finfo(compute).tiny * np.arange(1, 6)
        assert np.all(np.isfinite(reference.normalize(x, spec)))
        if compute == "float32":  # the float64 reference gradient is finite for these eps
            assert np.all(np.isfinite(reference.normalize_vjp(x, np.ones_like(x), spec)[0]))
