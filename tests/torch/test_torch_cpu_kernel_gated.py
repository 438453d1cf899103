"""normkit's CPU kernel on gated and grouped specs against the reference: every gate position,
activation, grouping and cast order in three dtypes with float32 or half parameters and an
offset scale, forward and the gradients of x, the gate, the weight and the bias; groups at
float32's edges beside ordinary ones; the same bits whatever the batch and the thread count;
torch.compile, torch.func and double backward."""

from __future__ import annotations

import collections
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

from normkit import NormSpec, reference
from normkit.conformance import batch_invariance
from normkit.torch._spec import row_spec
from normkit.torch.functional import normalize
from normkit.torch.kernels import cpu
from normkit.torch.modules import GatedRMSNorm
from tests.helpers import gated
from tests.torch import cpu_launches

pytest.importorskip("numba")

DTYPES = {
    "float32": (torch.float32, np.float32),
    "bfloat16": (torch.bfloat16, ml_dtypes.bfloat16),
    "float16": (torch.float16, np.float16),
}
KERNELS = ("gated_forward", "gated_backward")


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """The gated kernels, compiled for every dtype, with their launches counted."""
    return cpu_launches.counted(monkeypatch, KERNELS, gated=(True,))


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.float64)).to(dtype).requires_grad_(True)


def _name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _run(spec: NormSpec, x: np.ndarray, z: np.ndarray, dy: np.ndarray, w: np.ndarray,
         b: np.ndarray | None, dtype: torch.dtype, param_dtype: torch.dtype, kernel: str = "cpu"
         ) -> dict[str, torch.Tensor]:
    """y and the gradients of x, the gate, the weight and the bias from normalize."""
    xt, zt, wt = _tensor(x, dtype), _tensor(z, dtype), _tensor(w, param_dtype)
    bt = None if b is None else _tensor(b, param_dtype)
    y = normalize(xt, spec, wt, bt, gate=zt if spec.gate else None, kernel=kernel)
    y.backward(_tensor(dy, y.dtype).detach())
    found = {"y": y, "dx": xt.grad, "dweight": wt.grad}
    if spec.gate:
        found["dgate"] = zt.grad
    if bt is not None:
        found["dbias"] = bt.grad
    return {k: v for k, v in found.items() if v is not None}


def _check_all(spec: NormSpec, x: np.ndarray, z: np.ndarray, dy: np.ndarray, w: np.ndarray,
               b: np.ndarray | None, found: dict[str, torch.Tensor]) -> None:
    """Every output of `_run` against the reference (`tests.helpers.gated.check`)."""
    gate = z if spec.gate else None
    expected = gated.expected(spec, x, z, dy, w, b)
    assert set(found) == set(expected)
    magnitude = reference.scaled_magnitude(x, spec, w, gate=gate)
    for name, got in found.items():
        gated.check(name, got.detach().double().numpy(), _name(got), expected[name], spec,
                    x.dtype, magnitude if name == "y" else None)


