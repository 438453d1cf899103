"""The Triton kernels against normkit.reference: every option and dtype, forward and backward.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set
here before triton is imported); with one they are compiled and run on it. Shapes stay small:
the interpreter executes every program in Python.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton kernels need triton: pip install normkit[triton]")

import triton.language as tl  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.bridges import TorchBridge  # noqa: E402
from normkit.torch._spec import RowSpec, row_spec  # noqa: E402
from normkit.torch.kernels import triton as kernels  # noqa: E402
from tests.helpers.dispatched import DispatchedOps  # noqa: E402

to_numpy = TorchBridge().to_numpy

DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and TRITON_INTERPRET is not 1 (Triton's interpreter is off)",
                allow_module_level=True)

KINDS = [dict(kind="rms"), dict(kind="partial_rms", p=0.3), dict(kind="layer")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROUNDINGS = kernels.RESIDUAL_ROUNDINGS


def _every_option() -> Iterator[NormSpec]:
    for kind, placement, offset, bias, cast in itertools.product(
        KINDS, ("inside", "outside"), (0.0, 1.0), (False, True), ("after_scale", "before_scale")
    ):
        yield NormSpec(**kind, eps_placement=placement, scale_offset=offset, bias=bias, cast=cast)


SPECS = list(_every_option()) + [NormSpec(**kind, scale=False) for kind in KINDS]


def _label(spec: NormSpec) -> str:
    """A short test id: kind, eps placement, offset, affine parameters, cast order."""
    affine = ("w" if spec.scale else "") + ("b" if spec.bias else "")
    return "-".join([
        spec.kind if spec.p is None else f"{spec.kind}{spec.p:g}", spec.eps_placement,
        f"offset{spec.scale_offset:g}", affine or "noaffine", spec.cast,
    ])


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _params(
    spec: NormSpec, n: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    weight = _randn(n, seed=seed + 1) * 0.5 + spec.scale_init if spec.scale else None
    bias = _randn(n, seed=seed + 2) * 0.5 if spec.bias else None
    return (
        None if weight is None else weight.to(dtype),
        None if bias is None else bias.to(dtype),
    )


def _options(spec: NormSpec, n: int, **fields: object) -> RowSpec:
    return row_spec(spec, n)._replace(**fields)


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else to_numpy(t)


def _leaves(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def _check_norm(
    spec: NormSpec, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    seed: int = 7, dy: torch.Tensor | None = None,
) -> None:
    """norm_rows and its gradients (for ``dy``, by default drawn with ``seed``) against
    reference.normalize and normalize_vjp."""
    xl, wl, bl = _leaves(x, weight, bias)
    y = kernels.norm_rows(xl, wl, bl, _options(spec, x.shape[1]))
    if dy is None:
        dy = _randn(*x.shape, seed=seed, dtype=x.dtype)
    y.backward(dy)
    xn, wn, bn = _np(x), _np(weight), _np(bias)
    assert y.dtype == x.dtype
    tolerances.assert_close(
        to_numpy(y), reference.normalize(xn, spec, wn, bn), cast=spec.cast, what="y",
        magnitude=reference.scaled_magnitude(xn, spec, wn),
    )
    want = reference.normalize_vjp(xn, to_numpy(dy), spec, wn, bn)
    for name, leaf, expected in zip(("dx", "dweight", "dbias"), (xl, wl, bl), want, strict=True):
        if leaf is None:
            continue
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype, name
        tolerances.assert_close(to_numpy(leaf.grad), expected, quantity="grad", what=name)


# The cast order applies to half inputs only: float32 is checked with "after_scale".
SPEC_DTYPES = [
    (spec, dtype) for spec in SPECS for dtype in DTYPES
    if dtype != torch.float32 or spec.cast == "after_scale"
]


@pytest.mark.parametrize(
    "spec, dtype", SPEC_DTYPES, ids=[f"{_label(s)}-{d}" for s, d in SPEC_DTYPES]
)
def test_every_option_and_dtype(spec: NormSpec, dtype: torch.dtype) -> None:
    """Parameters in float32 and in the input dtype, alternately across cases."""
    case = SPECS.index(spec) + DTYPES.index(dtype)
    n = (7, 24)[case % 2]
    param_dtype = (torch.float32, dtype)[case // 2 % 2]
    x = _randn(3, n, seed=case, dtype=dtype)
    _check_norm(spec, x, *_params(spec, n, param_dtype, seed=case))


@pytest.mark.parametrize("n", [1, 2, 7, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_row_lengths(kind: dict, dtype: torch.dtype, n: int) -> None:
    """n = 1 and 2 included: LayerNorm hands such rows to the composite path."""
    spec = NormSpec(**kind, bias=True)
    _check_norm(spec, _randn(5, n, seed=n, dtype=dtype), *_params(spec, n, torch.float32, seed=n))


def _force_looped(monkeypatch: pytest.MonkeyPatch, longest_fused: int = 8, block: int = 8) -> None:
    """Rows longer than ``longest_fused`` elements take the looped variant, in blocks of
    ``block``."""
    monkeypatch.setattr(kernels, "MAX_FUSED_BLOCK", longest_fused)
    monkeypatch.setattr(kernels, "LOOP_BLOCK", block)


@pytest.fixture
def looped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows longer than 16 elements take the looped variant, in blocks of 8."""
    _force_looped(monkeypatch, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "spec",
    [
        NormSpec(bias=True, scale_offset=1.0),
        NormSpec(kind="partial_rms", p=0.3, eps_placement="outside", cast="before_scale"),
        NormSpec(kind="partial_rms", p=0.01),
        NormSpec(kind="layer", eps_placement="outside"),
        NormSpec(kind="layer", cast="before_scale", scale=False),
    ],
    ids=_label,
)
def test_looped_variant(looped: None, spec: NormSpec, dtype: torch.dtype) -> None:
    n = 37
    _check_norm(spec, _randn(4, n, seed=3, dtype=dtype), *_params(spec, n, dtype, seed=3))


