"""normkit.tf refuses the spec fields it does not compute yet, naming the field."""

import pytest

from normkit import NormSpec

layers = pytest.importorskip("normkit.tf.layers")


@pytest.mark.parametrize(
    "spec, field",
    [
        (NormSpec(residual="float32"), "residual='float32'"),
        (NormSpec("layer", variance="fast"), "variance='fast'"),
        (NormSpec(scale_offset=1.0, offset_dtype="param"), "offset_dtype='param'"),
        (NormSpec(output_dtype="promote"), "output_dtype='promote'"),
        (NormSpec(backward="autograd"), "backward='autograd'"),
        (NormSpec("dyt"), "kind='dyt'"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_from_spec_names_the_field(spec, field):
    with pytest.raises(
        ValueError, match=f"normkit.tf does not support NormSpec.{field}"
    ):
        layers.from_spec(spec)
