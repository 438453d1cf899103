"""The Triton kernels on gated and grouped specs against normkit.reference, forward and backward,
through normkit.torch's ``kernel="triton"``.

As in test_torch_triton_kernel.py: without a GPU the kernels run in Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1, set here before triton is imported); with one they are compiled and
run on it. Shapes stay tiny: the interpreter executes every program in Python.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton kernels need triton: pip install normkit[triton]")

from normkit import NormSpec, reference  # noqa: E402
from normkit.bridges import TorchBridge  # noqa: E402
from normkit.torch._spec import RowSpec, row_spec  # noqa: E402
from normkit.torch.functional import add_norm, normalize  # noqa: E402
from normkit.torch.kernels import triton as kernels  # noqa: E402
from tests.helpers import gated  # noqa: E402

to_numpy = TorchBridge().to_numpy

DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and TRITON_INTERPRET is not 1 (Triton's interpreter is off)",
                allow_module_level=True)


@pytest.fixture
def triton_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """``kernel="triton"`` takes gated and grouped specs; the `RowSpec` and the gate of each
    launch of the kernels (`kernels.launch`) are recorded."""
    calls: list[dict[str, object]] = []
    launch = kernels.launch

    def spy(*args: object) -> object:
        calls.append({"options": args[5], "gate": args[2]})
        return launch(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "launch", spy)
    return calls


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(a).to(dtype).to(DEVICE).requires_grad_(True)


def _check(name: str, got: torch.Tensor, want: np.ndarray, spec: NormSpec, x: torch.Tensor,
           magnitude: np.ndarray | None = None) -> None:
    """``got`` against the reference's ``want`` with `tests.helpers.gated.check`."""
    gated.check(name, got.detach().double().cpu().numpy(), str(got.dtype).removeprefix("torch."),
                want, spec, to_numpy(x).dtype, magnitude)


def _ran_triton(calls: list[dict[str, object]], spec: NormSpec, n: int, launches: int) -> None:
    """The kernels ran ``launches`` times (once, or not at all), with the spec's gate and
    groups."""
    assert len(calls) == launches, calls
    if not launches:
        return
    options = calls[0]["options"]
    assert isinstance(options, RowSpec)
    assert options.group == (spec.group_size or n)
    assert options.gate == (spec.gate or "")
    assert (calls[0]["gate"] is None) == (spec.gate is None)


def _check_gated(
    spec: NormSpec, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
    calls: list[dict[str, object]], seed: int, launches: int = 1,
) -> None:
    """normalize(kernel="triton") and its gradients (x, the gate, weight, bias) against
    reference.gated_normalize(_vjp), or normalize(_vjp) for an ungated spec."""
    gate = z if spec.gate else None
    y = normalize(x, spec, w, b, kernel="triton", gate=gate)
    _ran_triton(calls, spec, x.shape[-1], launches)
    dy = torch.from_numpy(np.random.default_rng(seed).standard_normal(tuple(y.shape)))
    dy = dy.to(y.dtype).to(DEVICE)
    y.backward(dy)
    xn, zn, wn, dyn = to_numpy(x), to_numpy(z), to_numpy(w), to_numpy(dy)
    bn = None if b is None else to_numpy(b)
    if spec.gate:
        want = reference.gated_normalize(xn, zn, spec, wn, bn)
        grads = reference.gated_normalize_vjp(xn, zn, dyn, spec, wn, bn)
        assert z.grad is not None and z.grad.dtype == z.dtype
        _check("dgate", z.grad, grads.dgate, spec, x)
    else:
        want = reference.normalize(xn, spec, wn, bn)
        grads = reference.normalize_vjp(xn, dyn, spec, wn, bn)
    magnitude = reference.scaled_magnitude(xn, spec, wn, gate=zn if spec.gate else None)
    _check("y", y, want, spec, x, magnitude)
    assert x.grad is not None and w.grad is not None
    _check("dx", x.grad, grads.dx, spec, x)
    _check("dweight", w.grad, grads.dscale, spec, x)
    if b is not None:
        assert b.grad is not None
        _check("dbias", b.grad, grads.dbias, spec, x)


# The cast order applies to half inputs only: float32 is checked with "after_scale".
CASES = [
    (spec, dtype) for spec in gated.specs() for dtype in (torch.float32, torch.bfloat16)
    if dtype == torch.bfloat16 or spec.cast == "after_scale"
]


