"""Every implementation of normkit.torch on rows that span several axes or axes that are not the
trailing ones: the parameters and the parameters a norm without them reads must have the row's
``n`` elements, not the last axis' (the CPU kernel once read a bias of x.shape[-1] elements as
one of n: garbage past them)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.bridges import TorchBridge  # noqa: E402
from normkit.torch.functional import normalize  # noqa: E402

to_numpy = TorchBridge().to_numpy

SHAPE = (3, 4, 64)
SPECS = [
    NormSpec("rms", eps=1e-6, cast=cast, axis=axis, bias=bias)
    for cast in ("after_scale", "before_scale")
    for axis in ((-2, -1), (1,))
    for bias in (False, True)
] + [NormSpec("partial_rms", p=0.25, axis=(-2, -1)), NormSpec("layer", axis=(-2, -1))]
TWO_D = (5, 48)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("kernel", ["cpu", "composite"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_rows_over_several_or_moved_axes_match_the_reference(spec, dtype, kernel):
    rng = np.random.default_rng(0)
    axes = spec.resolve_axes(len(SHAPE))
    param_shape = tuple(SHAPE[a] for a in axes)
    x = torch.tensor(rng.standard_normal(SHAPE), dtype=torch.float32).to(DTYPES[dtype])
    weight = torch.tensor(rng.standard_normal(param_shape), dtype=torch.float32)
    bias = torch.tensor(rng.standard_normal(param_shape), dtype=torch.float32) if spec.bias else None
    y = normalize(x, spec, weight, bias, kernel=kernel)
    want = reference.normalize(
        to_numpy(x), spec, weight.numpy(), None if bias is None else bias.numpy()
    )
    tolerances.assert_close(to_numpy(y), want, cast=spec.cast)


@pytest.mark.parametrize("kernel", ["cpu", "composite"])
@pytest.mark.parametrize("spec", [NormSpec("rms", axis=(0, 1), scale=False),
                                  NormSpec("layer", axis=(0, 1))], ids=repr)
def test_a_two_dimensional_x_normalized_over_both_axes_is_one_row(spec, kernel):
    x = torch.tensor(np.random.default_rng(1).standard_normal(TWO_D), dtype=torch.float32)
    y = normalize(x, spec, kernel=kernel)
    tolerances.assert_close(to_numpy(y), reference.normalize(to_numpy(x), spec))
