"""normkit.torch modules and functions: defaults, parameters, state_dict compatibility, dtypes, errors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import normkit.torch as nt  # noqa: E402
from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.bridges import TorchBridge  # noqa: E402
from normkit.torch import functional as F  # noqa: E402

to_numpy = TorchBridge().to_numpy


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_defaults_are_torchs() -> None:
    """torch's defaults (eps=None: float32's machine eps; LayerNorm 1e-5); partial RMS, which
    torch lacks, keeps the spec's."""
    assert nt.RMSNorm(8).spec == NormSpec(axis=-1, eps=torch.finfo(torch.float32).eps)
    assert nt.PartialRMSNorm(8, 0.25).spec == NormSpec(kind="partial_rms", p=0.25)
    assert nt.LayerNorm((2, 8)).spec == NormSpec(kind="layer", eps=1e-5, axis=(-2, -1))
    assert nt.LayerNorm(8).spec.bias is True and nt.RMSNorm(8).spec.bias is False


def test_spec_fields_reach_the_module() -> None:
    m = nt.RMSNorm(8, 1e-5, eps_placement="outside", scale_offset=1.0, bias=True, cast="before_scale")
    assert m.spec == NormSpec(eps=1e-5, eps_placement="outside", scale_offset=1.0, bias=True, cast="before_scale")
    assert "eps_placement='outside'" in repr(m) and "scale_offset=1" in repr(m)


@pytest.mark.parametrize(
    "spec",
    [
        NormSpec(),
        NormSpec(kind="partial_rms", p=0.0625, scale_offset=1.0),
        NormSpec(kind="layer", axis=(-2, -1), scale=False),
        NormSpec(kind="rms", bias=True, cast="before_scale", eps_placement="outside"),
    ],
    ids=str,
)
def test_from_spec_builds_the_matching_module(spec: NormSpec) -> None:
    shape = (3, 4)[-len(spec.axis) :]
    m = nt.from_spec(spec, shape)
    assert type(m) is {"rms": nt.RMSNorm, "partial_rms": nt.PartialRMSNorm, "layer": nt.LayerNorm}[spec.kind]
    assert m.spec == spec
    assert (m.weight is not None) == spec.scale and (m.bias is not None) == spec.bias


def test_parameter_init_and_dtype() -> None:
    m = nt.RMSNorm(6, scale_offset=1.0, bias=True, dtype=torch.float64)
    assert torch.equal(m.weight, torch.zeros(6, dtype=torch.float64))
    assert torch.equal(m.bias, torch.zeros(6, dtype=torch.float64))
    assert torch.equal(nt.LayerNorm(6).weight, torch.ones(6))
    with torch.no_grad():
        m.weight.fill_(3.0)
    m.reset_parameters()
    assert torch.equal(m.weight, torch.zeros(6, dtype=torch.float64))
    assert [name for name, _ in nt.LayerNorm(6).named_parameters()] == ["weight", "bias"]


def test_fresh_layer_has_effective_scale_one() -> None:
    x = _randn(4, 16)
    plain = nt.RMSNorm(16)(x)
    assert torch.equal(nt.RMSNorm(16, scale_offset=1.0)(x), plain)
    assert torch.equal(nt.RMSNorm(16, elementwise_affine=False)(x), plain)