@pytest.mark.parametrize("rows", [5, 0])
@pytest.mark.parametrize("fused", [True, False], ids=["one-block", "looped"])
@pytest.mark.parametrize("spec", [NormSpec(), NormSpec(kind="layer", bias=True)], ids=_label)
def test_the_backwards_partial_sums_need_no_zero_fill(
    monkeypatch: pytest.MonkeyPatch, spec: NormSpec, fused: bool, rows: int
) -> None:
    """Every ``torch.empty`` NaN-filled: the weight and bias gradients still match the
    reference, so no kernel reads a part of its buffers it has not written (a batch without
    rows included, whose gradients are zeros)."""
    if not fused:
        _force_looped(monkeypatch, 16)
    empty = torch.empty

    def nan_filled(*args: object, **kwargs: object) -> torch.Tensor:
        t = empty(*args, **kwargs)  # type: ignore[call-overload]
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_filled)
    n = 24
    _check_norm(spec, _randn(rows, n, seed=5), *_params(spec, n, torch.float32, seed=5))


@pytest.mark.parametrize("fused", [True, False], ids=["one-block", "looped"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_rows_whose_statistic_overflows_float32(
    monkeypatch: pytest.MonkeyPatch, kind: dict, fused: bool
) -> None:
    """|x| near the float32 maximum: the reference's values near +-1, not zeros or NaN."""
    if not fused:
        _force_looped(monkeypatch)
    spec = NormSpec(**kind, eps_placement="outside" if kind["kind"] == "layer" else "inside")
    x = _randn(4, 20, seed=11)
    x[0] *= 1e20
    x[1] = x[1].sign() * 3e38
    x[2, 3] = 3.4e38
    _check_norm(spec, x, *_params(spec, 20, torch.float32, seed=11))


@pytest.mark.parametrize("fused", [True, False], ids=["one-block", "looped"])
def test_partial_rms_overflowing_head_and_an_infinite_tail(
    monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    """The statistic reads the first k elements only: an infinity after them stays infinite."""
    if not fused:
        _force_looped(monkeypatch)
    spec = NormSpec(kind="partial_rms", p=0.5, scale=False)
    x = _randn(2, 20, seed=12) * 1e30
    x[:, 15] = float("inf")
    y = kernels.norm_rows(x, None, None, _options(spec, 20))
    tolerances.assert_close(to_numpy(y), reference.normalize(to_numpy(x), spec))


def test_layer_norm_rows_with_a_large_mean() -> None:
    spec = NormSpec(kind="layer")
    x = (_randn(4, 300, seed=5).double() + 1e6).float()
    _check_norm(spec, x, *_params(spec, 300, torch.float32, seed=5))


@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_partial_rms_first_element_gradient_with_k_1(placement: str) -> None:
    """x_0 large against eps: dx_0 = r^3 (eps d_0 - x_0 sum_{j>=1} x_j d_j), no cancellation."""
    spec = NormSpec(kind="partial_rms", p=0.05, eps_placement=placement)
    x = _randn(3, 16, seed=2) * 1e3
    assert spec.stat_size(16) == 1
    _check_norm(spec, x, *_params(spec, 16, torch.float32, seed=2))


UNDERFLOW_KINDS = KINDS + [dict(kind="partial_rms", p=1 / 16)]


@pytest.mark.parametrize("fused", [True, False], ids=["one-block", "looped"])
@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("kind", UNDERFLOW_KINDS, ids=lambda k: f"{k['kind']}{k.get('p', '')}")
def test_gradients_of_large_cotangents_on_large_rows(
    monkeypatch: pytest.MonkeyPatch, kind: dict, placement: str, fused: bool
) -> None:
    """|x| ~ 1e9 with dy ~ 1e29: the sums of d x overflow float32 where those of d y_hat do
    not; the gradients are the reference's, not infinities or NaN."""
    if not fused:
        _force_looped(monkeypatch)
    spec = NormSpec(**kind, eps_placement=placement)
    x = _randn(3, 16, seed=5) * torch.tensor([[1e9], [1.0], [1e9]], device=DEVICE)
    dy = _randn(3, 16, seed=6) * torch.tensor([[1e29], [1.0], [1.0]], device=DEVICE)
    _check_norm(spec, x, *_params(spec, 16, torch.float32, seed=5), dy=dy)


@pytest.mark.parametrize("fused", [True, False], ids=["one-block", "looped"])
@pytest.mark.parametrize("scale", [1e-12, 1e-25, 1e-40])
@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("kind", UNDERFLOW_KINDS, ids=lambda k: f"{k['kind']}{k.get('p', '')}")
def test_gradient_where_the_statistics_squares_underflow(
    monkeypatch: pytest.MonkeyPatch, kind: dict, placement: str, scale: float, fused: bool
) -> None:
    """eps outside divides by sqrt(s): rows whose float32 squares flush to s = 0 (scale 1e-25,
    and subnormal inputs at 1e-40) keep the term ``-r**2 x_i / (2 sqrt(s))`` (the issue's
    partial RMS row: dx[0, 0] = -6.0e10, not 1e5), in both variants. float32 inputs: the
    interpreter widens subnormal bfloat16 wrongly (a GPU does not)."""
    if not fused:
        _force_looped(monkeypatch)
    spec = NormSpec(**kind, eps=1e-5, eps_placement=placement)
    x = torch.zeros(3, 16, dtype=torch.float64)
    x[0, :4] = torch.tensor([1.0, 0.0, -1 / 3, 1 / 7]) * scale
    if spec.kind == "partial_rms":
        x[0, 4:] = 1.0
    x[1, 0] = scale
    x[2, :6] = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.5, 0.25]) * scale
    _check_norm(spec, x.float().to(DEVICE), *_params(spec, 16, torch.float32, seed=13))


def test_a_long_row_stays_within_the_float32_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """2**14 elements in blocks of 256: per-lane sums, then a tree, not one running sum."""
    _force_looped(monkeypatch, 256, 256)
    spec = NormSpec(kind="layer")
    x = _randn(1, 2**14, seed=9) * 3 + 2
    _check_norm(spec, x, *_params(spec, 2**14, torch.float32, seed=9))


# Every rounding and dtype in one block; the looped variant on bfloat16.
ADD_NORM_CASES = [
    (spec, dtype, rounding, fused)
    for spec in (NormSpec(cast="before_scale", scale_offset=1.0), NormSpec(kind="layer"))
    for dtype in DTYPES
    for rounding in ROUNDINGS
    for fused in (True, False)
    if fused or dtype == torch.bfloat16
]


@pytest.mark.parametrize(
    "spec, dtype, rounding, fused",
    ADD_NORM_CASES,
    ids=[
        f"{_label(s)}-{d}-{r}-{'one-block' if f else 'looped'}" for s, d, r, f in ADD_NORM_CASES
    ],
)
def test_add_norm_rows(
    monkeypatch: pytest.MonkeyPatch, spec: NormSpec, dtype: torch.dtype, rounding: str,
    fused: bool,
) -> None:
    if not fused:
        _force_looped(monkeypatch)
    n = 24
    x, residual = _randn(3, n, seed=1, dtype=dtype), _randn(3, n, seed=2, dtype=dtype) * 4
    weight, bias = _params(spec, n, torch.float32, seed=3)
    xl, rl, wl, bl = _leaves(x, residual, weight, bias)
    y, h = kernels.add_norm_rows(
        xl, rl, wl, bl, _options(spec, n, residual=rounding)
    )
    assert y.dtype == dtype
    assert h.dtype == (torch.float32 if rounding == "float32" else dtype)
    dy = _randn(3, n, seed=4, dtype=dtype)
    dh = _randn(3, n, seed=5, dtype=h.dtype)
    torch.autograd.backward((y, h), (dy, dh))
    with_residual = spec.replace(residual=rounding)
    xn, rn, wn, bn = to_numpy(x), to_numpy(residual), _np(weight), _np(bias)
    want_y, want_h = reference.add_normalize(xn, rn, with_residual, wn, bn)
    want_dx = reference.add_normalize_vjp(
        xn, rn, to_numpy(dy), to_numpy(dh), with_residual, wn, bn
    ).dx
    tolerances.assert_close(to_numpy(y), want_y, cast=spec.cast, what="y")
    tolerances.assert_close(to_numpy(h), want_h, what="h")
    assert xl.grad is not None and rl.grad is not None
    tolerances.assert_close(to_numpy(xl.grad), want_dx, quantity="grad", what="dx")
    tolerances.assert_close(to_numpy(rl.grad), want_dx, quantity="grad", what="dresidual")
    assert wl is not None and wl.grad is not None


def test_bad_arguments_raise_clear_errors() -> None:
    x = _randn(2, 8, seed=0)
    opts = _options(NormSpec(), 8)
    with pytest.raises(ValueError, match="contiguous 2-D"):
        kernels.norm_rows(x.t(), None, None, opts)
    with pytest.raises(TypeError, match="float64 takes the composite path"):
        kernels.norm_rows(x.double(), None, None, opts)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        kernels.norm_rows(x, _randn(7, seed=0), None, opts)
    with pytest.raises(ValueError, match="the RowSpec is for rows of n=9, x has rows of 8"):
        kernels.norm_rows(x, None, None, opts._replace(n=9))
    with pytest.raises(ValueError, match="kind='group' is invalid"):
        kernels.norm_rows(x, None, None, opts._replace(kind="group"))
    with pytest.raises(ValueError, match="residual='half' is invalid"):
        kernels.add_norm_rows(x, x, None, None, opts._replace(residual="half"))
    with pytest.raises(ValueError, match="residual must be contiguous with x's shape"):
        kernels.add_norm_rows(x, x[:1], None, None, _options(NormSpec(residual="rounded"), 8))
    layer = _options(NormSpec(kind="layer", residual="rounded"), 2)
    with pytest.raises(ValueError, match="n <= 2"):
        kernels.add_norm_rows(x[:, :2].contiguous(), x[:, :2].contiguous(), None, None, layer)


def test_backward_saves_the_input_and_one_float32_statistic_per_row() -> None:
    spec = NormSpec(kind="layer")
    x = _randn(6, 24, seed=0, dtype=torch.bfloat16).requires_grad_(True)
    weight, bias = (p.requires_grad_(True) for p in _params(spec, 24, torch.float32, seed=0)
                    if p is not None)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kernels.norm_rows(x, weight, bias, _options(spec, 24))
    extra = [t for t in saved if t is not x and t is not weight]
    assert x in saved
    assert [(tuple(t.shape), t.dtype) for t in extra] == [((6,), torch.float32)]


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing, as a tracer's would be seen: under it the kernels are
    reached through their custom ops."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["residual", "gate"])
def test_eager_calls_skip_the_custom_ops_and_give_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """In plain eager mode the kernels are launched directly (the custom ops' dispatch costs more
    host time than a launch); traced calls go through the ops. Both give the same bits, forward
    and backward."""
    spec = NormSpec(kind="layer", bias=True)
    n = 24
    x, other = _randn(3, n, seed=1, dtype=torch.bfloat16), _randn(3, n, seed=2, dtype=torch.bfloat16)
    weight, bias = _params(spec, n, torch.float32, seed=3)
    dy = _randn(3, n, seed=4, dtype=torch.bfloat16)

    def forward_backward() -> list[torch.Tensor]:
        xl, ol, wl, bl = _leaves(x, other, weight, bias)
        if case == "residual":
            y, _ = kernels.add_norm_rows(
                xl, ol, wl, bl, _options(spec.replace(residual="rounded"), n)
            )
        else:
            y = kernels.norm_rows(xl, wl, bl, _options(spec.replace(gate="after"), n),
                                  gate=ol)
        y.backward(dy)
        return [y.detach(), *(leaf.grad for leaf in (xl, ol, wl, bl) if leaf is not None)]

    op_calls = []
    op = kernels._norm_rows_op
    monkeypatch.setattr(kernels, "_norm_rows_op", lambda *a: op_calls.append(1) or op(*a))
    with _PassThrough():
        through_ops = forward_backward()
    assert op_calls == [1]

    def refuse(*args: object) -> None:
        raise AssertionError("an eager call reached the custom op")

    monkeypatch.setattr(kernels, "_norm_rows_op", refuse)
    direct = forward_backward()
    assert len(direct) == len(through_ops) == 5
    for got, want in zip(direct, through_ops, strict=True):
        assert got is not None and want is not None and torch.equal(got, want)


@pytest.mark.parametrize("residual", [None, "rounded", "float32_normalized"])
def test_the_eager_backward_fills_nothing_with_zeros(residual: str | None) -> None:
    """r (and h without a residual) reach no loss: autograd makes no zeros for their
    gradients, which on a GPU cost about 150 us of host time each on its device thread. Rows of
    a single block store their partial sums whole, so nothing is zero-filled at all."""
    spec = NormSpec(bias=True, residual=residual)
    n = 32
    x, other = _randn(4, n, seed=1), _randn(4, n, seed=2)
    weight, bias = _params(spec, n, torch.float32, seed=3)
    xl, ol, wl, bl = _leaves(x, other, weight, bias)
    if residual is None:
        y = kernels.norm_rows(xl, wl, bl, _options(spec, n))
    else:
        y, _ = kernels.add_norm_rows(xl, ol, wl, bl, _options(spec, n))
    dy = _randn(4, n, seed=4)
    with DispatchedOps() as recorder:
        y.backward(dy)
    # A dispatch mode is thread-local, and a CUDA backward runs on autograd's device thread.
    if DEVICE == "cpu":
        assert recorder.names  # the backward ran under the mode
        assert not {"zeros", "zero_", "fill_", "zeros_like", "new_zeros"} & set(recorder.names)
    h = x if residual is None else x + other  # float32: every rounding gives this sum
    want = reference.normalize_vjp(to_numpy(h), to_numpy(dy), spec.replace(residual=None),
                                   to_numpy(weight), to_numpy(bias))
    for got, expected, name in zip((xl.grad, wl.grad, bl.grad), want, ("dx", "dw", "db")):
        tolerances.assert_close(to_numpy(got), expected, quantity="grad", what=name)
    if residual is not None:
        assert ol.grad is not None and torch.equal(ol.grad, xl.grad)


@pytest.mark.parametrize("residual", ["rounded", "float32_normalized"])
def test_a_loss_of_h_alone_gives_dh_to_x_and_the_residual(residual: str) -> None:
    """Without a gradient for y (autograd passes none: it makes no zeros), the backward still
    serves h's: dx = dresidual = dh, and the parameters' gradients are 0."""
    spec = NormSpec(bias=True, residual=residual)
    n = 32
    x, other = _randn(4, n, seed=1), _randn(4, n, seed=2)
    weight, bias = _params(spec, n, torch.float32, seed=3)
    xl, ol, wl, bl = _leaves(x, other, weight, bias)
    _, h = kernels.add_norm_rows(xl, ol, wl, bl, _options(spec, n))
    dh = _randn(4, n, seed=5)
    h.backward(dh)
    for got in (xl.grad, ol.grad):
        assert got is not None and torch.equal(got, dh)
    for got in (wl.grad, bl.grad):
        assert got is None or not got.any()


SECOND_ORDER = {
    "rms": (NormSpec(bias=True), None),
    "partial-outside": (NormSpec("partial_rms", p=0.5, eps_placement="outside"), None),
    "layer-gate-after-groups": (NormSpec("layer", gate="after", group_size=8), None),
    "rms-gate-before": (NormSpec(gate="before", gate_activation="sigmoid"), None),
    "residual-rounded": (NormSpec(residual="rounded"), "rounded"),
    "residual-float32": (NormSpec(kind="layer", residual="float32"), "float32"),
    "residual-float32_normalized": (NormSpec(residual="float32_normalized"),
                                    "float32_normalized"),
}


@pytest.mark.parametrize("case", SECOND_ORDER)
def test_second_derivatives_are_the_composite_paths(case: str) -> None:
    """A gradient penalty through the kernels in eager mode: under ``create_graph`` the
    gradient is the composite path's graph, so the second derivative (which depends on x) is
    the composite path's, not silently zero."""
    from normkit.torch.functional import add_norm, normalize

    spec, rounding = SECOND_ORDER[case]
    x0, other0 = _randn(3, 24, seed=0), _randn(3, 24, seed=1)
    weight0, bias0 = _params(spec, 24, torch.float32, seed=2)
    second = []
    for kernel in ("triton", "composite"):
        x, other, weight, bias = _leaves(x0, other0, weight0, bias0)
        if rounding is not None:
            y, h = add_norm(x, other, spec, weight, bias, kernel=kernel)
            y = y + h * h
        else:
            y = normalize(x, spec, weight, bias, gate=other if spec.gate else None,
                          kernel=kernel)
        leaves = [t for t in (x, other, weight, bias) if t is not None]
        grads = torch.autograd.grad(y.pow(2).sum(), leaves, create_graph=True,
                                    allow_unused=True)
        penalty = sum(g.pow(2).sum() for g in grads if g is not None)
        second.append(torch.autograd.grad(penalty, leaves, allow_unused=True))
    for got, want in zip(*second, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert want.abs().max() > 0


def test_a_traced_second_derivative_is_refused_not_silently_zero() -> None:
    """Through the custom ops (as under torch.compile) the kernels' gradient has no derivative
    of its own: differentiating it raises, naming the op."""
    x = _randn(3, 24, seed=0).requires_grad_(True)
    with _PassThrough():
        y = kernels.norm_rows(x, None, None, _options(NormSpec(), 24))
        (dx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        assert dx.requires_grad
        with pytest.raises(RuntimeError, match="triton_norm_rows_backward"):
            (dx * dx).sum().backward()


def test_inference_skips_the_autograd_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under no_grad the eager kernels launch without the autograd Function (host time is
    what an eager call on a GPU is bound by), with the bits of a call through it."""
    x = _randn(3, 24, seed=0, dtype=torch.bfloat16)
    weight = _randn(24, seed=1).requires_grad_(True)
    opts = _options(NormSpec(), 24)
    recorded = kernels.norm_rows(x, weight, None, opts)
    assert recorded.requires_grad

    def refuse(*args: object) -> None:
        raise AssertionError("an inference call recorded an autograd graph")

    monkeypatch.setattr(kernels._EagerNormRows, "apply", refuse)
    with torch.no_grad():
        alone = kernels.norm_rows(x, weight, None, opts)
    assert torch.equal(recorded.detach(), alone)


def test_a_missing_triton_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's code run again, as a new module, with triton hidden."""
    spec = importlib.util.spec_from_file_location("normkit_triton_copy", kernels.__file__)
    assert spec is not None and spec.loader is not None
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ImportError, match=r"need triton .*pip install normkit\[triton\]"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_module_constexprs_survive_their_repr() -> None:
    """Inductor re-emits the module's ``tl.constexpr`` globals by repr; ``inf`` or ``nan`` would be
    a NameError in the source it generates (torch.compile on a GPU)."""
    values = {name: v.value for name, v in vars(kernels).items() if isinstance(v, tl.constexpr)}
    assert values
    for name, value in values.items():
        assert eval(repr(value), {}) == value, name


# Traces forward and backward with fake tensors (what torch.compile does) and captures the
# forward with dynamo's fullgraph; then compiles kernel variants with every feature on, and
# grouped ones with each gate, through Triton's whole compiler (to PTX and a cubin for sm_90,
# with the ptxas bundled in triton's wheel). None of it needs a GPU.
_TRACE_AND_COMPILE = """
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from normkit.torch.kernels import triton as kernels
from normkit import NormSpec
from normkit.torch._spec import row_spec

options = row_spec(NormSpec("layer", eps=1e-6, eps_placement="outside", scale_offset=1.0,
                            cast="before_scale"), 64)
x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
w, b = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)

def step(x, w, b, dy):
    return torch.autograd.grad(kernels.norm_rows(x, w, b, options), (x, w, b), dy)

traced = make_fx(step, tracing_mode="fake")(x, w, b, torch.randn(8, 64, dtype=torch.bfloat16))
assert "normkit.triton_norm_rows.default" in traced.code, traced.code
assert "normkit.triton_norm_rows_backward.default" in traced.code, traced.code

class Captured(Exception):
    pass

def capture(graph, example_inputs):
    raise Captured(graph.code)

try:
    torch.compile(lambda x, w, b: kernels.norm_rows(x, w, b, options), fullgraph=True,
                  backend=capture)(x, w, b)
except Exception as error:
    assert "Captured" in str(error) and "triton_norm_rows.default" in str(error), error
else:
    raise AssertionError("dynamo did not call the backend")
print("traced")

def options(names, pointers, scalars, constexprs):
    signature = {name: pointers.get(name, scalars.get(name, "constexpr")) for name in names}
    return signature, constexprs

forward = ["X", "RES", "Z", "W", "B", "Y", "H", "R", "n", "k", "groups", "eps", "scale_offset",
           "LAYER", "OUTSIDE", "HAS_W", "HAS_B", "BEFORE_SCALE", "RESIDUAL", "GROUPED", "GATE_IN",
           "GATE_OUT", "ROUND_AFFINE", "SINGLE", "BLOCK"]
backward = ["X", "RES", "Z", "R", "DY", "DH", "W", "B", "DX", "DZ", "DW_PART", "DB_PART", "rows",
            "n", "k", "groups", "eps", "scale_offset", "LAYER", "OUTSIDE", "HAS_W", "HAS_B",
            "NEED_DW", "NEED_DB", "HAS_DH", "RESIDUAL", "GROUPED", "GATE_IN", "GATE_OUT", "SINGLE",
            "BLOCK"]
scalars = {"n": "i32", "k": "i32", "rows": "i32", "groups": "i32", "eps": "fp32",
           "scale_offset": "fp32"}
# torch.compile's Inductor passes Python floats as float64 (a launch as float32): the one-block
# variants take them so.
wide_scalars = {**scalars, "eps": "fp64", "scale_offset": "fp64"}
half = {name: "*bf16" for name in ("X", "RES", "Z", "B", "Y", "DY", "DH", "DX", "DZ")}
floats = {name: "*fp32" for name in ("W", "H", "R", "DW_PART", "DB_PART")}
ungated = dict(GROUPED=False, GATE_IN="none", GATE_OUT="none")
cases = []
for single, block in ((True, 1024), (False, 4096)):
    arguments = wide_scalars if single else scalars
    cases.append((kernels._forward_kernel, *options(forward, {**half, **floats}, arguments, dict(
        LAYER=True, OUTSIDE=True, HAS_W=True, HAS_B=True, BEFORE_SCALE=True, RESIDUAL=3,
        ROUND_AFFINE=False, SINGLE=single, BLOCK=block, **ungated))))
    for layer in (True, False):
        cases.append((kernels._backward_kernel, *options(backward, {**half, **floats}, arguments,
            dict(LAYER=layer, OUTSIDE=layer, HAS_W=True, HAS_B=False, NEED_DW=True,
                 NEED_DB=True, HAS_DH=True, RESIDUAL=3 if layer else 0, SINGLE=single,
                 BLOCK=block, **ungated))))
    # Grouped, with a gate before (SiLU) and after (sigmoid) the norm.
    for gate_in, gate_out in (("silu", "none"), ("none", "sigmoid")):
        gating = dict(GROUPED=True, GATE_IN=gate_in, GATE_OUT=gate_out)
        cases.append((kernels._forward_kernel, *options(forward, {**half, **floats}, arguments,
            dict(LAYER=True, OUTSIDE=True, HAS_W=True, HAS_B=True, BEFORE_SCALE=True,
                 RESIDUAL=0, ROUND_AFFINE=True, SINGLE=single, BLOCK=block, **gating))))
        cases.append((kernels._backward_kernel, *options(backward, {**half, **floats}, arguments,
            dict(LAYER=True, OUTSIDE=True, HAS_W=True, HAS_B=True, NEED_DW=True, NEED_DB=True,
                 HAS_DH=False, RESIDUAL=0, SINGLE=single, BLOCK=block, **gating))))
cases.append((kernels._column_sums_kernel, *options(
    ["PART", "DW", "DB", "parts", "n", "width", "HAS_DW", "BLOCK_P", "BLOCK_N"],
    {"PART": "*fp32", "DW": "*bf16", "DB": "*bf16"}, {"parts": "i32", "n": "i32", "width": "i32"},
    dict(HAS_DW=False, BLOCK_P=32, BLOCK_N=256))))
for fn, signature, constexprs in cases:
    compiled = compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], fn.__name__
print("compiled", len(cases))
"""


def test_the_ops_trace_and_every_kernel_compiles_without_a_gpu() -> None:
    """torch.compile's tracing, and Triton's compiler, which type-checks and lowers kernels
    as the interpreter does not.

    In a fresh Python without TRITON_INTERPRET, so that triton.jit gives compilable kernels.
    """
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _TRACE_AND_COMPILE], capture_output=True, text=True, env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "traced" in done.stdout
    assert "compiled 15" in done.stdout


gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "spec", [NormSpec(cast="before_scale"), NormSpec(kind="layer")], ids=_label
)
def test_compile_fullgraph_traces_through_the_kernels(spec: NormSpec) -> None:
    n = 4096
    x = _randn(8, n, seed=0, dtype=torch.bfloat16)
    weight, bias = _params(spec, n, torch.float32, seed=0)
    xl, wl, bl = _leaves(x, weight, bias)
    opts = _options(spec, n)

    def step(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        return kernels.norm_rows(x, w, b, opts).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    compiled(xl, wl, bl).backward()
    eager = _leaves(x, weight, bias)
    step(*eager).backward()
    for got, want in zip((xl, wl, bl), eager, strict=True):
        if got is not None and want is not None:
            assert got.grad is not None and want.grad is not None
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


@pytest.mark.gpu
@gpu
def test_cuda_graph_capture_replays_forward_and_backward() -> None:
    spec = NormSpec(kind="partial_rms", p=0.5, scale_offset=1.0, bias=True)
    n = 2048
    x = _randn(16, n, seed=0, dtype=torch.bfloat16).requires_grad_(True)
    weight, bias = (p.requires_grad_(True) for p in _params(spec, n, torch.float32, seed=0)
                    if p is not None)
    dy = _randn(16, n, seed=1, dtype=torch.bfloat16)
    opts = _options(spec, n)

    def step() -> torch.Tensor:
        y = kernels.norm_rows(x, weight, bias, opts)
        y.backward(dy)
        return y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            x.grad = weight.grad = bias.grad = None
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    x.grad = weight.grad = bias.grad = None
    with torch.cuda.graph(graph):
        y = step()
    x.data.copy_(_randn(16, n, seed=2, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert x.grad is not None
    xn = to_numpy(x)
    tolerances.assert_close(to_numpy(y), reference.normalize(xn, spec, _np(weight), _np(bias)))
    want_dx, _, _ = reference.normalize_vjp(xn, to_numpy(dy), spec, _np(weight), _np(bias))
    tolerances.assert_close(to_numpy(x.grad), want_dx, quantity="grad")



@pytest.mark.parametrize("spec", [NormSpec("rms", cast="before_scale"), NormSpec("layer")], ids=_label)
def test_the_kernel_switch_reaches_the_triton_kernels(spec: NormSpec) -> None:
    """``kernel="triton"`` on normkit.torch's modules runs these kernels (on CPU tensors only
    under the interpreter), forward and backward, in agreement with the reference."""
    from normkit.torch import from_spec

    module = from_spec(spec, 24, kernel="triton").to(DEVICE)
    weight, bias = _params(spec, 24, torch.float32, seed=3)
    with torch.no_grad():
        module.weight.copy_(weight)
        if bias is not None:
            module.bias.copy_(bias)
    x = _randn(3, 24, seed=4, dtype=torch.bfloat16).requires_grad_()
    dy = _randn(3, 24, seed=5, dtype=torch.bfloat16)
    module(x).backward(dy)
    xn, dyn, wn, bn = to_numpy(x), to_numpy(dy), _np(weight), _np(bias)
    tolerances.assert_close(
        to_numpy(module(x)), reference.normalize(xn, spec, wn, bn), cast=spec.cast, what="y",
        magnitude=reference.scaled_magnitude(xn, spec, wn),
    )
    dx, dweight, _ = reference.normalize_vjp(xn, dyn, spec, wn, bn)
    tolerances.assert_close(to_numpy(x.grad), dx, quantity="grad", what="dx")
    tolerances.assert_close(to_numpy(module.weight.grad), dweight, quantity="grad", what="dw")


class _OnCuda:
    """What `normkit.torch._plan.choose` reads of a CUDA tensor, without a GPU."""

    is_meta = False
    device = torch.device("cuda")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def test_auto_takes_the_triton_kernels_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, ``kernel="auto"`` runs the Triton kernels for float32, float16 and bfloat16;
    float64 keeps the composite path, and so do the fields the kernels lack, degenerate rows,
    and a machine without triton."""
    from normkit.torch import _plan
    from normkit.torch import kernels as switch

    def choose(dtype: torch.dtype, spec: NormSpec, n: int) -> str:
        return _plan.choose("auto", _OnCuda(dtype), spec, row_spec(spec, n))  # type: ignore[arg-type]

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert choose(dtype, NormSpec(), 64) == "triton"
        assert choose(dtype, NormSpec("layer", residual="rounded"), 64) == "triton"
        assert choose(dtype, NormSpec(gate="after"), 64) == "triton"
        assert choose(dtype, NormSpec("layer", variance="fast"), 64) == "composite"
        assert choose(dtype, NormSpec("dyt"), 64) == "composite"
        assert choose(dtype, NormSpec(), 1) == "composite"
    assert choose(torch.float64, NormSpec(), 64) == "composite"
    monkeypatch.setattr(switch, "TRITON", False)
    for dtype in (torch.float32, torch.bfloat16):
        assert choose(dtype, NormSpec(), 64) == "composite"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_auto_on_cuda_runs_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from normkit.torch import RMSNorm

    launches = []
    launch = kernels.launch
    monkeypatch.setattr(kernels, "launch", lambda *a, **k: launches.append(1) or launch(
        *a, **k))
    for dtype in (torch.float32, torch.bfloat16):
        launches.clear()
        x = _randn(3, 24, seed=4, dtype=dtype)
        y = RMSNorm(24, 1e-6, device=DEVICE)(x)
        assert launches == [1]
        tolerances.assert_close(to_numpy(y), reference.normalize(to_numpy(x), NormSpec(eps=1e-6)),
                                what="y")


class _OnGpu:
    """A stand-in for a tensor on a CUDA device (the launcher reads its device alone)."""

    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)


def test_a_launch_on_a_gpu_that_is_not_current_makes_it_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triton launches on the current device: rows on cuda:1 with cuda:0 current (a model
    spread over GPUs) are launched with cuda:1 current, and cuda:0 is current again after;
    rows on the current GPU are launched directly."""
    current = [0]

    class Device:  # torch.cuda.device: a GPU made current, the previous one put back
        def __init__(self, device: torch.device) -> None:
            self.index = device.index

        def __enter__(self) -> None:
            self.previous, current[0] = current[0], self.index

        def __exit__(self, *exc: object) -> None:
            current[0] = self.previous

    launched = []

    class Kernel:
        def __getitem__(self, grid: tuple[int]) -> object:
            return lambda *args: launched.append((grid, args, current[0]))

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(kernels, "_traced", lambda x: False)
    kernels._launcher(_OnGpu(1))(Kernel())[(4,)]("x")
    assert launched == [((4,), ("x",), 1)] and current == [0]
    launcher = kernels._launcher(_OnGpu(0))
    assert launcher is kernels._plain_launch or launcher.func is kernels._Direct  # type: ignore[attr-defined]


class _Compiled:
    """A stand-in for Triton's CompiledKernel: its launcher records what it is called with."""

    function = "cu-function"
    packed_metadata = ("packed",)

    def __init__(self) -> None:
        self.runs: list[tuple[object, ...]] = []

    def run(self, *args: object) -> None:
        self.runs.append(args)


class _Jit:
    """A stand-in for a JITFunction: ``kernel[grid](...)`` compiles (once per call here) and
    launches, returning the compiled kernel, as ``JITFunction.run`` does."""

    arg_names = ["X", "n", "eps", "BLOCK", "LAYER"]

    def __init__(self, compiled: _Compiled) -> None:
        self.compiled = compiled
        self.launches: list[tuple[object, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> object:
        def run(*args: object, **kwargs: object) -> _Compiled:
            self.launches.append((grid, args, kwargs))
            return self.compiled

        return run


def test_the_direct_launch_calls_the_compiled_kernels_launcher_as_jit_run_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kernels._Direct` (eager launches on a GPU, Triton 3.6 and 3.9): the first launch of a
    specialization goes through ``JITFunction.run``, which returns the compiled kernel; later
    ones call its launcher with what ``JITFunction.run`` passes it (grid, stream, function,
    packed metadata, launch metadata, hooks, then every argument, constexprs included, in the
    kernel's order). A new specialization (an int that turns a multiple of 16) or a launch
    hook goes through ``JITFunction.run`` again. No GPU is needed: the stream is faked."""
    import triton

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index,
                        raising=False)
    monkeypatch.setattr(kernels, "_COMPILED", {})
    compiled = _Compiled()
    jit = _Jit(compiled)
    x = torch.zeros(16)
    launch = kernels._Direct(2, jit)
    launch[(3,)](x, 8, 1e-6, BLOCK=8, LAYER=True, num_warps=4)
    launch[(5,)](x, 8, 1e-6, BLOCK=8, LAYER=True, num_warps=4)
    assert jit.launches == [((3,), (x, 8, 1e-6), dict(BLOCK=8, LAYER=True, num_warps=4))]
    assert compiled.runs == [
        (5, 1, 1, 1002, "cu-function", ("packed",), None, None, None, x, 8, 1e-6, 8, True)
    ]
    launch[(5,)](x, 16, 1e-6, BLOCK=8, LAYER=True, num_warps=4)  # n % 16 == 0: compiled anew
    assert len(jit.launches) == 2 and len(compiled.runs) == 1
    hooks = triton.knobs.runtime.launch_enter_hook
    monkeypatch.setattr(hooks, "calls", [lambda metadata: None])
    launch[(5,)](x, 8, 1e-6, BLOCK=8, LAYER=True, num_warps=4)  # a profiler's hook: JIT's run
    assert len(jit.launches) == 3 and len(compiled.runs) == 1


def test_the_direct_launch_is_for_the_triton_versions_it_knows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under Triton's interpreter (no compiled kernels) and on Triton versions whose launch
    convention was not checked, kernels launch through ``JITFunction.run``: this test's own
    interpreter runs are that side."""
    import triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not kernels._direct_launch_supported()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for version, supported in (("3.6.0", True), ("3.9.0", True), ("3.9.1+git1234", True),
                               ("3.7.0", False), ("3.5.1", False), ("4.0.0", False)):
        monkeypatch.setattr(triton, "__version__", version)
        assert kernels._direct_launch_supported() is supported, version


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_direct_and_jit_launches_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: a forward and backward launched directly, twice (the second through the
    compiled kernels' launchers), against the same launched through ``JITFunction.run``."""
    from normkit.torch import LayerNorm

    x = _randn(64, 1024, seed=5, dtype=torch.bfloat16)
    dy = _randn(64, 1024, seed=6, dtype=torch.bfloat16)

    def step() -> tuple[torch.Tensor, ...]:
        layer = LayerNorm(1024, device=DEVICE, kernel="triton")
        xl = x.clone().requires_grad_(True)
        y = layer(xl)
        y.backward(dy)
        assert xl.grad is not None and layer.weight.grad is not None
        return y, xl.grad, layer.weight.grad

    assert kernels._direct_launch_supported(), "the GPU machine's Triton has no direct launch"
    monkeypatch.setattr(kernels, "DIRECT_LAUNCH", True)
    runs = [step() for _ in range(3)]
    monkeypatch.setattr(kernels, "DIRECT_LAUNCH", False)
    through_jit = step()
    for run in runs:
        for got, want in zip(run, through_jit, strict=True):
            assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_layer_on_the_second_gpu_runs_there_with_the_first_current() -> None:
    from normkit.torch import RMSNorm

    spec = NormSpec(eps=1e-6)
    x = _randn(3, 24, seed=4).to("cuda:1")
    with torch.cuda.device(0):
        layer = RMSNorm(24, 1e-6, device="cuda:1", kernel="triton")
        xl = x.clone().requires_grad_(True)
        y = layer(xl)
        y.backward(torch.ones_like(y))
    tolerances.assert_close(to_numpy(y), reference.normalize(to_numpy(x), spec), what="y")
    dx = reference.normalize_vjp(to_numpy(x), np.ones((3, 24), np.float32), spec)[0]
    tolerances.assert_close(to_numpy(xl.grad), dx, quantity="grad", what="dx")


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_add_norm_with_kernel_triton_fuses_the_add(
    monkeypatch: pytest.MonkeyPatch, rounding: str
) -> None:
    from normkit.torch.functional import add_norm

    calls = []
    fused = kernels.launch

    def spy(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        assert args[1] is not None  # the residual, added in the kernel
        calls.append(args[5].residual)  # type: ignore[attr-defined]
        return fused(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "launch", spy)
    spec = NormSpec(cast="before_scale", bias=True, residual=rounding)
    x, residual = _randn(2, 3, 16, seed=1, dtype=torch.bfloat16), _randn(2, 3, 16, seed=2)
    residual = residual.to(torch.bfloat16)
    weight, bias = _params(spec, 16, torch.float32, seed=3)
    xl, rl, wl, bl = _leaves(x, residual, weight, bias)
    y, h = add_norm(xl, rl, spec, wl, bl, kernel="triton")
    assert calls == [rounding]
    dy, dh = _randn(2, 3, 16, seed=4, dtype=y.dtype), _randn(2, 3, 16, seed=5, dtype=h.dtype)
    torch.autograd.backward((y, h), (dy, dh))
    xn, rn, wn, bn = to_numpy(x), to_numpy(residual), _np(weight), _np(bias)
    want_y, want_h = reference.add_normalize(xn, rn, spec, wn, bn)
    grads = reference.add_normalize_vjp(xn, rn, to_numpy(dy), to_numpy(dh), spec, wn, bn)
    np.testing.assert_array_equal(to_numpy(h), want_h)
    values = want_h if rounding == "rounded" else xn.astype(np.float32) + rn.astype(np.float32)
    magnitude = reference.scaled_magnitude(values, spec.replace(residual=None), wn)
    tolerances.assert_close(to_numpy(y), want_y, cast=spec.cast, what="y", magnitude=magnitude)
    assert xl.grad is not None and rl.grad is not None and wl is not None and bl is not None
    tolerances.assert_close(to_numpy(xl.grad), grads.dx, quantity="grad", what="dx")
    tolerances.assert_close(to_numpy(rl.grad), grads.dresidual, quantity="grad", what="dres")
    tolerances.assert_close(to_numpy(wl.grad), grads.dscale, quantity="grad", what="dscale")
    tolerances.assert_close(to_numpy(bl.grad), grads.dbias, quantity="grad", what="dbias")


def test_kernel_triton_refuses_the_fields_it_lacks() -> None:
    from normkit.torch.functional import normalize

    x = _randn(2, 8, seed=0)
    with pytest.raises(ValueError, match="kernel='triton' does not compute NormSpec.kind='dyt'"):
        normalize(x, NormSpec("dyt"), kernel="triton")
    with pytest.raises(ValueError, match="does not compute NormSpec.output_dtype='promote'"):
        normalize(x, NormSpec(output_dtype="promote"), kernel="triton")
