"""The normkit kernel for PyTorch: a custom autograd.Function with an analytic backward.

Inputs are 2-D: rows of the ``n`` normalized elements. The forward saves only the input and one
statistic per row, ``r = r(s)`` (float32, or float64 for float64 input); the backward recomputes
what it needs from them. The formulas are those of `normkit.reference.normalize_vjp`.

In plain eager mode (not recording a graph for double backward, not under ``torch.compile`` or
a ``torch.func`` transform), float32 and float64 RMS rows take a path that works in place: one
temporary fewer in the forward, none beyond the gradient in the backward. Elsewhere the same
formulas run as functional whole-tensor ops, which compilers fuse. Both are a handful of
whole-tensor ops: row blocks sized for the cache were measured slower on a loaded 2-core machine,
where each of their many parallel regions waits for a descheduled thread.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics and normalization are computed in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _in_place(x: torch.Tensor) -> bool:
    """Whether the in-place eager path applies to the rows ``x``."""
    return (
        x.dtype in (torch.float32, torch.float64)
        and not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
        and not torch.is_grad_enabled()
    )


@torch.library.custom_op("normkit::round_through", mutates_args=())
def round_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and converted back, as an op compilers cannot drop.

    Inductor removes a ``.to(half).to(float32)`` round trip it fuses (it keeps float32
    precision), which would skip the ``before_scale`` rounding; an opaque op keeps it.
    """
    return x.to(dtype).to(x.dtype)


