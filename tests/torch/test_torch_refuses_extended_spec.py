"""normkit.torch refuses the spec fields it does not compute yet, naming the field."""

import pytest

from normkit import NormSpec

torch = pytest.importorskip("torch")
functional = pytest.importorskip("normkit.torch.functional")
modules = pytest.importorskip("normkit.torch.modules")

EXTENDED = [
    (NormSpec(residual="rounded"), "residual='rounded'"),
    (NormSpec("layer", variance="fast"), "variance='fast'"),
    (NormSpec(scale_offset=1.0, offset_dtype="param"), "offset_dtype='param'"),
    (NormSpec(output_dtype="promote"), "output_dtype='promote'"),
    (NormSpec(backward="autograd"), "backward='autograd'"),
    (NormSpec("dyt"), "kind='dyt'"),
]


@pytest.mark.parametrize("spec, field", EXTENDED, ids=lambda v: str(v)[:40])
def test_functional_and_modules_name_the_field(spec, field):
    x = torch.ones(2, 4)
    with pytest.raises(
        ValueError, match=f"normkit.torch does not support NormSpec.{field}"
    ):
        functional.normalize(x, spec)
    with pytest.raises(
        ValueError, match=f"normkit.torch does not support NormSpec.{field}"
    ):
        modules.from_spec(spec, 4)