@pytest.mark.parametrize("affine", [True, False])
def test_state_dict_round_trip_rmsnorm(affine: bool) -> None:
    eps = torch.finfo(torch.float32).eps  # what torch.nn.RMSNorm(eps=None) uses for float32
    theirs = torch.nn.RMSNorm((3, 16), elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            theirs.weight.copy_(_randn(3, 16, seed=1))
    ours = nt.RMSNorm((3, 16), eps, elementwise_affine=affine)
    ours.load_state_dict(theirs.state_dict())
    x = _randn(5, 3, 16, seed=2)
    tolerances.assert_close(to_numpy(ours(x)), to_numpy(theirs(x)).astype(np.float64))
    back = torch.nn.RMSNorm((3, 16), eps=eps, elementwise_affine=affine)
    back.load_state_dict(ours.state_dict())
    tolerances.assert_close(to_numpy(back(x)), to_numpy(ours(x)).astype(np.float64))


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trip_layernorm(bias: bool) -> None:
    theirs = torch.nn.LayerNorm(16, bias=bias)
    with torch.no_grad():
        theirs.weight.copy_(_randn(16, seed=1))
        if bias:
            theirs.bias.copy_(_randn(16, seed=3))
    ours = nt.LayerNorm(16, theirs.eps, bias=bias)
    ours.load_state_dict(theirs.state_dict())
    x = _randn(5, 16, seed=2)
    tolerances.assert_close(to_numpy(ours(x)), to_numpy(theirs(x)).astype(np.float64))
    back = torch.nn.LayerNorm(16, bias=bias)
    back.load_state_dict(ours.state_dict())
    tolerances.assert_close(to_numpy(back(x)), to_numpy(ours(x)).astype(np.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cast", ["after_scale", "before_scale"])
def test_half_input_with_float32_parameters_keeps_the_input_dtype(dtype: torch.dtype, cast: str) -> None:
    m = nt.RMSNorm(32, bias=True, cast=cast)
    with torch.no_grad():
        m.weight.copy_(_randn(32, seed=1))
        m.bias.copy_(_randn(32, seed=2))
    x = _randn(4, 32, dtype=dtype)
    y = m(x)
    assert y.dtype == dtype and m.weight.dtype == torch.float32
    expected = reference.normalize(to_numpy(x), m.spec, to_numpy(m.weight), to_numpy(m.bias))
    tolerances.assert_close(to_numpy(y), expected, cast=cast)


def test_half_parameters_with_float32_input_keep_float32() -> None:
    m = nt.LayerNorm(32, dtype=torch.bfloat16)
    assert m(_randn(2, 32)).dtype == torch.float32


def test_functional_matches_the_modules() -> None:
    x = _randn(3, 4, 10)
    w, b = _randn(10, seed=1), _randn(10, seed=2)
    m = nt.PartialRMSNorm(10, 0.5, bias=True, scale_offset=1.0)
    with torch.no_grad():
        m.weight.copy_(w)
        m.bias.copy_(b)
    assert torch.equal(F.partial_rms_norm(x, 10, 0.5, w, bias=b, scale_offset=1.0), m(x))
    assert torch.equal(F.rms_norm(x, (10,), w, eps=1e-5), F.normalize(x, NormSpec(eps=1e-5), w))
    assert torch.equal(F.layer_norm(x, (4, 10)), F.normalize(x, NormSpec(kind="layer", eps=1e-5, axis=(-2, -1), scale=False, bias=False)))


def test_functional_normalize_over_leading_axes() -> None:
    x = _randn(6, 3, 5)
    spec = NormSpec(kind="layer", axis=(0, 2))
    w = _randn(6, 5, seed=1)
    got = F.normalize(x, spec, w)
    assert got.shape == x.shape
    tolerances.assert_close(to_numpy(got), reference.normalize(to_numpy(x), spec, to_numpy(w)))


def test_empty_batch() -> None:
    for m in (nt.RMSNorm(8), nt.LayerNorm(8), nt.PartialRMSNorm(8, 0.5)):
        assert m(torch.zeros(0, 8)).shape == (0, 8)


def test_non_contiguous_input() -> None:
    x = _randn(8, 12)[:, ::2]
    spec = NormSpec(bias=True)
    got = F.normalize(x, spec)
    tolerances.assert_close(to_numpy(got), reference.normalize(to_numpy(x), spec))


# Errors: each message names the problem.


def test_trailing_shape_mismatch_names_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"input of shape \(2, 5\) does not end in normalized_shape \(4,\)"):
        nt.RMSNorm(4)(torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"input of shape \(3,\) does not end in normalized_shape \(2, 3\)"):
        nt.LayerNorm((2, 3))(torch.zeros(3))
    with pytest.raises(ValueError, match=r"input of shape \(2, 5\) does not end in normalized_shape \(4,\)"):
        F.rms_norm(torch.zeros(2, 5), 4)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.complex64], ids=str)
def test_integer_and_complex_inputs_raise_type_error(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=f"x has dtype {str(dtype).removeprefix('torch.')}; normkit.torch supports float16, bfloat16, float32, float64"):
        nt.RMSNorm(4)(torch.zeros(2, 4, dtype=dtype))


def test_non_tensor_input_raises_type_error() -> None:
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):
        F.normalize(np.zeros((2, 4)), NormSpec())  # type: ignore[arg-type]


def test_parameter_errors() -> None:
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"weight has shape \(3,\), expected \(4,\)"):
        F.rms_norm(x, 4, torch.ones(3))
    with pytest.raises(TypeError, match="weight has dtype int32"):
        F.rms_norm(x, 4, torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight was given but the spec has scale=False"):
        F.normalize(x, NormSpec(scale=False), torch.ones(4))
    with pytest.raises(ValueError, match="bias was given but the spec has bias=False"):
        F.normalize(x, NormSpec(), None, torch.ones(4))


def test_bad_normalized_shape_and_axis() -> None:
    with pytest.raises(ValueError, match=r"normalized_shape=\(\) is invalid"):
        nt.RMSNorm(())
    with pytest.raises(ValueError, match="normalized_shape=-3 is invalid"):
        nt.LayerNorm(-3)
    with pytest.raises(ValueError, match=r"NormSpec.axis=\(0,\) does not fit normalized_shape \(4,\)"):
        nt.from_spec(NormSpec(axis=0), 4)
    with pytest.raises(ValueError, match="axis 2 is out of range for an input of rank 2"):
        F.normalize(torch.zeros(2, 4), NormSpec(axis=2))


def test_missing_torch_names_the_extra() -> None:
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None; import normkit.torch"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "ImportError: normkit.torch needs PyTorch: pip install 'normkit[torch]'" in result.stderr


def test_importing_normkit_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, normkit; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