@pytest.mark.parametrize(
    "spec, dtype", CASES, ids=[f"{gated.spec_id(s)}-{str(d)[6:]}" for s, d in CASES]
)
def test_gated_and_grouped_specs_match_the_reference(
    triton_calls: list[dict[str, object]], spec: NormSpec, dtype: torch.dtype
) -> None:
    """Rows of 8 (two groups of 4 where grouped); the parameters in float32 and in x's dtype
    alternately across specs, so that u is rounded before a gate after the norm
    (``round_affine``) in some bfloat16 cases."""
    seed = zlib.crc32(f"{gated.spec_id(spec)}-{dtype}".encode())
    rng = np.random.default_rng(seed)
    param_dtype = (torch.float32, dtype)[seed % 2]
    x = _tensor(2 * rng.standard_normal((3, 8)) + 0.5, dtype)
    z = _tensor(2 * rng.standard_normal((3, 8)), dtype)
    w = _tensor(1 + 0.2 * rng.standard_normal(8), param_dtype)
    b = _tensor(0.2 * rng.standard_normal(8), param_dtype) if spec.bias else None
    _check_gated(spec, x, z, w, b, triton_calls, seed)


@pytest.mark.parametrize("fused", [True, False], ids=["one-block", "looped"])
@pytest.mark.parametrize(
    "spec",
    [
        NormSpec("rms", gate="before", group_size=4),
        NormSpec("layer", eps_placement="outside", gate="after", gate_activation="sigmoid",
                 group_size=4, bias=True),
        NormSpec("rms", eps_placement="outside", group_size=4),
    ],
    ids=gated.spec_id,
)
# The interpreter squares the huge group in numpy, which warns before the kernel rescales it.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_huge_tiny_and_large_mean_groups_side_by_side(
    monkeypatch: pytest.MonkeyPatch, triton_calls: list[dict[str, object]], spec: NormSpec,
    fused: bool,
) -> None:
    """Each group keeps its own guards: squares that overflow float32 (|x| ~ 1e30), squares
    that underflow (|x| ~ 1e-30: eps outside's gradient needs x_i / sqrt(s)), a mean of 1e5
    with unit spread, and an ordinary group, in one row of float32; looped: blocks of 2."""
    if not fused:
        monkeypatch.setattr(kernels, "MAX_FUSED_BLOCK", 2)
        monkeypatch.setattr(kernels, "LOOP_BLOCK", 2)
    rng = np.random.default_rng(17)
    values = rng.standard_normal((2, 4, 4)) * np.array([1e30, 1e-30, 1.0, 1.0])[:, None]
    values[:, 2] += 1e5
    x = _tensor(values.reshape(2, 16), torch.float32)
    z = _tensor(2 * rng.standard_normal((2, 16)), torch.float32)
    w = _tensor(1 + 0.2 * rng.standard_normal(16), torch.float32)
    b = _tensor(0.2 * rng.standard_normal(16), torch.float32) if spec.bias else None
    _check_gated(spec, x, z, w, b, triton_calls, seed=18)


@pytest.mark.parametrize(
    "spec, dtype",
    [
        (NormSpec("rms", group_size=4, cast="before_scale", scale_offset=1.0, bias=True,
                  residual="rounded"), torch.bfloat16),
        (NormSpec("layer", group_size=4, residual="float32"), torch.bfloat16),
        (NormSpec("layer", group_size=8, residual="float32_normalized"), torch.bfloat16),
        (NormSpec("rms", group_size=4, residual="rounded"), torch.float32),
    ],
    ids=lambda case: gated.spec_id(case) + f"-{case.residual}" if isinstance(case, NormSpec)
    else str(case)[6:],
)
def test_grouped_add_norm(
    triton_calls: list[dict[str, object]], spec: NormSpec, dtype: torch.dtype
) -> None:
    """The residual add fused with groups: y, h and the gradients of x, the residual (with
    one for h too) and the parameters against reference.add_normalize(_vjp)."""
    rng = np.random.default_rng(5)
    x = _tensor(rng.standard_normal((3, 16)), dtype)
    residual = _tensor(4 * rng.standard_normal((3, 16)), dtype)
    w = _tensor(0.2 * rng.standard_normal(16), torch.float32)
    b = _tensor(0.2 * rng.standard_normal(16), torch.float32) if spec.bias else None
    y, h = add_norm(x, residual, spec, w, b, kernel="triton")
    _ran_triton(triton_calls, spec, 16, 1)
    assert triton_calls[0]["options"].residual == spec.residual  # type: ignore[attr-defined]
    dy = torch.from_numpy(rng.standard_normal((3, 16))).to(y.dtype).to(DEVICE)
    dh = torch.from_numpy(rng.standard_normal((3, 16))).to(h.dtype).to(DEVICE)
    torch.autograd.backward((y, h), (dy, dh))
    xn, rn, wn = to_numpy(x), to_numpy(residual), to_numpy(w)
    bn = None if b is None else to_numpy(b)
    want_y, want_h = reference.add_normalize(xn, rn, spec, wn, bn)
    grads = reference.add_normalize_vjp(xn, rn, to_numpy(dy), to_numpy(dh), spec, wn, bn)
    normalized = want_h if spec.residual == "rounded" else (
        xn.astype(np.float32) + rn.astype(np.float32))
    magnitude = reference.scaled_magnitude(normalized, spec.replace(residual=None), wn)
    _check("y", y, want_y, spec, x, magnitude)
    np.testing.assert_array_equal(to_numpy(h), want_h)
    assert x.grad is not None and residual.grad is not None and w.grad is not None
    _check("dx", x.grad, grads.dx, spec, x)
    _check("dresidual", residual.grad, grads.dresidual, spec, x)
    _check("dweight", w.grad, grads.dscale, spec, x)
    if b is not None:
        assert b.grad is not None
        _check("dbias", b.grad, grads.dbias, spec, x)


