"""The fused Triton backward (`normkit.torch.kernels.triton_backward`, NORMKIT_TRITON_BACKWARD=
fused) against normkit.reference, for every option, and against the default backward.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set
here before triton is imported); with one they are compiled and run on it. Rows longer than
one slice are tested at small n by making `SLICE_MAX` small. Shapes stay tiny: the
interpreter executes every program in Python.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
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

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.bridges import TorchBridge  # noqa: E402
from normkit.torch.functional import add_norm, normalize  # noqa: E402
from normkit.torch.kernels import triton as kernels  # noqa: E402
from normkit.torch.kernels import triton_backward as fused  # noqa: E402
from tests.torch.test_torch_triton_kernel import (  # noqa: E402
    _leaves,
    _np,
    _params,
    _PassThrough,
    _randn,
)

to_numpy = TorchBridge().to_numpy

DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and TRITON_INTERPRET is not 1 (Triton's interpreter is off)",
                allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = [dict(kind="rms"), dict(kind="partial_rms", p=0.3), dict(kind="layer")]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The fused backward selected (as NORMKIT_TRITON_BACKWARD=fused does); each of its calls
    is recorded, and `SLICE_MAX` is 16, so that rows past 16 elements are cut into slices."""
    recorded: list[int] = []
    backward_rows = fused.backward_rows

    def spy(*args: object, **kwargs: object) -> object:
        recorded.append(1)
        return backward_rows(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused, "FUSED", True)
    monkeypatch.setattr(fused, "backward_rows", spy)
    monkeypatch.setattr(fused, "SLICE_MAX", 16)
    return recorded


def _gradients(
    spec: NormSpec, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    dy: torch.Tensor, gate: torch.Tensor | None = None,
) -> list[torch.Tensor | None]:
    """dx, dweight, dbias (and dgate) of ``normalize(kernel="triton")`` for ``dy``."""
    leaves = _leaves(x, weight, bias, gate)
    xl, wl, bl, zl = leaves
    assert xl is not None
    normalize(xl, spec, wl, bl, kernel="triton", gate=zl).backward(dy)
    return [None if leaf is None else leaf.grad for leaf in leaves]


def _check(spec: NormSpec, x: torch.Tensor, weight: torch.Tensor | None,
           bias: torch.Tensor | None, calls: list[int], seed: int = 7,
           dy: torch.Tensor | None = None) -> None:
    """The gradients through the fused backward against reference.normalize_vjp."""
    dy = _randn(*x.shape, seed=seed, dtype=x.dtype) if dy is None else dy
    got = _gradients(spec, x, weight, bias, dy)
    assert calls, "the fused backward did not run"
    want = reference.normalize_vjp(_np(x), _np(dy), spec, _np(weight), _np(bias))
    for name, grad, expected in zip(("dx", "dweight", "dbias"), got, want, strict=False):
        if expected is None or (name != "dx" and grad is None):
            continue
        assert grad is not None, name
        tolerances.assert_close(to_numpy(grad), expected, quantity="grad", what=name)


