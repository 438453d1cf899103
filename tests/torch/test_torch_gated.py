"""normkit.torch's gated and grouped norms against the reference: every gate position,
activation, grouping, cast order and output dtype, forward and the gradients of x, the gate and
the parameters; the module, its optional gate, and each Hugging Face gated class."""

import importlib
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

from normkit import NormSpec, reference, tolerances
from normkit.port.gated_classes import GATED_CLASSES
from normkit.torch import GatedRMSNorm, from_spec
from normkit.torch.functional import normalize
from tests.helpers import gated

DTYPES = {
    "float32": (torch.float32, np.float32),
    "bfloat16": (torch.bfloat16, ml_dtypes.bfloat16),
    "float16": (torch.float16, np.float16),
    "float64": (torch.float64, np.float64),
}


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.float64)).to(dtype).requires_grad_(True)


def _check(name: str, got: torch.Tensor, want: np.ndarray, spec: NormSpec, magnitude=None,
           x_dtype: torch.dtype = torch.float32):
    gated.check(name, got.detach().double().numpy(), str(got.dtype).removeprefix("torch."),
                want, spec, DTYPES[str(x_dtype).removeprefix("torch.")][1], magnitude)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("output_dtype", ["input", "promote"])
@pytest.mark.parametrize("spec", gated.specs(), ids=gated.spec_id)
def test_functional_matches_the_reference(spec, dtype, output_dtype):
    spec = spec.replace(output_dtype=output_dtype)
    torch_dtype, np_dtype = DTYPES[dtype]
    seed = zlib.crc32(f"{gated.spec_id(spec)}-{dtype}-{output_dtype}".encode())
    rng = np.random.default_rng(seed)
    x = (2 * rng.standard_normal((6, 16)) + 0.5).astype(np_dtype)
    z = (2 * rng.standard_normal((6, 16))).astype(np_dtype)
    w = (1 + 0.2 * rng.standard_normal(16)).astype(np.float32)
    b = (0.2 * rng.standard_normal(16)).astype(np.float32) if spec.bias else None
    xt, zt, wt = _tensor(x, torch_dtype), _tensor(z, torch_dtype), _tensor(w, torch.float32)
    bt = None if b is None else _tensor(b, torch.float32)
    gate = zt if spec.gate else None
    y = normalize(xt, spec, wt, bt, gate=gate)
    dy = rng.standard_normal(y.shape).astype(np.dtype(str(y.dtype).removeprefix("torch."))
                                             if y.dtype != torch.bfloat16 else ml_dtypes.bfloat16)
    y.backward(torch.from_numpy(dy.astype(np.float64)).to(y.dtype))
    if spec.gate:
        want = reference.gated_normalize(x, z, spec, w, b)
        grads = reference.gated_normalize_vjp(x, z, dy, spec, w, b)
        _check("dgate", zt.grad, grads.dgate, spec)
    else:
        want = reference.normalize(x, spec, w, b)
        grads = reference.normalize_vjp(x, dy, spec, w, b)
    magnitude = reference.scaled_magnitude(x, spec, w, gate=z if spec.gate else None)
    _check("y", y, want, spec, magnitude, torch_dtype)
    _check("dx", xt.grad, grads.dx, spec)
    _check("dweight", wt.grad, grads.dscale, spec)
    if b is not None:
        _check("dbias", bt.grad, grads.dbias, spec)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_grouped_autograd_backward_follows_the_eager_rounding_model(kind, dtype):
    spec = NormSpec(kind, group_size=4, cast="before_scale", backward="autograd")
    torch_dtype, np_dtype = DTYPES[dtype]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 16)).astype(np_dtype)
    w = (1 + 0.2 * rng.standard_normal(16)).astype(np_dtype)
    dy = rng.standard_normal((5, 16)).astype(np_dtype)
    xt, wt = _tensor(x, torch_dtype), _tensor(w, torch_dtype)
    y = normalize(xt, spec, wt)
    y.backward(torch.from_numpy(dy.astype(np.float64)).to(torch_dtype))
    grads = reference.normalize_vjp(x, dy, spec, w)
    magnitude = reference.scaled_magnitude(x, spec, w)
    _check("y", y, reference.normalize(x, spec, w), spec, magnitude, torch_dtype)
    _check("dx", xt.grad, grads.dx, spec)
    _check("dweight", wt.grad, grads.dscale, spec)