def test_layer_norm_groups_of_two_take_the_composite_path(
    triton_calls: list[dict[str, object]],
) -> None:
    """A LayerNorm group of 2 has a gradient of the order of eps, lost to float32 cancellation
    in the kernel's formula: the plan takes the composite path for it (its closed form), which
    gets the reference's dx; no kernel is launched."""
    spec = NormSpec("layer", group_size=2, gate="after")
    rng = np.random.default_rng(9)
    x = _tensor(rng.standard_normal((2, 8)), torch.float32)
    z = _tensor(rng.standard_normal((2, 8)), torch.float32)
    w = _tensor(1 + 0.2 * rng.standard_normal(8), torch.float32)
    _check_gated(spec, x, z, w, None, triton_calls, seed=10, launches=0)


def test_bad_gate_and_group_arguments_raise_clear_errors() -> None:
    x = torch.randn(2, 8, device=DEVICE)
    opts = row_spec(NormSpec(eps=1e-6), 8)
    after = opts._replace(gate="after")
    with pytest.raises(ValueError, match="group=3 is invalid"):
        kernels.norm_rows(x, None, None, opts._replace(k=3, group=3))
    with pytest.raises(ValueError, match="group=4 is invalid for kind='partial_rms'"):
        kernels.norm_rows(x, None, None, opts._replace(kind="partial_rms", k=2, group=4))
    with pytest.raises(ValueError, match="k=8 is invalid for kind='rms' on rows of n=8 in groups"):
        kernels.norm_rows(x, None, None, opts._replace(group=4))
    with pytest.raises(ValueError, match="gate='before' and a gate missing"):
        kernels.norm_rows(x, None, None, opts._replace(gate="before"))
    with pytest.raises(ValueError, match="gate='inside' is invalid"):
        kernels.norm_rows(x, None, None, opts._replace(gate="inside"), gate=x)
    with pytest.raises(ValueError, match="activation='relu' is invalid"):
        kernels.norm_rows(x, None, None, after._replace(activation="relu"), gate=x)
    with pytest.raises(ValueError, match="gate must be contiguous with x's shape"):
        kernels.norm_rows(x, None, None, after, gate=x.double())
    with pytest.raises(ValueError, match="a gate with a residual is not defined"):
        kernels.add_norm_rows(x, x, None, None, opts._replace(residual="rounded", gate="before"))


def test_u_is_rounded_before_a_gate_after_the_norm() -> None:
    """``round_affine`` (bfloat16 parameters, "before_scale", gate="after"): y = round(round(u)
    a(z)), the reference's value bit for bit on (almost) every element, where rounding once,
    round(u a(z)), differs on about a third of them."""
    spec = NormSpec(gate="after", gate_activation="sigmoid", cast="before_scale")
    rng = np.random.default_rng(3)
    x, z, w = (torch.from_numpy(a).bfloat16().to(DEVICE) for a in (
        rng.standard_normal((4, 64)), 2 * rng.standard_normal((4, 64)),
        1 + 0.3 * rng.standard_normal(64)))
    want = reference.gated_normalize(to_numpy(x), to_numpy(z), spec, to_numpy(w))
    rounded, once = (to_numpy(kernels.norm_rows(x, w, None, row_spec(spec, 64), gate=z,
                                                round_affine=flag))
                     for flag in (True, False))
    assert np.mean(rounded == want) >= 0.97
    assert np.mean(once == want) <= 0.9
