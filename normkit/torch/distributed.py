"""normkit norms whose normalized axis is sharded across the ranks of a process group.

Each rank holds a block of every row (tensor parallelism over the features, as in the q/k norm
of a column-parallel projection). The row math is the composite path's
(`normkit.torch._autograd`: each row rescaled by a power of two so that no square overflows or
underflows, LayerNorm centered with one correction, the backward's closed forms) with its row
reductions all-reduced across the group (`_ShardedRows`), so every rank gets its block of the
unsharded result, with the formulas of `normkit.reference`:

    rms:          s = sum_ranks(sum(x ** 2)) / N
    partial_rms:  s = sum_ranks(sum(x[global index < k] ** 2)) / k       k = spec.stat_size(N)
    layer:        mean = sum_ranks(sum(x)) / N,  s = sum_ranks(sum((x - mean) ** 2)) / N

(``N`` the global row size). All-reduces per call: the forward 2 (RMS; a row's extremes, then
its sum of squares) or 5 (LayerNorm: the extremes, the mean and its correction, the centered
extremes, the sum of squares); the backward 2 or 5 again (4 or 7 with eps outside), one of
them for the row sums ``sum_j d_j y_hat_j`` (and ``sum_j d_j``). The weight and bias gradients
stay local to each rank's block.

`normalize_sharded` takes a plain tensor and a process group, or a ``DTensor`` (sharded on a
normalized dim over one mesh dim). A DTensor sharded only on other dims needs no collective:
`localize` hands each rank's rows (and the parameters, their gradients marked as sums over the
ranks where they must be) to the local computation, whichever kernel runs it.
`register_row_sharding` gives a row-wise custom op (a kernel) a DTensor sharding rule. The
collectives run eagerly: no double backward, no ``torch.compile``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._ops import OpOverload
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from normkit.spec import NormSpec
from normkit.torch._autograd import (
    RowSums,
    _acc_dtype,
    _affine,
    _backward,
    _extremes,
    _rounded_to,
    _row_sum,
    _rstd,
    _scaled,
)
from normkit.torch._checks import check_param, check_tensor
from normkit.torch._spec import RowSpec, row_spec

__all__ = [
    "LocalRows", "localize", "normalize_sharded", "register_row_sharding", "shards_normalized_axis"
]

def _all_summed(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``value`` (rows, j) summed over the ranks of ``group`` (None: this rank alone), in
    place."""
    if group is not None:
        dist.all_reduce(value, group=group)
    return value