def test_gate_missing_or_unexpected_is_refused():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="needs the gate tensor"):
        normalize(x, NormSpec(gate="after"))
    with pytest.raises(ValueError, match="spec has gate=None"):
        normalize(x, NormSpec(), gate=x)
    # The reference's words for a companion of the wrong shape, as for a residual.
    with pytest.raises(ValueError, match=r"gate has shape \(2, 4\), expected the shape of x, \(2, 8\)"):
        normalize(x, NormSpec(gate="after"), gate=torch.randn(2, 4))
    with pytest.raises(TypeError, match="gate"):
        normalize(x, NormSpec(gate="after"), gate=torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="group_size=3 does not divide"):
        normalize(x, NormSpec(group_size=3))


def test_gated_module_and_its_optional_gate():
    norm = GatedRMSNorm(8, group_size=4, gate="before", gate_activation="sigmoid")
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    x, z = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    w = norm.weight.detach().numpy()
    np.testing.assert_allclose(
        norm(x, z).detach().numpy(),
        reference.gated_normalize(x.numpy(), z.numpy(), norm.spec, w), rtol=1e-12,
    )
    ungated = norm.spec.replace(gate=None, gate_activation=None)
    np.testing.assert_allclose(
        norm(x).detach().numpy(), reference.normalize(x.numpy(), ungated, w), rtol=1e-12
    )
    assert type(from_spec(norm.spec, 8)) is GatedRMSNorm
    layer = from_spec(NormSpec("layer", gate="after"), 8)
    np.testing.assert_allclose(
        layer(x, gate=z).detach().numpy(),
        reference.gated_normalize(x.numpy(), z.numpy(), layer.spec), rtol=1e-12,
    )
    with pytest.raises(ValueError, match="gate"):
        torch.jit.script(norm)


def _hf_module(entry, hidden: int, groups: int | None):
    module = importlib.import_module(entry.module)
    cls = getattr(module, entry.name)
    kwargs = dict(entry.options)
    if entry.groups is not None:
        kwargs[entry.groups] = groups
    return cls(hidden, **kwargs) if kwargs else cls(hidden)


@pytest.mark.parametrize(
    "entry", [e for e in GATED_CLASSES if e.spec is not None],
    ids=lambda e: e.name + "".join(f"-{v}" for _, v in e.options),
)
def test_each_hf_gated_class_as_a_normkit_module(entry):
    pytest.importorskip("transformers")
    try:
        hf = _hf_module(entry, 64, None if entry.groups is None else 4)
    except (ImportError, AttributeError):
        pytest.skip(f"{entry.module}.{entry.name} is not in the installed transformers")
    groups = None if entry.groups is None else 4
    spec = entry.spec_for(64, 1e-6, groups).replace(axis=(-1,))
    ours = from_spec(spec, 64)
    rng = np.random.default_rng(3)
    with torch.no_grad():
        hf.weight.copy_(torch.from_numpy(1 + 0.2 * rng.standard_normal(64)))
        ours.weight.copy_(hf.weight)
    x = torch.from_numpy(rng.standard_normal((8, 64)))
    z = torch.from_numpy(2 * rng.standard_normal((8, 64)))
    for dtype in (torch.float32, torch.bfloat16):
        xs, zs = x.to(dtype), z.to(dtype)
        theirs, mine = hf(xs, zs), ours(xs, gate=zs) if spec.kind != "rms" else ours(xs, zs)
        assert mine.dtype == theirs.dtype
        bound = tolerances.bound(str(dtype).removeprefix("torch."), "forward", spec.cast)
        m = tolerances.measure(
            mine.detach().double().numpy(), theirs.detach().double().numpy(),
            str(dtype).removeprefix("torch."), "forward", spec.cast,
        )
        # Both round the same exact value; each may be one rounding off it.
        assert m.error <= 2 * bound.value, (entry.name, dtype, m.describe())