@pytest.mark.parametrize("params", ["float32", "input", "offset"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("spec", gated.specs(), ids=gated.spec_id)
def test_every_gated_spec_matches_the_reference(spec: NormSpec, dtype: str, params: str,
                                                launches: collections.Counter[str]) -> None:
    """``params``: float32 parameters, parameters in x's dtype (with ``gate="after"`` and
    ``"before_scale"`` in a half dtype the affine result is rounded before the gate), or float32
    ones stored with ``scale_offset=1`` (Gemma's w - 1)."""
    torch_dtype, np_dtype = DTYPES[dtype]
    param_dtype, param_np = (torch_dtype, np_dtype) if params == "input" else (torch.float32,
                                                                               np.float32)
    rng = np.random.default_rng(zlib.crc32(f"{gated.spec_id(spec)}-{dtype}-{params}".encode()))
    n = 24
    x = (2 * rng.standard_normal((70, n)) + 0.5).astype(np_dtype)
    z = (2 * rng.standard_normal((70, n))).astype(np_dtype)
    dy = rng.standard_normal((70, n)).astype(np_dtype)
    w = (0.2 * rng.standard_normal(n) + (0.0 if params == "offset" else 1.0)).astype(param_np)
    b = (0.2 * rng.standard_normal(n)).astype(param_np) if spec.bias else None
    if params == "offset":
        spec = spec.replace(scale_offset=1.0)
    _check_all(spec, x, z, dy, w, b, _run(spec, x, z, dy, w, b, torch_dtype, param_dtype))
    assert launches == {name: 1 for name in KERNELS}


def _edge_rows(spec: NormSpec, group: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of four groups: huge values (squares beyond float32) beside tiny ones (squares
    below it) for the RMS kinds, a mean of 1e6 beside a mean of -3e4 for LayerNorm, then two
    ordinary groups."""
    base = rng.standard_normal((5, 4, group))
    if spec.kind == "layer":
        base[:, 0] += 1e6
        base[:, 1] = base[:, 1] * 1e-2 - 3e4
    else:
        base[:, 0] *= 1e37
        base[:, 1] *= 1e-30
    return base.reshape(5, 4 * group).astype(np.float32)


@pytest.mark.parametrize("gate", [None, "before", "after"])
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("outside", [False, True], ids=["inside", "outside"])
def test_groups_at_float32s_edges_beside_ordinary_groups(kind: str, gate: str | None,
                                                         outside: bool,
                                                         launches: collections.Counter[str]
                                                         ) -> None:
    """Each group's statistic is taken again in float64, or its elementwise pass runs in
    float64, as its own values need: the reference's values in every group of the row."""
    spec = NormSpec(kind, gate=gate, gate_activation="silu" if gate else None, group_size=40,
                    eps_placement="outside" if outside else "inside", bias=True)
    rng = np.random.default_rng(5)
    x = _edge_rows(spec, 40, rng)
    z = rng.uniform(-1, 1, x.shape).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(x.shape[1])).astype(np.float32)
    b = (0.2 * rng.standard_normal(x.shape[1])).astype(np.float32)
    found = _run(spec, x, z, dy, w, b, torch.float32, torch.float32)
    assert np.isfinite(found["y"].detach().numpy()).all()
    _check_all(spec, x, z, dy, w, b, found)
    assert launches == {name: 1 for name in KERNELS}


@pytest.mark.parametrize("gate", [None, "before", "after"])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("outside", [False, True], ids=["inside", "outside"])
def test_groups_of_one_or_two_elements(kind: str, group: int, gate: str | None, outside: bool,
                                       launches: collections.Counter[str]) -> None:
    """Degenerate groups (one element for the RMS kinds, two for LayerNorm, whose gradient
    cancels) take the composite path's closed forms, as degenerate rows do; RMS groups of two
    run on the kernel."""
    spec = NormSpec(kind, gate=gate, gate_activation="silu" if gate else None, group_size=group,
                    eps_placement="outside" if outside else "inside", bias=False)
    rng = np.random.default_rng(group)
    x, z, dy = (rng.standard_normal((5, 8)).astype(np.float32) for _ in range(3))
    w = (1 + 0.2 * rng.standard_normal(8)).astype(np.float32)
    _check_all(spec, x, z, dy, w, None, _run(spec, x, z, dy, w, None, torch.float32,
                                             torch.float32))
    degenerate = group <= (2 if kind == "layer" else 1)
    assert launches == ({} if degenerate else {name: 1 for name in KERNELS})


def _gated_rows(spec: NormSpec, n: int, dtype: torch.dtype, kernel: str = "cpu"):
    """``forward(rows) -> rows``: rows of ``[x, z, dy]`` to rows of ``[y, dx, dz]``."""
    weight = torch.linspace(0.5, 1.5, n)

    def forward(rows: np.ndarray) -> np.ndarray:
        x, z, dy = (torch.from_numpy(part).to(dtype) for part in np.split(rows, 3, axis=1))
        x.requires_grad_()
        z.requires_grad_()
        y = normalize(x, spec, weight, gate=z, kernel=kernel)
        y.backward(dy)
        assert x.grad is not None and z.grad is not None
        return torch.cat([y.detach(), x.grad, z.grad], dim=1).float().numpy()

    return forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", [
    NormSpec(gate="before", gate_activation="silu", group_size=64),
    NormSpec("layer", gate="after", gate_activation="sigmoid", cast="before_scale"),
], ids=["rms-before-grouped", "layer-after-before_scale"])
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_thread_count(
        spec: NormSpec, dtype: torch.dtype, launches: collections.Counter[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """y, dx and dz of a row: the same bits in batches of 1 to 509 rows, reversed, at any
    position, and on the calling thread or two in a parallel region (rows of several chunks,
    640 elements; `cpu.SERIAL` set to 0, as the input is smaller); so are the weight's and
    bias's gradients, summed per fixed block of rows."""
    n = 640
    rows = np.random.default_rng(11).standard_normal((509, 3 * n)).astype(np.float32)
    found = batch_invariance.check(_gated_rows(spec, n, dtype), rows)
    assert found.invariant, found.describe()
    monkeypatch.setattr(cpu, "SERIAL", 0)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            xt = torch.from_numpy(rows[:200, :n]).to(dtype).requires_grad_()
            zt = torch.from_numpy(rows[:200, n:2 * n]).to(dtype)
            weight = torch.linspace(0.5, 1.5, n, requires_grad=True)
            bias = torch.linspace(-0.2, 0.2, n, requires_grad=True)
            y = normalize(xt, spec.replace(bias=True), weight, bias, gate=zt, kernel="cpu")
            y.backward(torch.from_numpy(rows[:200, 2 * n:]).to(dtype))
            assert weight.grad is not None and bias.grad is not None and xt.grad is not None
            results.append([t.detach().float().numpy().tobytes()
                            for t in (y, xt.grad, weight.grad, bias.grad)])
    finally:
        torch.set_num_threads(threads)
    assert results[0] == results[1]
    assert launches["gated_forward"] > 0 and launches["gated_backward"] > 0


def test_auto_picks_the_kernel_for_gated_specs(launches: collections.Counter[str]) -> None:
    """``kernel="auto"`` runs the kernel on the CPU, the same bits as ``kernel="cpu"``."""
    spec = NormSpec(gate="after", gate_activation="silu", group_size=8)
    x, z = torch.randn(4, 16), torch.randn(4, 16)
    auto = normalize(x, spec, gate=z)
    assert launches["gated_forward"] == 1
    assert torch.equal(auto, normalize(x, spec, gate=z, kernel="cpu"))


def test_torch_compile_fullgraph_runs_the_gated_kernel(launches: collections.Counter[str]
                                                       ) -> None:
    torch._dynamo.reset()
    module = GatedRMSNorm(32, group_size=8, gate="before", gate_activation="sigmoid",
                          kernel="cpu")
    compiled = torch.compile(module, fullgraph=True)
    rng = np.random.default_rng(9)
    x, z, dy = (rng.standard_normal((6, 32)).astype(ml_dtypes.bfloat16) for _ in range(3))
    xt, zt = _tensor(x, torch.bfloat16), _tensor(z, torch.bfloat16)
    y = compiled(xt, zt)
    y.backward(_tensor(dy, torch.bfloat16).detach())
    assert launches == {name: 1 for name in KERNELS}
    w = module.weight.detach().numpy()
    found = {"y": y, "dx": xt.grad, "dgate": zt.grad, "dweight": module.weight.grad}
    _check_all(module.spec, x, z, dy, w, None, {k: v for k, v in found.items() if v is not None})


def test_torch_func_vmap_and_grad(launches: collections.Counter[str]) -> None:
    """vmap runs the kernel over the batched rows; torch.func.grad differentiates the composite
    graph (as for the ungated kernel), to the same values."""
    from torch.func import grad, vmap

    spec = NormSpec("layer", gate="after", gate_activation="silu", group_size=4)
    rng = np.random.default_rng(3)
    x, z, dy = (rng.standard_normal((3, 5, 16)).astype(np.float32) for _ in range(3))
    xt, zt, dyt = torch.from_numpy(x), torch.from_numpy(z), torch.from_numpy(dy)

    def loss(xx: torch.Tensor, zz: torch.Tensor, dd: torch.Tensor) -> torch.Tensor:
        return (normalize(xx, spec, gate=zz, kernel="cpu") * dd).sum()

    ys = vmap(lambda xx, zz: normalize(xx, spec, gate=zz, kernel="cpu"))(xt, zt)
    gated.check("y", ys.numpy(), "float32", reference.gated_normalize(x, z, spec), spec,
                np.float32)
    dx, dz = vmap(grad(loss, argnums=(0, 1)))(xt, zt, dyt)
    want = reference.gated_normalize_vjp(x, z, dy, spec)
    gated.check("dx", dx.numpy(), "float32", want.dx, spec, np.float32)
    gated.check("dgate", dz.numpy(), "float32", want.dgate, spec, np.float32)
    assert launches["gated_forward"] > 0


def test_double_backward_through_the_composite_graph(launches: collections.Counter[str]
                                                     ) -> None:
    """Under ``create_graph`` the kernel's gradient is the composite graph's (its parameters
    as tensors of ones and -0.0: float32 roundings of another order of operations)."""
    spec = NormSpec(gate="before", gate_activation="silu", group_size=4)
    x0, z0 = torch.randn(4, 8, dtype=torch.float32), torch.randn(4, 8, dtype=torch.float32)
    second = []
    for kernel in ("cpu", "composite"):
        x, z = x0.clone().requires_grad_(), z0.clone().requires_grad_()
        y = normalize(x, spec, gate=z, kernel=kernel)
        gx, gz = torch.autograd.grad(y.pow(2).sum(), (x, z), create_graph=True)
        second.append(torch.autograd.grad((gx.sum() + gz.sum()), (x, z)))
    assert launches["gated_forward"] == 1
    for got, want in zip(*second, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_without_numba_the_gated_ops_compute_with_the_composite_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When the kernels cannot load, the gated ops fall back (with one warning), forward and
    backward, to the reference's values."""
    monkeypatch.setattr(cpu, "_state", {"module": None, "reason": "ImportError: test",
                                        "warned": False, "compiled": {}})
    spec = NormSpec("layer", gate="after", gate_activation="sigmoid", group_size=8,
                    cast="before_scale")
    rng = np.random.default_rng(1)
    x, z, dy = (rng.standard_normal((3, 16)).astype(ml_dtypes.bfloat16) for _ in range(3))
    w = (1 + 0.2 * rng.standard_normal(16)).astype(np.float32)
    b = (0.2 * rng.standard_normal(16)).astype(np.float32)
    with pytest.warns(RuntimeWarning, match="CPU kernel is unavailable"):
        found = _run(spec, x, z, dy, w, b, torch.bfloat16, torch.float32)
    _check_all(spec, x, z, dy, w, b, found)


def test_a_gate_position_without_gate_rows_or_rows_without_one_is_refused():
    x = torch.randn(4, 8)
    rows = row_spec(NormSpec(eps=1e-6, group_size=8), 8)
    with pytest.raises(ValueError, match="gate='after' needs gate rows, and only it"):
        cpu.norm_rows(x, None, None, rows._replace(gate="after"))
    with pytest.raises(ValueError, match="gate=None needs gate rows, and only it"):
        cpu.norm_rows(x, None, None, rows, gate=x)
