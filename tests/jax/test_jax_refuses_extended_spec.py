"""normkit.jax refuses the spec fields it does not compute yet, naming the field."""

import pytest

from normkit import NormSpec

jnp = pytest.importorskip("jax.numpy")
functional = pytest.importorskip("normkit.jax.functional")
linen = pytest.importorskip("normkit.jax.linen")
nnx = pytest.importorskip("normkit.jax.nnx")


@pytest.mark.parametrize(
    "spec, field",
    [
        (NormSpec(residual="float32_normalized"), "residual='float32_normalized'"),
        (NormSpec("layer", variance="fast"), "variance='fast'"),
        (NormSpec(scale_offset=1.0, offset_dtype="param"), "offset_dtype='param'"),
        (NormSpec(output_dtype="promote"), "output_dtype='promote'"),
        (NormSpec(backward="autograd"), "backward='autograd'"),
        (NormSpec("dyt"), "kind='dyt'"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_functional_and_modules_name_the_field(spec, field):
    message = f"normkit.jax does not support NormSpec.{field}"
    with pytest.raises(ValueError, match=message):
        functional.normalize(jnp.ones((2, 4)), spec)
    with pytest.raises(ValueError, match=message):
        linen.from_spec(spec)
    with pytest.raises(ValueError, match=message):
        nnx.from_spec(spec, 4)
