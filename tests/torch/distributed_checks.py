"""Per-rank checks of normkit.torch under torch.distributed, for test_torch_distributed.py.

``python tests/torch/distributed_checks.py GROUP RANK PORT`` is one of 4 CPU ranks (gloo, a
TCPStore on 127.0.0.1:PORT); every rank runs the group's checks and rank 0 prints
``PASSED <check>`` for each, then ``ALL <n> CHECKS PASSED``. A failing check raises on its rank,
which exits non-zero with that traceback. Every result is
compared with `normkit.reference` (and the single-process normkit result) under
`normkit.tolerances`; model training is compared with the same model trained in one process.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import normkit.torch as nt
from normkit import NormSpec, reference, tolerances
from normkit.bridges import TorchBridge
from normkit.torch import functional as F
from normkit.torch.distributed import normalize_sharded, register_row_sharding

to_numpy = TorchBridge().to_numpy

WORLD = 4
TIMEOUT = timedelta(seconds=60)
DTYPES = (torch.float32, torch.bfloat16)


class Checks:
    """Runs named checks on every rank; rank 0 reports each one that passed on all ranks."""

    def __init__(self) -> None:
        self.passed = 0

    @contextmanager
    def check(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        dist.barrier()
        self.passed += 1
        if dist.get_rank() == 0:
            print(f"PASSED {name} ({time.perf_counter() - start:.2f} s)", flush=True)


def _dist(t: torch.Tensor, mesh: DeviceMesh, placements: list[Any]) -> DTensor:
    """``t`` (the same on every rank) as a DTensor: each rank keeps its block, no communication."""
    return distribute_tensor(t, mesh, placements, src_data_rank=None)


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    if t is None:
        return None
    return to_numpy(t.full_tensor() if isinstance(t, DTensor) else t)


def _params(spec: NormSpec, n: int, seed: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    w = _randn(n, seed=seed) * 0.5 + spec.scale_init if spec.scale else None
    b = _randn(n, seed=seed + 1) * 0.5 if spec.bias else None
    return w, b


def assert_matches_reference(
    spec: NormSpec,
    x: torch.Tensor,
    dy: torch.Tensor,
    w: torch.Tensor | None,
    b: torch.Tensor | None,
    y: torch.Tensor,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    what: str,
    grad_factor: float = 1.0,
) -> None:
    """``y`` and ``grads`` (dx, dw, db; DTensors gathered) against the reference on global data.

    ``grad_factor`` multiplies the parameter gradients first (FSDP2 averages them over ranks).
    """
    xs, ws, bs = _np(x), _np(w), _np(b)
    magnitude = reference.scaled_magnitude(xs, spec, ws) if spec.cast == "before_scale" else None
    tolerances.assert_close(
        _np(y), reference.normalize(xs, spec, ws, bs), cast=spec.cast, what=f"{what} y",
        magnitude=magnitude,
    )
    expected = reference.normalize_vjp(xs, _np(dy), spec, ws, bs)
    for name, got, want, factor in zip(
        ("dx", "dw", "db"), grads, expected, (1.0, grad_factor, grad_factor), strict=True
    ):
        if want is None or (name == "dx" and got is None):
            continue
        assert got is not None, f"{what}: {name} is missing"
        actual = _np(got)
        assert actual is not None
        tolerances.assert_close(
            actual.astype(np.float64) * factor, want, dtype=actual.dtype, quantity="grad",
            what=f"{what} {name}",
        )


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_(True)


def _grad(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.grad


# --- the sharded normalized axis ----------------------------------------------------------------


def sharded_specs() -> Iterator[tuple[NormSpec, torch.dtype]]:
    """Every kind (partial RMS with k inside the first shard and across shards) and placement,
    float32 and bfloat16, offsets and cast orders alternating."""
    kinds: list[dict[str, Any]] = [
        {"kind": "rms"},
        {"kind": "partial_rms", "p": 0.125},  # k = 8 of 64: inside rank 0's block of 16
        {"kind": "partial_rms", "p": 0.3},  # k = 19: rank 0's block and 3 of rank 1's
        {"kind": "layer"},
    ]
    combos = itertools.product(kinds, ("inside", "outside"), DTYPES)
    for i, (kind, placement, dtype) in enumerate(combos):
        cast = "before_scale" if i % 4 >= 2 else "after_scale"
        spec = NormSpec(
            **kind, eps_placement=placement, scale_offset=float(i % 2), bias=True, cast=cast
        )
        yield spec, dtype


def check_dtensor(
    spec: NormSpec,
    dtype: torch.dtype,
    mesh: DeviceMesh,
    shape: tuple[int, ...],
    x_placements: list[Any],
    param_placements: list[Any],
    seed: int,
) -> None:
    """normalize_sharded on a DTensor and F.normalize in one process, against the reference."""
    n = shape[-1]
    x, dy = _randn(*shape, seed=seed, dtype=dtype), _randn(*shape, seed=seed + 1, dtype=dtype)
    w, b = _params(spec, n, seed + 2)
    xd = _leaf(_dist(x, mesh, x_placements))
    wd, bd = (_leaf(None if p is None else _dist(p, mesh, param_placements))
              for p in (w, b))
    y = normalize_sharded(xd, spec, wd, bd)
    assert isinstance(y, DTensor) and tuple(y.placements) == tuple(x_placements), y
    y.backward(_dist(dy, mesh, x_placements))
    what = f"sharded {spec} {dtype} {x_placements} weight {param_placements}"
    assert_matches_reference(spec, x, dy, w, b, y, (_grad(xd), _grad(wd), _grad(bd)), what)
    xl, wl, bl = _leaf(x), _leaf(w), _leaf(b)
    yl = F.normalize(xl, spec, wl, bl)
    yl.backward(dy)
    grads = (_grad(xl), _grad(wl), _grad(bl))
    assert_matches_reference(spec, x, dy, w, b, yl, grads, f"one process {spec} {dtype}")


def check_plain_group(
    spec: NormSpec, seed: int, scale: float = 1.0, shift: float = 0.0
) -> None:
    """normalize_sharded on each rank's block of plain tensors with the default group, on rows
    ``x scale + shift``."""
    rank = dist.get_rank()
    x, dy = _randn(6, 64, seed=seed) * scale + shift, _randn(6, 64, seed=seed + 1)
    w, b = _params(spec, 64, seed + 2)
    blocks = [_leaf(None if t is None else t.chunk(WORLD, -1)[rank]) for t in (x, w, b)]
    y = normalize_sharded(blocks[0], spec, blocks[1], blocks[2])
    y.backward(dy.chunk(WORLD, -1)[rank])

    def gather(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        parts = [torch.empty_like(t) for _ in range(WORLD)]
        dist.all_gather(parts, t.detach().contiguous())
        return torch.cat(parts, -1)

    grads = tuple(gather(_grad(t)) for t in blocks)
    assert_matches_reference(spec, x, dy, w, b, gather(y), grads, f"plain group {spec}")  # type: ignore[arg-type]


def check_module_routes_sharded_dtensor(mesh: DeviceMesh) -> None:
    """A PartialRMSNorm module given a DTensor sharded on its normalized dim reduces across it."""
    norm = nt.PartialRMSNorm(64, p=0.3, bias=True)
    with torch.no_grad():
        norm.weight.copy_(_randn(64, seed=7) * 0.5 + 1)
    w, b = norm.weight.detach().clone(), norm.bias.detach().clone()

    def shard_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(_dist(param, mesh, [Shard(0)]))
            module.register_parameter(pname, sharded)

    distribute_module(norm, mesh, shard_params)
    x, dy = _randn(5, 64, seed=8), _randn(5, 64, seed=9)
    xd = _leaf(_dist(x, mesh, [Shard(1)]))
    y = norm(xd)
    y.backward(_dist(dy, mesh, [Shard(1)]))
    grads = (_grad(xd), norm.weight.grad, norm.bias.grad)
    assert_matches_reference(norm.spec, x, dy, w, b, y, grads, "module on a sharded row")


def check_errors(mesh: DeviceMesh, mesh2d: DeviceMesh) -> None:
    spec = NormSpec(kind="rms")
    x = _dist(_randn(4, 8, seed=0), mesh, [Shard(1)])
    with pytest.raises(ValueError, match="group= is for plain tensors"):
        normalize_sharded(x, spec, group=dist.group.WORLD)
    with pytest.raises(TypeError, match="weight must be a DTensor on x's device mesh"):
        normalize_sharded(x, spec, torch.ones(8))
    partial = DTensor.from_local(torch.ones(4, 8), mesh, [Partial()])
    with pytest.raises(ValueError, match=r"placement P\(sum\) on mesh dim 0: redistribute"):
        normalize_sharded(partial, spec)
    two = _dist(_randn(4, 8, 8, seed=1), mesh2d, [Shard(1), Shard(2)])
    with pytest.raises(ValueError, match="over 2 mesh dims"):
        normalize_sharded(two, NormSpec(kind="layer", axis=(-2, -1)))
    rows = _dist(_randn(4, 8, seed=2), mesh2d, [Shard(0), Shard(1)])
    wrong = _dist(torch.ones(8), mesh2d, [Shard(0), Shard(0)])
    message = r"weight has the placement S\(0\) on mesh dim 0: expected Replicate$"
    with pytest.raises(ValueError, match=message):
        normalize_sharded(rows, spec, wrong)
    with pytest.raises(ValueError, match="needs a single normalized axis"):
        normalize_sharded(two, NormSpec(kind="partial_rms", p=0.5, axis=(-2, -1)))


# A row-wise custom op with the kernels' calling convention, and its backward as an op.
@torch.library.custom_op("normkit_checks::rms_rows", mutates_args=())
def rms_rows(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.rsqrt(x.pow(2).mean(-1) + eps)
    y = x * r[:, None]
    return (y * weight if weight is not None else y), r


@rms_rows.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(x.shape[0])


@torch.library.custom_op("normkit_checks::rms_rows_backward", mutates_args=())
def rms_rows_backward(
    dy: torch.Tensor, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    d = dy * weight
    rc = r[:, None]
    dx = rc * d - x * (rc**3) * (d * x).mean(-1, keepdim=True)
    return dx, (dy * x * rc).sum(0)


@rms_rows_backward.register_fake
def _(
    dy: torch.Tensor, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_rows_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    ctx.save_for_backward(inputs[0], output[1], inputs[1])


def _rms_rows_grad(ctx: Any, dy: torch.Tensor, _dr: torch.Tensor) -> tuple[Any, ...]:
    x, r, weight = ctx.saved_tensors
    dx, dw = torch.ops.normkit_checks.rms_rows_backward(dy, x, r, weight)
    return dx, dw, None


rms_rows.register_autograd(_rms_rows_grad, setup_context=_rms_rows_setup)


def check_registered_op(mesh: DeviceMesh) -> None:
    """DTensors through a custom row op once register_row_sharding gave it rules."""
    spec = NormSpec(kind="rms", eps=1e-5)
    x, dy = _randn(8, 12, seed=3), _randn(8, 12, seed=4)
    w = _randn(12, seed=5) * 0.5 + 1
    ops = torch.ops.normkit_checks
    forward, backward = ops.rms_rows, ops.rms_rows_backward
    with pytest.raises(NotImplementedError, match="rms_rows"):
        forward(_dist(x, mesh, [Shard(0)]), None, 1e-5)
    register_row_sharding(forward.default)
    register_row_sharding(backward.default, summed_outputs=(1,))
    for placement in (Shard(0), Shard(1), Replicate()):
        xd = _leaf(_dist(x, mesh, [placement]))
        wd = _leaf(_dist(w, mesh, [Replicate()]))
        y, _ = forward(xd, wd, spec.eps)
        rows = Shard(0) if placement == Shard(0) else Replicate()
        assert tuple(y.placements) == (rows,), y.placements
        y.backward(_dist(dy, mesh, [rows]))
        grads = (_grad(xd), _grad(wd), None)
        assert_matches_reference(spec, x, dy, w, None, y, grads, f"custom op {placement}")
    y_plain, _ = forward(_dist(x, mesh, [Shard(0)]), None, spec.eps)
    expected = reference.normalize(to_numpy(x), spec.replace(scale=False))
    tolerances.assert_close(_np(y_plain), expected, what="custom op without weight")


def check_first_element_alone(placement: str) -> None:
    """Partial RMS whose statistic reads the first element alone (k = 1 of 64, on rank 0), on
    rows whose other elements are 0: dx_0 = dy_0 eps r**3 (inside), which the difference
    ``1 - x_0**2 r**2`` of float32 values lost to rounding."""
    rank = dist.get_rank()
    spec = NormSpec(kind="partial_rms", p=1 / 64, eps_placement=placement)
    x = torch.zeros(3, 64)
    x[:, 0] = torch.tensor([1.0, -3.0, 0.25])
    dy = torch.zeros(3, 64)
    dy[:, 0] = torch.tensor([1.0, 2.0, -0.5])
    block = _leaf(x.chunk(WORLD, -1)[rank])
    y = normalize_sharded(block, spec)
    y.backward(dy.chunk(WORLD, -1)[rank])
    assert block.grad is not None
    parts = [torch.empty_like(block.grad) for _ in range(WORLD)]
    dist.all_gather(parts, block.grad.contiguous())
    dx = reference.normalize_vjp(_np(x), _np(dy), spec)[0]
    tolerances.assert_close(_np(torch.cat(parts, -1)), dx, quantity="grad",
                            what=f"dx of k = 1 {placement}")


#: Sharded rows whose squares overflow or underflow float32, or whose mean dwarfs their spread:
#: (spec, scale, shift) of ``x scale + shift``.
EXTREME_ROWS = [
    (NormSpec(kind="rms", bias=True), 1e30, 0.0),
    (NormSpec(kind="partial_rms", p=0.3, eps_placement="outside"), 1e-30, 0.0),
    (NormSpec(kind="layer"), 1e25, 0.0),
    (NormSpec(kind="layer", eps_placement="outside"), 1.0, 1e6),
]


def group_sharded(checks: Checks) -> None:
    mesh = init_device_mesh("cpu", (WORLD,))
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for i, (spec, dtype) in enumerate(sharded_specs()):
        layout = [Shard(0)] if i % 3 else [Replicate()]
        with checks.check(f"sharded {spec.kind} p={spec.p} {spec.eps_placement} {dtype}"):
            check_dtensor(spec, dtype, mesh, (3, 5, 64), [Shard(2)], layout, seed=10 * i)
    with checks.check("rows sharded, not the normalized dim: no reduction"):
        spec = NormSpec(kind="layer", scale_offset=1.0)
        check_dtensor(spec, torch.float32, mesh, (8, 16), [Shard(0)], [Replicate()], seed=2)
    uneven = [NormSpec(kind="partial_rms", p=0.5, bias=True), NormSpec(kind="layer")]
    for spec in uneven:  # rows of 30 in blocks of 8, 8, 8, 6; k = 15
        with checks.check(f"uneven blocks {spec.kind}"):
            check_dtensor(spec, torch.float32, mesh, (7, 30), [Shard(1)], [Shard(0)], seed=3)
    for spec in (NormSpec(kind="rms", scale_offset=1.0), NormSpec(kind="partial_rms", p=0.3)):
        with checks.check(f"2-D mesh, rows and features sharded, {spec.kind}"):
            check_dtensor(spec, torch.float32, mesh2d, (4, 64), [Shard(0), Shard(1)],
                          [Replicate(), Shard(0)], seed=5)
    for placement in ("inside", "outside"):  # LayerNorm rows of 2 over 2 ranks are degenerate
        spec = NormSpec(kind="layer", eps_placement=placement, eps=1e-3)
        with checks.check(f"degenerate layer rows of 2 over 2 ranks {placement}"):
            check_dtensor(spec, torch.float32, mesh2d, (4, 2), [Shard(0), Shard(1)],
                          [Replicate(), Shard(0)], seed=6)
    for spec in (NormSpec(kind="partial_rms", p=0.3, bias=True), NormSpec(kind="layer")):
        with checks.check(f"plain tensors with a group {spec.kind}"):
            check_plain_group(spec, seed=4)
    for placement in ("inside", "outside"):
        with checks.check(f"partial rms k = 1 across ranks {placement}"):
            check_first_element_alone(placement)
    for spec, scale, shift in EXTREME_ROWS:
        with checks.check(f"rows of {scale:g} + {shift:g} {spec.kind} {spec.eps_placement}"):
            check_plain_group(spec, seed=7, scale=scale, shift=shift)
    with checks.check("module routes a DTensor sharded on its normalized dim"):
        check_module_routes_sharded_dtensor(mesh)
    with checks.check("errors"):
        check_errors(mesh, mesh2d)
    with checks.check("register_row_sharding on a custom row op"):
        check_registered_op(mesh)


# --- modules under SequenceParallel, DTensor batch sharding and FSDP2 ---------------------------


MODULES: list[tuple[str, Callable[[int], nn.Module]]] = [
    ("RMSNorm", lambda n: nt.RMSNorm(n, scale_offset=1.0)),
    ("PartialRMSNorm", lambda n: nt.PartialRMSNorm(n, p=0.3, bias=True)),
    ("LayerNorm", lambda n: nt.LayerNorm(n, eps_placement="outside")),
]


def _module(make: Callable[[int], nn.Module], n: int, seed: int) -> nn.Module:
    module = make(n)
    with torch.no_grad():
        for i, param in enumerate(module.parameters()):
            param.add_(_randn(n, seed=seed + i) * 0.5)
    return module


def _module_params(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    def value(p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None:
            return None
        return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()

    return value(module.weight), value(module.bias)  # type: ignore[arg-type]


def check_sequence_parallel(
    make: Callable[[int], nn.Module], dtype: torch.dtype, mesh: DeviceMesh
) -> None:
    """Input sharded on the sequence dim, weight replicated, weight gradient reduced."""
    module = _module(make, 16, seed=1)
    w, b = _module_params(module)
    parallelize_module(module, mesh, SequenceParallel())
    x, dy = _randn(2, 8, 16, seed=2, dtype=dtype), _randn(2, 8, 16, seed=3, dtype=dtype)
    rank = dist.get_rank()
    xl = _leaf(x.chunk(WORLD, 1)[rank])
    y = module(xl)
    assert isinstance(y, DTensor) and tuple(y.placements) == (Shard(1),), y
    y.to_local().backward(dy.chunk(WORLD, 1)[rank])
    dx = torch.empty_like(x)
    dist.all_gather(list(dx.chunk(WORLD, 1)), xl.grad)  # type: ignore[arg-type]
    grads = (dx, _grad(module.weight), _grad(module.bias))  # type: ignore[arg-type]
    assert_matches_reference(module.spec, x, dy, w, b, y, grads, f"SequenceParallel {dtype}")


def check_batch_sharded(make: Callable[[int], nn.Module], mesh: DeviceMesh) -> None:
    """DTensor inputs sharded on batch dims, replicated parameters; and under no_grad."""
    module = _module(make, 16, seed=4)
    w, b = _module_params(module)
    distribute_module(module, mesh)
    for shape, placement in (((8, 3, 16), Shard(0)), ((2, 8, 16), Shard(1)), ((12, 16), Shard(0))):
        x, dy = _randn(*shape, seed=5), _randn(*shape, seed=6)
        xd = _leaf(_dist(x, mesh, [placement]))
        y = module(xd)
        assert tuple(y.placements) == (placement,), y.placements
        y.backward(_dist(dy, mesh, [placement]))
        grads = (_grad(xd), _grad(module.weight), _grad(module.bias))  # type: ignore[arg-type]
        assert_matches_reference(module.spec, x, dy, w, b, y, grads, f"batch {placement}")
        module.zero_grad()
        with torch.no_grad():
            y = module(_dist(x, mesh, [placement]))
        expected = reference.normalize(to_numpy(x), module.spec, _np(w), _np(b))
        tolerances.assert_close(_np(y), expected, what=f"no_grad batch {placement}")


def check_batch_sharded_dyt(mesh: DeviceMesh) -> None:
    """DyT on a DTensor sharded on its rows: alpha replicated, its gradient summed over ranks."""
    module = nt.DyT(16, alpha_init=0.8)
    distribute_module(module, mesh)
    x, dy = _randn(8, 16, seed=11) * 2, _randn(8, 16, seed=12)
    xd = _leaf(_dist(x, mesh, [Shard(0)]))
    y = module(xd)
    assert tuple(y.placements) == (Shard(0),), y.placements
    y.backward(_dist(dy, mesh, [Shard(0)]))
    params = (_np(module.weight), _np(module.bias), _np(module.alpha))
    tolerances.assert_close(_np(y), reference.normalize(to_numpy(x), module.spec, *params),
                            what="DyT y")
    want = reference.normalize_vjp(to_numpy(x), to_numpy(dy), module.spec, *params)
    for name, got, expected in (("dx", xd.grad, want.dx), ("dalpha", module.alpha.grad,
                                                            want.dalpha)):
        tolerances.assert_close(_np(got), expected, quantity="grad", what=f"DyT {name}")


def check_batch_sharded_add_norm(mesh: DeviceMesh) -> None:
    """A module with a residual on DTensors sharded on their rows: (y, h), rank by rank."""
    module = nt.RMSNorm(16, cast="before_scale", residual="float32_normalized")
    distribute_module(module, mesh)
    x, res = (_randn(8, 16, seed=s, dtype=torch.bfloat16) for s in (13, 14))
    dy, dh = (_randn(8, 16, seed=s, dtype=torch.bfloat16) for s in (15, 16))
    xd, rd = _leaf(_dist(x, mesh, [Shard(0)])), _leaf(_dist(res, mesh, [Shard(0)]))
    y, h = module(xd, rd)
    assert tuple(h.placements) == (Shard(0),) and h.dtype == torch.bfloat16, h
    torch.autograd.backward([y, h], [_dist(dy, mesh, [Shard(0)]), _dist(dh, mesh, [Shard(0)])])
    arrays = (to_numpy(x), to_numpy(res))
    want_y, want_h = reference.add_normalize(*arrays, module.spec, _np(module.weight))
    tolerances.assert_close(_np(y), want_y, cast="before_scale", what="add_norm y")
    np.testing.assert_array_equal(_np(h), want_h)
    want = reference.add_normalize_vjp(*arrays, to_numpy(dy), to_numpy(dh), module.spec,
                                       _np(module.weight))
    for name, got, expected in (("dx", xd.grad, want.dx), ("dresidual", rd.grad, want.dresidual),
                                ("dweight", module.weight.grad, want.dscale)):
        tolerances.assert_close(_np(got), expected, quantity="grad", what=f"add_norm {name}")


def check_fsdp(make: Callable[[int], nn.Module], dtype: torch.dtype) -> None:
    """fully_shard: parameters sharded, gathered for the forward; gradients averaged over ranks."""
    module = _module(make, 16, seed=7)
    w, b = _module_params(module)
    fully_shard(module)
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in module.parameters())
    x, dy = _randn(8, 3, 16, seed=8, dtype=dtype), _randn(8, 3, 16, seed=9, dtype=dtype)
    rank = dist.get_rank()
    xl = _leaf(x.chunk(WORLD)[rank])
    y = module(xl)
    y.backward(dy.chunk(WORLD)[rank])
    ys, dx = torch.empty_like(x), torch.empty_like(x)
    dist.all_gather(list(ys.chunk(WORLD)), y.detach())
    dist.all_gather(list(dx.chunk(WORLD)), xl.grad)  # type: ignore[arg-type]
    grads = (dx, _grad(module.weight), _grad(module.bias))  # type: ignore[arg-type]
    assert_matches_reference(module.spec, x, dy, w, b, ys, grads, f"FSDP2 {dtype}", WORLD)


class Block(nn.Module):
    """Pre-norm MLP block; ``hidden_norm`` normalizes the (tensor-parallel) hidden features."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nt.RMSNorm(dim, 1e-6)
        self.up = nn.Linear(dim, hidden)
        self.hidden_norm = nt.PartialRMSNorm(hidden, p=0.3)  # k = 9: across two ranks' blocks
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.hidden_norm(self.up(self.norm(x))))
        return x + self.down(h)


