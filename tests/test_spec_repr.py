"""NormSpec's repr: the kind and the fields that differ from that kind's defaults, evaluable."""

import itertools

import pytest

from normkit import NormSpec  # noqa: F401 - eval(repr(spec)) reads it
from normkit.spec import NormSpec as Spec


@pytest.mark.parametrize(
    "spec, text",
    [
        (Spec(), "NormSpec('rms')"),
        (Spec("rms", eps=1e-5, cast="before_scale"), "NormSpec('rms', eps=1e-05, cast='before_scale')"),
        (Spec("layer"), "NormSpec('layer')"),
        (Spec("layer", bias=False, axis=(-2, -1)), "NormSpec('layer', axis=(-2, -1), bias=False)"),
        (Spec("partial_rms", p=0.0625, eps=1e-8, eps_placement="outside"),
         "NormSpec('partial_rms', p=0.0625, eps=1e-08, eps_placement='outside')"),
        (Spec("dyt", alpha_init=1.0, bias=False), "NormSpec('dyt', bias=False, alpha_init=1.0)"),
        (Spec(gate="after"), "NormSpec('rms', gate='after')"),
        (Spec(gate="before", gate_activation="sigmoid", group_size=4),
         "NormSpec('rms', gate='before', gate_activation='sigmoid', group_size=4)"),
        (Spec(scale_offset=1.0, offset_dtype="param"),
         "NormSpec('rms', scale_offset=1.0, offset_dtype='param')"),
    ],
)
def test_the_repr_names_what_differs_from_the_defaults(spec, text):
    assert repr(spec) == str(spec) == text
    assert eval(repr(spec)) == spec


def test_every_single_field_change_round_trips_through_its_repr():
    values = {
        "eps": (1e-5,), "eps_placement": ("outside",), "axis": ((-2, -1), 0), "scale": (False,),
        "scale_offset": (1.0,), "bias": (True, False), "cast": ("before_scale",),
        "residual": ("rounded", "float32"), "variance": ("fast",), "output_dtype": ("promote",),
        "backward": ("autograd",), "gate": ("after",), "group_size": (2,),
    }
    for kind, (name, options) in itertools.product(("rms", "layer"), values.items()):
        for value in options:
            try:
                spec = Spec(kind, **{name: value})
            except ValueError:
                continue
            assert eval(repr(spec)) == spec, repr(spec)