class _ShardedRows(RowSums):
    """The composite math's reductions along rows of ``n`` elements spread over the ranks of
    ``group`` (None: this rank alone), whose statistic reads the first ``k``, ``head`` of them
    in this rank's block: each rank reduces its block as `RowSums` does, then one all-reduce
    (a mean and a sum, or a row's max and -min, in one)."""

    def __init__(self, group: dist.ProcessGroup | None, n: int, k: int, head: int) -> None:
        self.group, self.n, self.k, self.heads = group, n, k, head

    def length(self, t: torch.Tensor) -> int:
        return self.n

    def head(self, k: int) -> int:
        return self.heads

    def extremes(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if t.shape[-1]:
            hi, lo = _extremes(t)
        else:  # a block without elements the statistic reads
            hi = t.new_full((t.shape[0], 1), -math.inf)
            lo = t.new_full((t.shape[0], 1), math.inf)
        both = torch.cat([hi, lo.neg()], dim=-1)
        if self.group is not None:
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        return both[:, :1], both[:, 1:].neg()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return _all_summed(_row_sum(t), self.group)

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return self.sum(t) / self.n

    def mean_and_sum(self, t: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = _all_summed(torch.cat([_row_sum(t), _row_sum(u)], dim=-1), self.group)
        return both[:, :1] / self.n, both[:, 1:]

    def mean_square(self, head: torch.Tensor) -> torch.Tensor:
        return self.sum(head * head) / self.k

    def center(self, t: torch.Tensor) -> torch.Tensor:
        centered = t - self.mean(t)
        return centered - self.mean(centered)


class _ShardedNorm(torch.autograd.Function):
    """``y`` for a block ``x`` (rows, n) of global rows, with effective scale ``g`` and bias ``b``:
    ``plan`` is the `RowSpec` of the global rows (``plan.n`` elements, the statistic reading the
    first ``plan.k``), ``head`` how many of the block's leading elements the partial statistic
    reads (all ``n`` for the other kinds), ``group`` the ranks to reduce over (None: this rank
    alone).

    The composite path's math (`normkit.torch._autograd`: rows rescaled by a power of two, the
    closed forms of the backward), its reductions all-reduced over the group (`_ShardedRows`).
    Saves ``x`` and, per row, the true r.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, g: torch.Tensor | None, b: torch.Tensor | None,
        plan: RowSpec, head: int, group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        sums = _ShardedRows(group, plan.n, plan.k, head)
        scaled = _scaled(x, plan, sums=sums)
        r_scaled = _rstd(scaled.s, scaled.eps, plan.outside)
        y = scaled.c * r_scaled
        if x.dtype != y.dtype and plan.before_scale:
            y = _rounded_to(y, x.dtype)
        ctx.save_for_backward(x, (r_scaled * scaled.sigma).squeeze(-1), g)
        ctx.plan, ctx.sums, ctx.has_b = plan, sums, b is not None
        return _affine(y, g, b, out=x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, r, g = ctx.saved_tensors
        need_x, need_g, need_b = ctx.needs_input_grad[:3]
        dx, dg, db = _backward(x, r, g, dy.contiguous(), ctx.plan, need_g and g is not None,
                               need_b and ctx.has_b, ctx.sums)
        return (dx if need_x else None), dg, db, None, None, None


def _param_shape(
    x: torch.Tensor, spec: NormSpec, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[int, ...]:
    """The shape of ``spec``'s parameters for ``x``, which a given ``weight`` and ``bias`` must
    have (ValueError; also for one the spec lacks), in a supported dtype (TypeError)."""
    shape = spec.param_shape(tuple(x.shape))
    check_param(weight, "weight", spec.scale, shape)
    check_param(bias, "bias", bool(spec.bias), shape)
    return shape


def _check_not_partial(x: DTensor) -> None:
    """ValueError for a Partial placement of ``x``: its values are not yet summed."""
    for mesh_dim, p in enumerate(x.placements):
        if p.is_partial():
            raise ValueError(
                f"x has the placement {p} on mesh dim {mesh_dim}: redistribute it to Replicate "
                "or Shard before normalizing"
            )


def _apply(
    x: torch.Tensor,
    spec: NormSpec,
    axes: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    size: int,
    offset: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The block ``x`` over ``axes``: elements ``offset..`` of global rows of ``size``."""
    trailing = tuple(range(x.dim() - len(axes), x.dim()))
    moved = x.movedim(axes, trailing)
    n = math.prod(moved.shape[len(moved.shape) - len(axes) :])
    rows = moved.reshape(math.prod(moved.shape[: moved.dim() - len(axes)]), n)
    acc = _acc_dtype(x.dtype)
    g = None if weight is None else weight.to(acc).reshape(n)
    if g is not None and spec.scale_offset != 0:
        g = g + spec.scale_offset
    b = None if bias is None else bias.to(acc).reshape(n)
    plan = row_spec(spec, size)
    head = min(max(plan.k - offset, 0), n) if spec.kind == "partial_rms" else n
    y = _ShardedNorm.apply(rows.contiguous(), g, b, plan, head, group)
    return y.reshape(moved.shape).movedim(trailing, axes)


def normalize_sharded(
    x: torch.Tensor,
    spec: NormSpec,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``spec`` applied to rows whose normalized axis is split across the ranks of a group.

    Plain tensors: each of the ``W`` ranks of ``group`` (None: the default group) holds an
    equal block of ``n`` elements of every row, rank ``i`` the ``i``-th block in group-rank
    order, so the global row has ``N = n * W`` elements; ``weight`` and ``bias`` are this rank's
    blocks (shape ``spec.param_shape(x.shape)``). With ``kind="partial_rms"`` the statistic
    reads the first ``spec.stat_size(N)`` elements of the global row, which needs a single
    normalized axis.

    DTensors (``group`` must then be None): ``x`` sharded on one normalized dim over one mesh
    dim (the group is that mesh dim's), possibly unevenly, and on any other dims over other mesh
    dims; ``weight`` and ``bias`` DTensors of the global parameter shape, sharded alike on that
    mesh dim or replicated. Returns a DTensor with ``x``'s placements.

    Returns the rank's block of ``normalize(global x)``, in ``x``'s dtype; gradients are those
    of the global function (``x``'s block; the parameters' blocks, or for replicated parameters
    their sum over the ranks).

    The fields beyond the original spec (a residual, the fast variance, the offset in the
    parameter's dtype, the promoted output dtype, the autograd backward) and DyT are refused
    here, with a ValueError naming the field (every spec works on a DTensor sharded only on
    other dims: `localize`).
    """
    spec.require_defaults("normkit.torch.distributed.normalize_sharded (a sharded normalized dim)")
    if isinstance(x, DTensor):
        if group is not None:
            raise ValueError(
                "group= is for plain tensors; a DTensor's group is its device mesh dim"
            )
        return _normalize_dtensor(x, spec, weight, bias)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_tensor(x, "x")
    axes = _axes(spec, x.dim())
    param_shape = _param_shape(x, spec, weight, bias)
    if not dist.is_initialized():
        raise RuntimeError(
            "normalize_sharded needs torch.distributed initialized "
            "(torch.distributed.init_process_group) for a plain tensor"
        )
    n = math.prod(param_shape)
    group = dist.group.WORLD if group is None else group
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    return _apply(x, spec, axes, weight, bias, n * ranks, n * rank, group)


def _axes(spec: NormSpec, ndim: int) -> tuple[int, ...]:
    axes = spec.resolve_axes(ndim)
    if spec.kind == "partial_rms" and len(axes) != 1:
        raise ValueError(
            f"partial RMS over a sharded row needs a single normalized axis, got axes {axes}: "
            "the global order of the first k elements is undefined otherwise"
        )
    return axes


def shards_normalized_axis(x: torch.Tensor, spec: NormSpec) -> bool:
    """Whether ``x`` is a DTensor sharded on one of the dims ``spec`` normalizes."""
    if not isinstance(x, DTensor):
        return False
    axes = spec.resolve_axes(x.dim())
    return any(isinstance(p, Shard) and p.dim % x.dim() in axes for p in x.placements)


@dataclass(frozen=True)
class LocalRows:
    """A DTensor's local block and its parameters' and residual's (`localize`), and how to wrap
    the result."""

    x: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    like: DTensor
    alpha: torch.Tensor | None = None
    residual: torch.Tensor | None = None

    def wrap(self, y: torch.Tensor) -> DTensor:
        """The local result ``y`` (``x``'s shape, contiguous) as a DTensor laid out like x."""
        like = self.like
        stride = torch.empty(like.shape, device="meta").stride()
        return DTensor.from_local(y, like.device_mesh, like.placements, shape=like.shape,
                                  stride=stride)


def localize(
    x: DTensor,
    spec: NormSpec,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    alpha: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> LocalRows:
    """The blocks each rank normalizes on its own: ``x`` not sharded on a normalized dim.

    ``weight``, ``bias`` and DyT's ``alpha`` are DTensors on ``x``'s mesh, replicated; their
    local gradients are marked Partial (summed over the ranks) on each mesh dim where ``x`` is
    sharded. A ``residual`` is a DTensor laid out as ``x``.
    """
    check_tensor(x, "x")
    if shards_normalized_axis(x, spec):
        raise ValueError("x is sharded on a normalized dim: use normalize_sharded")
    _check_not_partial(x)
    _param_shape(x, spec, weight, bias)
    if residual is not None and (
        not isinstance(residual, DTensor)
        or residual.device_mesh != x.device_mesh
        or residual.placements != x.placements
    ):
        raise TypeError("residual must be a DTensor on x's device mesh with x's placements")
    return LocalRows(
        x.to_local(),
        _local_param(weight, "weight", x, [], None),
        _local_param(bias, "bias", x, [], None),
        x,
        _local_param(alpha, "alpha", x, [], None),
        None if residual is None else residual.to_local(),
    )


def _normalize_dtensor(
    x: DTensor, spec: NormSpec, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> DTensor:
    check_tensor(x, "x")
    axes = _axes(spec, x.dim())
    mesh = x.device_mesh
    _check_not_partial(x)
    sharded: list[tuple[int, int]] = []  # (mesh dim, tensor dim) of the normalized axis
    for mesh_dim, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim % x.dim() in axes:
            if type(p) is not Shard:
                raise ValueError(f"x's placement {p} on a normalized dim is not supported")
            sharded.append((mesh_dim, p.dim % x.dim()))
    if len(sharded) > 1:
        raise ValueError(
            f"x is sharded on normalized dims over {len(sharded)} mesh dims {sharded}; "
            "normkit reduces the statistic over one mesh dim"
        )
    param_shape = _param_shape(x, spec, weight, bias)
    size = math.prod(param_shape)
    group, offset = None, 0
    block: tuple[int, int, int] | None = None  # (param dim, start, length) of this rank's block
    if sharded:
        mesh_dim, dim = sharded[0]
        length, start = Shard.local_shard_size_and_offset(
            x.shape[dim], mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        )
        group, offset, block = mesh.get_group(mesh_dim), start, (axes.index(dim), start, length)
    local_w = _local_param(weight, "weight", x, sharded, block)
    local_b = _local_param(bias, "bias", x, sharded, block)
    y = _apply(x.to_local(), spec, axes, local_w, local_b, size, offset, group)
    # The global strides of the layout `_apply` returns: rows over moved axes, moved back.
    trailing = tuple(range(x.dim() - len(axes), x.dim()))
    moved_shape = torch.empty(x.shape, device="meta").movedim(axes, trailing).shape
    stride = torch.empty(moved_shape, device="meta").movedim(trailing, axes).stride()
    return DTensor.from_local(y, mesh, x.placements, shape=x.shape, stride=stride)


def _local_param(
    value: torch.Tensor | None,
    name: str,
    x: DTensor,
    sharded: list[tuple[int, int]],
    block: tuple[int, int, int] | None,
) -> torch.Tensor | None:
    """This rank's block of a parameter DTensor, its gradient mapped back to ``value``'s layout.

    The gradient is Partial (a sum over ranks) on each mesh dim where ``x`` is sharded on a
    batch dim, or where the parameter is replicated but ``x``'s normalized dim is sharded.
    """
    if value is None:
        return None
    if not isinstance(value, DTensor) or value.device_mesh != x.device_mesh:
        raise TypeError(f"{name} must be a DTensor on x's device mesh when x is a DTensor")
    sharded_mesh_dim = sharded[0][0] if sharded else None
    grad_placements: list[Placement] = []
    narrow = False
    for mesh_dim, (p, xp) in enumerate(zip(value.placements, x.placements, strict=True)):
        if mesh_dim == sharded_mesh_dim and block is not None and p == Shard(block[0]):
            grad_placements.append(p)
        elif not p.is_replicate():
            like_x = "" if block is None or mesh_dim != sharded_mesh_dim else f" or S({block[0]})"
            raise ValueError(
                f"{name} has the placement {p} on mesh dim {mesh_dim}: expected Replicate{like_x}"
            )
        elif mesh_dim == sharded_mesh_dim:
            narrow = True
            grad_placements.append(Partial())
        else:
            grad_placements.append(Partial() if isinstance(xp, Shard) else Replicate())
    local = value.to_local(grad_placements=grad_placements)
    if narrow and block is not None:
        local = local.narrow(*block)
    return local


def register_row_sharding(
    op: OpOverload,
    *,
    params: Collection[str] = ("weight", "bias"),
    summed_outputs: Collection[int] = (),
) -> None:
    """Register how DTensor runs ``op``, a row-wise op on rows ``(rows, n)`` (a norm kernel).

    Rows are independent, so ``op`` runs on each rank's rows: the tensor arguments named in
    ``params`` (per-feature vectors) are replicated, every other tensor argument and every
    output is sharded on dim 0 (the rows) like the input, except the outputs whose indices are
    in ``summed_outputs`` (a parameter gradient: a sum over rows), which are Partial. The other
    accepted layout is everything replicated. A row sharded on its features has no rule here:
    DTensor gathers it first (`normalize_sharded` reduces the statistic instead).
    """
    arguments = op._schema.arguments
    n_outputs = len(op._schema.returns)
    tensors = [_is_tensor_type(a.type) for a in arguments]

    def strategies(*args: object, **kwargs: object) -> Sequence[tuple[list[Any], list[Any]]]:
        values = list(args) + [kwargs.get(a.name) for a in arguments[len(args) :]]
        present = [t and v is not None for t, v in zip(tensors, values, strict=True)]
        replicated: list[Any] = [Replicate() if p else None for p in present]
        row_inputs: list[Any] = [
            (Replicate() if a.name in params else Shard(0)) if p else None
            for a, p in zip(arguments, present, strict=True)
        ]
        row_outputs: list[Any] = [
            Partial() if i in summed_outputs else Shard(0) for i in range(n_outputs)
        ]
        return [([Replicate()] * n_outputs, replicated), (row_outputs, row_inputs)]

    register_sharding(op)(strategies)


def _is_tensor_type(t: Any) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)
