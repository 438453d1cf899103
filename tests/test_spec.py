"""NormSpec: defaults, validation (every invalid field named in the error), helpers."""

import dataclasses
import math

import numpy as np
import pytest

from normkit import NormSpec


def test_defaults_are_documented_values():
    spec = NormSpec()
    assert (spec.kind, spec.eps, spec.eps_placement, spec.p, spec.axis) == ("rms", 1e-6, "inside", None, (-1,))
    assert (spec.scale, spec.scale_offset, spec.bias, spec.cast) == (True, 0.0, False, "after_scale")
    assert NormSpec("layer").bias is True
    assert NormSpec("partial_rms", p=0.5).bias is False
    assert NormSpec("layer", bias=False).bias is False


def test_frozen_and_hashable():
    a, b = NormSpec("layer", axis=[-2, -1]), NormSpec("layer", axis=(-2, -1))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.eps = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, field, detail",
    [
        ({"kind": "batch"}, "kind", "one of"),
        ({"eps": 0.0}, "eps", "positive"),
        ({"eps": -1e-6}, "eps", "positive"),
        ({"eps": float("nan")}, "eps", "positive"),
        ({"eps": float("inf")}, "eps", "positive"),
        ({"eps": "1e-6"}, "eps", "float"),
        ({"eps_placement": "after"}, "eps_placement", "one of"),
        ({"kind": "partial_rms"}, "p", "needs a fraction"),
        ({"kind": "partial_rms", "p": 0.0}, "p", "0 < p <= 1"),
        ({"kind": "partial_rms", "p": 1.5}, "p", "0 < p <= 1"),
        ({"kind": "partial_rms", "p": -0.1}, "p", "0 < p <= 1"),
        ({"kind": "partial_rms", "p": float("nan")}, "p", "0 < p <= 1"),
        ({"kind": "rms", "p": 0.5}, "p", "only to kind='partial_rms'"),
        ({"kind": "layer", "p": 0.5}, "p", "only to kind='partial_rms'"),
        ({"axis": ()}, "axis", "at least one axis"),
        ({"axis": (-1, -1)}, "axis", "distinct"),
        ({"axis": (0, 1.5)}, "axis", "ints"),
        ({"axis": "x"}, "axis", "int or a non-empty tuple"),
        ({"axis": True}, "axis", "int or a non-empty tuple"),
        ({"scale": 1}, "scale", "True or False"),
        ({"scale": False, "scale_offset": 1.0}, "scale_offset", "needs scale=True"),
        ({"scale_offset": float("nan")}, "scale_offset", "finite"),
        ({"bias": "yes"}, "bias", "True, False or None"),
        ({"cast": "before"}, "cast", "one of"),
    ],
)
def test_invalid_spec_names_field_and_value(kwargs, field, detail):
    with pytest.raises(ValueError) as info:
        NormSpec(**kwargs)
    message = str(info.value)
    assert f"NormSpec.{field}={kwargs.get(field)!r}" in message
    assert detail in message


def test_resolve_axes():
    assert NormSpec(axis=(-1, 1)).resolve_axes(4) == (1, 3)
    assert NormSpec(axis=np.int64(-2)).resolve_axes(3) == (1,)
    with pytest.raises(ValueError, match=r"axis 3 is out of range for an input of rank 3"):
        NormSpec(axis=3).resolve_axes(3)
    with pytest.raises(ValueError, match=r"names the same axis twice for an input of rank 3"):
        NormSpec(axis=(2, -1)).resolve_axes(3)


def test_param_shape_follows_increasing_axis_order():
    assert NormSpec(axis=(-1, 1)).param_shape((2, 3, 4, 5)) == (3, 5)
    assert NormSpec().param_shape((7,)) == (7,)


@pytest.mark.parametrize("n, p, k", [(100, 0.0625, 6), (16, 0.0625, 1), (10, 0.05, 1), (1, 0.5, 1), (8, 1.0, 8)])
def test_stat_size_is_floor_of_n_times_p_at_least_one(n, p, k):
    assert NormSpec("partial_rms", p=p).stat_size(n) == k


def test_stat_size_uses_float64_product_like_the_original_code():
    # 100 * 0.29 is 28.999999999999996 in float64; the authors' int(d * p) gives 28.
    assert NormSpec("partial_rms", p=0.29).stat_size(100) == int(100 * 0.29) == 28
    assert NormSpec("rms").stat_size(37) == 37
    with pytest.raises(ValueError, match="at least one element"):
        NormSpec().stat_size(0)


def test_scale_init_gives_effective_scale_one():
    for offset in (0.0, 1.0, 0.25):
        spec = NormSpec(scale_offset=offset)
        assert math.isclose(spec.scale_init + spec.scale_offset, 1.0)


def test_dict_round_trip_and_unknown_keys():
    spec = NormSpec("partial_rms", eps=1e-8, eps_placement="outside", p=0.25, axis=(-2, -1), scale_offset=1.0, bias=True, cast="before_scale")
    assert NormSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match=r"unknown NormSpec fields \['epsilon'\]"):
        NormSpec.from_dict({"epsilon": 1e-6})


def test_replace_revalidates():
    with pytest.raises(ValueError, match="NormSpec.p="):
        NormSpec("partial_rms", p=0.5).replace(kind="rms")
    assert NormSpec().replace(kind="layer", bias=None).bias is True