def _every_option() -> Iterator[tuple[NormSpec, torch.dtype, int]]:
    """Each kind and eps placement; the dtype (each twice), the offset, a bias, the cast order,
    the parameters' dtype and the row length (one slice, or two) vary across the cases."""
    for case, (kind, placement) in enumerate(
        (kind, placement) for kind in KINDS for placement in ("inside", "outside")
    ):
        spec = NormSpec(**kind, eps_placement=placement, scale_offset=float(case % 2),
                        bias=case % 3 != 1, cast=("after_scale", "before_scale")[case // 3])
        yield spec, DTYPES[case % 3], case


OPTIONS = list(_every_option())


@pytest.mark.parametrize(
    "spec, dtype, case", OPTIONS,
    ids=[f"{s.kind}-{s.eps_placement}-{str(d)[6:]}" for s, d, _ in OPTIONS],
)
def test_every_kind_placement_and_dtype(
    calls: list[int], spec: NormSpec, dtype: torch.dtype, case: int
) -> None:
    n = (12, 24)[case % 2]  # one slice of 16, or two
    param_dtype = (torch.float32, dtype)[case // 2 % 2]
    _check(spec, _randn(5, n, seed=case, dtype=dtype), *_params(spec, n, param_dtype, case),
           calls, seed=case)


@pytest.mark.parametrize("kind, n", [("rms", 2), ("layer", 3), ("layer", 7)])
def test_short_rows(calls: list[int], kind: str, n: int) -> None:
    """The shortest rows the kernels take (shorter ones take the composite path)."""
    spec = NormSpec(kind, bias=True)
    x = _randn(3, n, seed=n, dtype=torch.bfloat16)
    _check(spec, x, *_params(spec, n, torch.float32, n), calls)


@pytest.mark.parametrize("placement, n", [("inside", 16), ("outside", 24)],
                         ids=["inside-one-slice", "outside-two-slices"])
def test_partial_rms_with_k_1(calls: list[int], placement: str, n: int) -> None:
    """dx_0 in the closed form, with the other slice's part of its sum."""
    spec = NormSpec(kind="partial_rms", p=1 / n, eps_placement=placement)
    assert spec.stat_size(n) == 1
    _check(spec, _randn(3, n, seed=2) * 1e3, *_params(spec, n, torch.float32, 2), calls)


SCALES = [1e-30, 1e-25, 1e-12, 1.0, 1e20, 1e37]


@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
# The interpreter squares the huge rows in numpy, which warns before the kernel rescales them.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_rows_of_every_scale_side_by_side(calls: list[int], kind: dict, placement: str) -> None:
    """Rows of scale 1e-30 to 1e37 in one batch: squares that flush to zero (eps outside's
    x_i / sqrt(s) from the row rescaled), squares that overflow (the statistic rescaled), and
    LayerNorm's large mean, each on its own row, and the weight's sum over all of them."""
    spec = NormSpec(**kind, eps=1e-5, eps_placement=placement, bias=True)
    n = 16 if placement == "inside" else 24  # one slice, or two
    x = _randn(len(SCALES) + 1, n, seed=3).double()
    x[:-1] *= torch.tensor(SCALES, dtype=torch.float64, device=DEVICE)[:, None]
    x[-1] += 1e4  # a large mean with unit spread
    _check(spec, x.float(), *_params(spec, n, torch.float32, 3), calls)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_and_inf_stay_in_their_rows(calls: list[int], kind: dict) -> None:
    """A NaN and an infinity each make their own row's dx NaN where the reference's is, and
    leave every other row's dx as the reference's."""
    spec = NormSpec(**kind, eps_placement="outside" if kind["kind"] == "layer" else "inside")
    n = 16 if kind["kind"] == "rms" else 24  # one slice, or two
    x = _randn(5, n, seed=4)
    x[1, 3] = float("nan")
    x[3, 0] = float("inf")
    dy = _randn(5, n, seed=5)
    dx, _, _, _ = _gradients(spec, x, None, None, dy)
    assert calls and dx is not None
    want = reference.normalize_vjp(_np(x), _np(dy), spec)[0]
    got = to_numpy(dx)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert not np.isfinite(want[[1, 3]]).all(axis=1).any()
    tolerances.assert_close(got[[0, 2, 4]], want[[0, 2, 4]], quantity="grad", what="dx")


GATED = [
    NormSpec("rms", gate="before", gate_activation="silu"),
    NormSpec("rms", gate="after", gate_activation="sigmoid", group_size=4, bias=True),
    NormSpec("layer", gate="before", gate_activation="sigmoid", group_size=8,
             eps_placement="outside"),
    NormSpec("layer", gate="after", gate_activation="silu", bias=True, cast="before_scale"),
    NormSpec("rms", group_size=8, eps_placement="outside"),
    NormSpec("partial_rms", p=0.5, gate="after", gate_activation="silu"),
]


@pytest.mark.parametrize("spec", GATED, ids=lambda s: f"{s.kind}-{s.gate}-g{s.group_size}")
def test_gates_and_groups(calls: list[int], spec: NormSpec) -> None:
    """dx, dz, dw and db against reference.gated_normalize_vjp (normalize_vjp for groups alone)
    on rows of 24: groups of 4 and 8 are one slice each, an ungrouped row two; float32 and
    bfloat16 alternately."""
    n = 24
    dtype = (torch.float32, torch.bfloat16)[GATED.index(spec) % 2]
    rng = np.random.default_rng(11)
    x = torch.from_numpy(2 * rng.standard_normal((3, n)) + 0.5).to(dtype).to(DEVICE)
    z = torch.from_numpy(2 * rng.standard_normal((3, n))).to(dtype).to(DEVICE)
    weight, bias = _params(spec, n, torch.float32, 12)
    dy = _randn(3, n, seed=13, dtype=dtype)
    dx, dw, db, dz = _gradients(spec, x, weight, bias, dy, gate=z if spec.gate else None)
    assert calls
    xn, zn, dyn, wn, bn = _np(x), _np(z), _np(dy), _np(weight), _np(bias)
    if spec.gate:
        grads = reference.gated_normalize_vjp(xn, zn, dyn, spec, wn, bn)
        assert dz is not None
        tolerances.assert_close(to_numpy(dz), grads.dgate, quantity="grad", what="dgate")
    else:
        grads = reference.normalize_vjp(xn, dyn, spec, wn, bn)
    for name, got, want in (("dx", dx, grads.dx), ("dweight", dw, grads.dscale),
                            ("dbias", db, grads.dbias)):
        if want is not None:
            assert got is not None, name
            tolerances.assert_close(to_numpy(got), want, quantity="grad", what=name)


@pytest.mark.parametrize("rounding", ["rounded", "float32", "float32_normalized"])
def test_the_residual_add_with_dh(calls: list[int], rounding: str) -> None:
    """dx = dresidual = the norm's gradient at h plus dh, in each rounding of h (which the
    backward reads as h, or as x and the residual for "float32_normalized")."""
    n = 16 if rounding == "rounded" else 24  # one slice, or two
    spec = NormSpec("layer" if rounding == "float32" else "rms", bias=True, residual=rounding)
    x, residual = _randn(4, n, seed=1, dtype=torch.bfloat16), _randn(4, n, seed=2) * 4
    residual = residual.to(torch.bfloat16)
    weight, bias = _params(spec, n, torch.float32, 3)
    xl, rl, wl, bl = _leaves(x, residual, weight, bias)
    assert xl is not None and rl is not None
    y, h = add_norm(xl, rl, spec, wl, bl, kernel="triton")
    dy, dh = _randn(4, n, seed=4, dtype=y.dtype), _randn(4, n, seed=5, dtype=h.dtype)
    torch.autograd.backward((y, h), (dy, dh))
    assert calls
    xn, rn, wn, bn = _np(x), _np(residual), _np(weight), _np(bias)
    grads = reference.add_normalize_vjp(xn, rn, _np(dy), _np(dh), spec, wn, bn)
    assert xl.grad is not None and rl.grad is not None and torch.equal(xl.grad, rl.grad)
    assert wl is not None and wl.grad is not None and bl is not None and bl.grad is not None
    tolerances.assert_close(to_numpy(xl.grad), grads.dx, quantity="grad", what="dx")
    tolerances.assert_close(to_numpy(wl.grad), grads.dscale, quantity="grad", what="dscale")
    tolerances.assert_close(to_numpy(bl.grad), grads.dbias, quantity="grad", what="dbias")


def _backward_args(spec: NormSpec, rows: int, n: int, seed: int) -> tuple[object, ...]:
    """`triton._backward_rows`' arguments for ``spec`` (RMSNorm or LayerNorm, eps inside) on
    float32 rows (rows, n), with the saved r(s) computed in float64."""
    x = _randn(rows, n, seed=seed) * 3 + 1
    weight, bias = _params(spec, n, torch.float32, seed)
    wide = x.double()
    if spec.kind == "layer":
        wide = wide - wide.mean(dim=1, keepdim=True)
    r = torch.rsqrt((wide * wide).mean(dim=1) + spec.eps).float()
    dy = _randn(rows, n, seed=seed + 10)
    return (x, None, None, r, dy, None, weight, None, None if bias is None else bias.dtype,
            spec.kind, n, spec.eps, False, 0.0, n, "none", "none", 0, x.dtype, True, True)


@pytest.mark.parametrize("spec, n", [(NormSpec(), 16), (NormSpec(kind="layer", bias=True), 24)],
                         ids=["rms-one-slice", "layer-two-slices"])
def test_weight_gradients_are_deterministic_and_the_default_backwards_sums(
    monkeypatch: pytest.MonkeyPatch, spec: NormSpec, n: int
) -> None:
    """Two calls give the same bits; dw and db differ from the default backward's only by the
    order of float32 sums: at most 2 (rows + 2) 2**-24 sum |term| apart (each sum's error is
    below (rows - 1) 2**-24 sum |term|, and the terms' own roundings differ by an ulp or two),
    and both are within the reference's tolerance."""
    monkeypatch.setattr(fused, "SLICE_MAX", 16)
    rows = 11  # 3 programs a slice: 4, 4 and 3 rows
    args = _backward_args(spec, rows, n, seed=8)
    first, second = fused.backward_rows(*args), fused.backward_rows(*args)  # type: ignore[arg-type]
    for got, again in zip(first, second, strict=True):
        assert torch.equal(got, again)
    default = kernels._backward_rows(*args)  # type: ignore[arg-type]
    x, dy, weight = args[0], args[4], args[6]
    assert isinstance(x, torch.Tensor) and isinstance(dy, torch.Tensor)
    xn, dyn = to_numpy(x).astype(np.float64), to_numpy(dy).astype(np.float64)
    y_hat = reference.normalize(xn, spec.replace(scale=False, bias=False))
    dx, dw, db = reference.normalize_vjp(xn, dyn, spec.replace(bias=True), _np(weight),
                                         np.zeros(n))
    for name, index, terms, expected in (("dw", 2, dyn * y_hat, dw), ("db", 3, dyn, db)):
        if not default[index].numel():
            continue
        bound = 2 * (rows + 2) * 2.0**-24 * np.abs(terms).sum(axis=0)
        gap = np.abs(to_numpy(first[index]).astype(np.float64) - to_numpy(default[index]))
        assert (gap <= bound).all(), (name, (gap / bound).max())
        tolerances.assert_close(to_numpy(first[index]), expected, quantity="grad", what=name)
    tolerances.assert_close(to_numpy(first[0]), dx, quantity="grad", what="dx")


def test_no_rows_and_fewer_rows_than_programs(calls: list[int]) -> None:
    """A batch of no rows gives zero weight and bias gradients (nothing launched); one row
    takes one program per slice."""
    spec = NormSpec(kind="layer", bias=True)
    _check(spec, _randn(0, 24, seed=1), *_params(spec, 24, torch.float32, 1), calls)
    calls.clear()
    _check(spec, _randn(1, 24, seed=2), *_params(spec, 24, torch.float32, 2), calls)


@pytest.mark.parametrize("spec", [NormSpec(kind="layer", bias=True), NormSpec(scale=False)],
                         ids=["layer-bias", "rms-no-parameters"])
def test_through_the_custom_op_the_same_bits(calls: list[int], spec: NormSpec) -> None:
    """Traced calls reach the fused backward through ``normkit::triton_norm_rows_backward``
    (launched by ``wrap_triton``, without a register limit): the same gradients as eager.
    Without parameters its dw and db are two empty tensors (a custom op's outputs may not
    alias)."""
    x = _randn(3, 24, seed=1, dtype=torch.bfloat16)
    weight, bias = _params(spec, 24, torch.float32, 2)
    dy = _randn(3, 24, seed=3, dtype=torch.bfloat16)
    eager = _gradients(spec, x, weight, bias, dy)
    with _PassThrough():
        traced = _gradients(spec, x, weight, bias, dy)
    assert len(calls) == 2
    for got, want in zip(traced[:3], eager[:3], strict=True):
        assert (got is None) == (want is None)
        assert got is None or want is None or torch.equal(got, want)


def test_the_variable_selects_the_fused_backward_or_names_the_problem() -> None:
    assert fused._selected("fused") is True
    assert fused._selected("") is False
    with pytest.raises(ValueError, match="NORMKIT_TRITON_BACKWARD='fast' is invalid"):
        fused._selected("fast")


def test_the_launch_configuration_fits_a_multiprocessor() -> None:
    """Slices of a power of two that cover the row with as few as `SLICE_MAX` allows; the
    programs of a multiprocessor fit its 65536 registers and 2048 threads (one wave)."""
    for n in (1, 24, 1000, 4096, 8192, 8193, 16384, 20000, 65536):
        for x_bytes in (2, 4):
            c = fused.config(n, x_bytes)
            assert c.slice & (c.slice - 1) == 0 and c.slice <= fused.SLICE_MAX
            assert c.split == -(-n // fused.SLICE_MAX) and c.slice * (c.split - 1) < n
            assert c.slice * c.split >= n
            threads = 32 * c.num_warps * c.per_sm
            assert threads <= 2048 and c.max_registers * threads <= 65536
            assert c.max_registers >= 128


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from normkit.torch.kernels import triton_backward as fused

def signature(fn, pointers, scalars):
    return {name: pointers.get(name, scalars.get(name, "constexpr")) for name in fn.arg_names}

half = {name: "*bf16" for name in ("X", "RES", "Z", "DY", "DH", "DX", "DZ", "W", "B")}
pointers = {**half, "R": "*fp32", "PART": "*fp32"}
# torch.compile's Inductor passes Python floats as float64 (a launch as float32).
scalars = {"rows": "i32", "n": "i32", "k": "i32", "groups": "i32", "eps": "fp64",
           "scale_offset": "fp64"}
base = dict(HAS_W=True, NEED_DW=True, NEED_DB=True, HAS_DH=False, RESIDUAL=0, GATE_IN="none",
            GATE_OUT="none", PREFETCH=True)
variants = [
    dict(LAYER=True, OUTSIDE=True, PARTIAL=False, HAS_B=True, SPLIT=1, SLICE=4096),
    dict(LAYER=True, OUTSIDE=False, PARTIAL=False, HAS_B=False, SPLIT=2, SLICE=8192,
         RESIDUAL=3, HAS_DH=True),
    dict(LAYER=False, OUTSIDE=True, PARTIAL=True, HAS_B=False, SPLIT=2, SLICE=1024,
         GATE_IN="silu", PREFETCH=False, NEED_DB=False),
    dict(LAYER=False, OUTSIDE=False, PARTIAL=False, HAS_B=True, SPLIT=1, SLICE=256,
         GATE_OUT="sigmoid"),
]
target = GPUTarget("cuda", 90, 32)
for variant in variants:
    constexprs = {**base, **variant}
    source = ASTSource(fused._backward_kernel, signature(fused._backward_kernel, pointers,
                       scalars), constexprs)
    assert compile(source, target=target, options={"num_warps": 8, "maxnreg": 128}).asm["cubin"]
sums = ASTSource(fused._column_sums_kernel, signature(fused._column_sums_kernel,
                 {"PART": "*fp32", "DW": "*bf16", "DB": "*fp32"},
                 {"parts": "i32", "n": "i32", "width": "i32"}),
                 dict(HAS_DW=True, BLOCK_P=256, BLOCK_N=64))
assert compile(sums, target=target, options={"num_warps": 8}).asm["cubin"]
print("compiled", len(variants) + 1)
"""


def test_the_kernels_compile_for_sm_90() -> None:
    """Triton's compiler, which type-checks and lowers the kernels as the interpreter does not,
    on variants with every feature on, in a fresh Python without TRITON_INTERPRET."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 5" in done.stdout



def test_the_sweeps_backward_part_runs_at_a_tiny_shape(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """scripts/triton_sweep.py's backward part (which the GPU check runs once, at the large
    shapes) at one tiny shape, in Triton's interpreter without a GPU: every variant runs, the
    fused backward passes its checks, and the records the GPU run is read by are written."""
    monkeypatch.setattr(fused, "SLICE_MAX", 8)  # rows of 16 in two slices, as at 16384
    path = pathlib.Path(__file__).parents[2] / "scripts" / "triton_sweep.py"
    loaded = importlib.util.spec_from_file_location("triton_sweep", path)
    assert loaded is not None and loaded.loader is not None
    sweep = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(sweep)
    out = tmp_path / "sweep.jsonl"
    sweep.backward(sweep.Log(str(out)), device=DEVICE, shapes=((6, 16),),
                   dtypes=(torch.bfloat16,), kinds=("layer",), calls=1, latency_calls=1,
                   workers=0)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    check = next(r for r in records if r.get("what") == "backward check")
    assert check["passed"] and check["bit_identical"], check
    timed = {r["impl"]: r for r in records if r.get("what") == "backward"}
    assert set(timed) == {"default", "fused", "fused, no prefetch",
                          "fused, 8 programs a multiprocessor", "fused, slices of half"}
    for name in ("default", "fused"):
        assert {"throughput_us", "latency_us", "of_floor"} <= set(timed[name])
    summary = next(r for r in records if r.get("what") == "backward summary")
    assert summary["cases"][0]["speedup"] > 0


def test_a_backward_launches_two_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward kernel, then one sum of the weight and bias gradients together."""
    kernel_type = type(fused._backward_kernel)
    run = kernel_type.run
    launched: list[object] = []

    def counted(self: object, *args: object, **kwargs: object) -> object:
        launched.append(self)
        return run(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel_type, "run", counted)
    args = _backward_args(NormSpec("layer", bias=True), 5, 24, seed=1)
    fused.backward_rows(*args)  # type: ignore[arg-type]
    assert launched == [fused._backward_kernel, fused._column_sums_kernel]