@round_through.register_fake
def _round_through_fake(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(x)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _rstd(s: torch.Tensor, eps: float, outside: bool) -> torch.Tensor:
    """``r(s)``: ``1/sqrt(s + eps)`` (inside) or ``1/(sqrt(s) + eps)`` (outside)."""
    return torch.reciprocal(torch.sqrt(s) + eps) if outside else torch.rsqrt(s + eps)


def _dr_ds(r: torch.Tensor, s: torch.Tensor, outside: bool) -> torch.Tensor:
    """``r'(s)``: ``-r^3/2`` (inside) or ``-r^2/(2 sqrt(s))`` (outside; 0 at s = 0)."""
    if not outside:
        return -0.5 * r * r * r
    root = torch.sqrt(s)
    return torch.where(s > 0, -0.5 * r * r / torch.where(s > 0, root, torch.ones_like(root)), 0.0)


def _statistic(
    x: torch.Tensor, kind: str, k: int, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the centered values (``x``, or ``x - mean(x)`` for layer) in ``acc``, and ``s``."""
    xf = x.to(acc)
    if kind == "layer" and xf.shape[-1] == 2:
        # x - mean(x) = (x - x_other) / 2: one rounding, relative to the centered values; the
        # mean's rounding is relative to |x|, which at n = 2 can dwarf them.
        centered = (xf - xf.flip(-1)) / 2
        return centered, centered[:, :1] * centered[:, :1]
    if kind == "layer":
        var, mean = torch.var_mean(xf, dim=-1, correction=0, keepdim=True)
        return xf - mean, var
    head = xf[:, :k]
    return xf, torch.linalg.vecdot(head, head).unsqueeze(-1) / k


def _forward(
    x: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor | None,
    kind: str,
    k: int,
    eps: float,
    outside: bool,
    cast: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, r)`` for rows ``x`` with effective scale ``g`` and bias ``b`` (both in acc dtype)."""
    acc = _acc_dtype(x.dtype)
    if _in_place(x) and kind != "layer":
        return _forward_in_place(x, g, b, k, eps, outside)
    centered, s = _statistic(x, kind, k, acc)
    r = _rstd(s, eps, outside)
    y = centered * r
    if x.dtype != acc and cast == "before_scale":
        y = round_through(y, x.dtype) if torch.compiler.is_compiling() else y.to(x.dtype).to(acc)
    if g is not None and b is not None:
        y = torch.addcmul(b, y, g)
    elif g is not None:
        y = y * g
    elif b is not None:
        y = y + b
    return y.to(x.dtype), r.squeeze(-1)


def _forward_in_place(
    x: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor | None,
    k: int,
    eps: float,
    outside: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_forward` for the RMS kinds on float32/float64 rows, the affine step in place."""
    r = torch.linalg.vector_norm(x[:, :k], dim=-1, keepdim=True)
    if outside:
        r.div_(math.sqrt(k)).add_(eps).reciprocal_()
    else:
        r.square_().div_(k).add_(eps).rsqrt_()
    y = torch.mul(x, r)
    if g is not None and b is not None:
        torch.addcmul(b, y, g, out=y)
    elif g is not None:
        y.mul_(g)
    elif b is not None:
        y.add_(b)
    return y, r.squeeze(-1)


def _backward(
    x: torch.Tensor,
    r: torch.Tensor,
    g: torch.Tensor | None,
    dy: torch.Tensor,
    kind: str,
    k: int,
    eps: float,
    outside: bool,
    need_g: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dg, db)`` as in `normalize_vjp`: dx in x's dtype, dg and db in the acc dtype.

    Rows in which the output has no direction left to vary (n = 1; n <= 2 for layer) have a
    gradient of the order of eps that float32 loses to cancellation: they are recomputed in
    float64 (where the device has it), from ``x`` alone.
    """
    n = x.shape[-1]
    degenerate = n <= (2 if kind == "layer" else 1)
    if degenerate and r.dtype != torch.float64 and x.device.type != "mps":
        _, s = _statistic(x, kind, k, torch.float64)
        wide_g = None if g is None else g.double()
        dx, dg, db = _backward(
            x.double(), _rstd(s, eps, outside).squeeze(-1), wide_g, dy.double(), kind, k, eps,
            outside, need_g, need_b,
        )
        narrow = r.dtype
        return dx.to(x.dtype), _cast(dg, narrow), _cast(db, narrow)
    acc = r.dtype
    if _in_place(x) and kind != "layer":
        return _backward_in_place(x, r, g, dy, k, outside, need_g, need_b)
    centered, s = _statistic(x, kind, k, acc)
    # Under create_graph the saved r, a constant to autograd, would drop its dependence on x.
    r = _rstd(s, eps, outside) if torch.is_grad_enabled() else r.unsqueeze(-1)
    dyf = dy.to(acc)
    d = dyf * g if g is not None else dyf
    coef = _dr_ds(r, s, outside) * torch.sum(d * centered, dim=-1, keepdim=True)
    if kind == "layer":
        dx = r * (d - d.mean(dim=-1, keepdim=True)) + centered * ((2.0 / n) * coef)
    elif k == n:
        dx = torch.addcmul(r * d, centered, (2.0 / k) * coef)
    else:
        head = torch.addcmul(r * d[:, :k], centered[:, :k], (2.0 / k) * coef)
        dx = torch.cat([head, r * d[:, k:]], dim=-1)
    dg = torch.sum(dyf * centered * r, dim=0) if need_g else None
    db = torch.sum(dyf, dim=0) if need_b else None
    return dx.to(x.dtype), dg, db


def _backward_in_place(
    x: torch.Tensor,
    r: torch.Tensor,
    g: torch.Tensor | None,
    dy: torch.Tensor,
    k: int,
    outside: bool,
    need_g: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`_backward` for the RMS kinds on float32/float64 rows, in one buffer.

    ``p = dy * x`` gives ``sum_j d_j x_j = p @ g`` and ``dg = p^T r`` (matrix-vector
    products); ``p`` is then overwritten with ``dx = r (dy * g) + (2/k) r'(s) (sum_j d_j x_j) x``
    (the last term on the first k columns).
    """
    p = torch.mul(dy, x)
    dot = torch.mv(p, g) if g is not None else p.sum(dim=-1)
    dg = torch.mv(p.t(), r) if need_g else None
    db = dy.sum(dim=0) if need_b else None
    if outside:
        # r'(s) = -r^2 / (2 sqrt(s)); sqrt(s) is recomputed: 1/r - eps would lose precision.
        root = torch.linalg.vector_norm(x[:, :k], dim=-1).div_(math.sqrt(k))
        coef = torch.where(root > 0, -r * r / torch.where(root > 0, root, 1.0), 0.0) / k
    else:
        coef = r * r * r * (-1.0 / k)
    coef = coef.mul_(dot).unsqueeze(-1)
    dx = torch.mul(dy, g, out=p) if g is not None else p.copy_(dy)
    dx.mul_(r.unsqueeze(-1))
    dx[:, :k].addcmul_(x[:, :k], coef)
    return dx, dg, db


class NormFunction(torch.autograd.Function):
    """``y = normalize(x)`` on rows ``x`` of shape (rows, n), with an analytic backward.

    ``apply(x, g, b, kind, k, eps, outside, cast)``: ``g`` is the effective scale
    ``scale_offset + w`` and ``b`` the bias, both in the acc dtype (float32, float64 for float64
    ``x``) or None; ``kind`` is a `NormSpec` kind, ``k`` its ``stat_size(n)``, ``outside`` whether
    eps is added outside the square root, ``cast`` the half-precision cast order. Returns
    ``(y, r)``, ``r`` the per-row ``r(s)``, not differentiable.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor,
        g: torch.Tensor | None,
        b: torch.Tensor | None,
        kind: str,
        k: int,
        eps: float,
        outside: bool,
        cast: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _forward(x, g, b, kind, k, eps, outside, cast)

    @staticmethod
    def setup_context(
        ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        x, g, b, kind, k, eps, outside, _ = inputs
        ctx.save_for_backward(x, output[1], g)
        ctx.mark_non_differentiable(output[1])
        ctx.kind, ctx.k, ctx.eps, ctx.outside, ctx.has_b = kind, k, eps, outside, b is not None

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor, _dr: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        x, r, g = ctx.saved_tensors
        need_x, need_g, need_b = ctx.needs_input_grad[:3]
        dx, dg, db = _backward(
            x, r, g, dy, ctx.kind, ctx.k, ctx.eps, ctx.outside, need_g and g is not None,
            need_b and ctx.has_b,
        )
        return (dx if need_x else None), dg, db, None, None, None, None, None