class Model(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, hidden) for _ in range(2)])
        self.final_norm = nt.LayerNorm(dim, 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)


def _model() -> Model:
    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():  # norms off their initial values, so their gradients matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def _shard_rows(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(_dist(param, mesh, [Shard(0)])))


def tensor_sequence_parallel(model: Model, mesh: DeviceMesh) -> Model:
    """Megatron MLPs with sequence-parallel norms; the hidden norm's row sharded over the ranks."""
    for block in model.blocks:
        parallelize_module(block, mesh, {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        })
        distribute_module(block.hidden_norm, mesh, _shard_rows)
    parallelize_module(model, mesh, {"final_norm": SequenceParallel(use_local_output=True)})
    return model


def train(model: Model, x: torch.Tensor, target: torch.Tensor, scale: float) -> list[float]:
    """5 SGD steps on ``sum((model(x) - target)^2) * scale``; this rank's losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        out = model(x)
        loss = ((out - target) ** 2).sum() * scale
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check_training(parallel: str, mesh: DeviceMesh) -> None:
    """5 steps under TP+SP or FSDP2 against one process.

    Losses within the float32 forward bound, parameter updates within the float32 gradient
    bound (1e-5 of the largest update): the runs differ only in the order of float32 sums.
    """
    x, target = _randn(8, 8, 16, seed=11), _randn(8, 8, 16, seed=12)
    single = _model()
    initial = {k: v.detach().clone() for k, v in single.named_parameters()}
    single_losses = train(single, x, target, 1.0 / x.numel())
    model, rank = _model(), dist.get_rank()
    if parallel == "tp+sp":  # each rank's loss is its sequence block's share of the mean
        tensor_sequence_parallel(model, mesh)
        xl, tl = x.chunk(WORLD, 1)[rank], target.chunk(WORLD, 1)[rank]
        scale, share = 1.0 / x.numel(), 1.0
    else:  # each rank's loss is the mean over its batch block; FSDP2 averages the gradients
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        xl, tl = x.chunk(WORLD)[rank], target.chunk(WORLD)[rank]
        scale, share = 1.0 / xl.numel(), 1.0 / WORLD
    losses = torch.tensor(train(model, xl, tl, scale), dtype=torch.float64)
    dist.all_reduce(losses)
    tolerances.assert_close(
        losses.numpy() * share, np.array(single_losses), dtype=np.float32,
        what=f"{parallel} losses",
    )
    worst = 0.0
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        update = (full.detach() - initial[name]).numpy()
        want = (single.get_parameter(name).detach() - initial[name]).numpy().astype(np.float64)
        m = tolerances.assert_close(
            update, want, quantity="grad", what=f"{parallel} update of {name}"
        )
        worst = max(worst, m.error)
    if rank == 0:
        print(f"{parallel}: worst parameter update error {worst:.2e} of its max (bound 1e-5)")


def group_models(checks: Checks) -> None:
    mesh = init_device_mesh("cpu", (WORLD,))
    for name, make in MODULES:
        for dtype in DTYPES:
            with checks.check(f"SequenceParallel {name} {dtype}"):
                check_sequence_parallel(make, dtype, mesh)
            with checks.check(f"FSDP2 {name} {dtype}"):
                check_fsdp(make, dtype)
        with checks.check(f"DTensor batch sharding {name}"):
            check_batch_sharded(make, mesh)
    with checks.check("DTensor batch sharding DyT"):
        check_batch_sharded_dyt(mesh)
    with checks.check("DTensor batch sharding add_norm"):
        check_batch_sharded_add_norm(mesh)
    for parallel in ("tp+sp", "fsdp2"):
        with checks.check(f"train 5 steps {parallel}"):
            check_training(parallel, mesh)


def group_all(checks: Checks) -> None:
    group_sharded(checks)
    group_models(checks)


GROUPS: dict[str, Callable[[Checks], None]] = {
    "sharded": group_sharded, "models": group_models, "all": group_all
}


def main(group: str, rank: int, port: int) -> None:
    """Join the ranks at the TCPStore on 127.0.0.1:``port`` and run ``group``'s checks."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    try:
        checks = Checks()
        GROUPS[group](checks)
        if rank == 0:
            print(f"ALL {checks.passed} CHECKS PASSED", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    # Skip the interpreter's finalization: torch 2.13's gloo worker threads, kept alive by
    # DTensor's caches, can abort it while freeing their last tensors (pytorch#190489).
    sys.stdout.flush()
    os._exit(0)
