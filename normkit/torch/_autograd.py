"""The normkit kernel for PyTorch: a custom autograd.Function with an analytic backward.

Inputs are 2-D: rows of the ``n`` normalized elements. The forward saves only the input and one
statistic per row, ``r = r(s)`` (float32, or float64 for float64 input); the backward recomputes
what it needs from them. The formulas are those of `normkit.reference.normalize_vjp`.

In eager mode on CPU, float32 and float64 rows are processed in blocks of rows small enough to
stay in cache, writing into preallocated outputs: the row statistic, the scaling and the affine
step then cost one pass over memory. Under ``torch.compile`` or ``torch.func`` transforms, and on
other devices, the same formulas run as whole-tensor functional ops (which compilers fuse).
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Rows per block of the eager CPU path: about 1 MiB of float32 per block at n = 4096.
_BLOCK_ELEMENTS = 1 << 18


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics and normalization are computed in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blocked(x: torch.Tensor) -> bool:
    """Whether the eager, in-place, blocked CPU path applies to ``x``."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float64)
        and not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
        and not torch.is_grad_enabled()
    )


def _block_rows(n: int) -> int:
    return max(1, _BLOCK_ELEMENTS // n)


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
    if _blocked(x) and kind != "layer":
        return _forward_blocked(x, g, b, k, eps, outside)
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


def _forward_blocked(
    x: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor | None,
    k: int,
    eps: float,
    outside: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_forward` for the RMS kinds on eager CPU float32/float64, one cache-sized block at a time."""
    rows, n = x.shape
    y = torch.empty_like(x)
    r = torch.empty((rows, 1), dtype=x.dtype, device=x.device)
    eps_t = torch.tensor(eps, dtype=x.dtype)
    step = _block_rows(n)
    for start in range(0, rows, step):
        xb, yb, rb = x[start : start + step], y[start : start + step], r[start : start + step]
        torch.linalg.vector_norm(xb[:, :k], dim=-1, keepdim=True, out=rb)
        if outside:
            rb.div_(math.sqrt(k)).add_(eps).reciprocal_()
        else:
            torch.addcmul(eps_t, rb, rb, value=1.0 / k, out=rb).rsqrt_()
        torch.mul(xb, rb, out=yb)
        if g is not None and b is not None:
            torch.addcmul(b, yb, g, out=yb)
        elif g is not None:
            yb.mul_(g)
        elif b is not None:
            yb.add_(b)
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
    if _blocked(x) and kind != "layer":
        return _backward_blocked(x, r, g, dy, k, outside, need_g, need_b)
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


def _backward_blocked(
    x: torch.Tensor,
    r: torch.Tensor,
    g: torch.Tensor | None,
    dy: torch.Tensor,
    k: int,
    outside: bool,
    need_g: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`_backward` for the RMS kinds on eager CPU float32/float64, one cache-sized block at a time.

    Per block: ``p = dy * x``; ``sum_j d_j x_j = p @ g`` and ``dg += p^T r`` (matrix-vector
    products); ``dx = r (dy * g) + (2/k) r'(s) (sum_j d_j x_j) x`` (on the first k columns).
    """
    rows, n = x.shape
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    dg = torch.zeros(n, dtype=x.dtype, device=x.device) if need_g else None
    db = torch.zeros(n, dtype=x.dtype, device=x.device) if need_b else None
    step = _block_rows(n)
    prod = torch.empty((min(step, rows), n), dtype=x.dtype, device=x.device)
    for start in range(0, rows, step):
        xb, dyb, dxb = x[start : start + step], dy[start : start + step], dx[start : start + step]
        rb = r[start : start + step]
        pb = torch.mul(dyb, xb, out=prod[: xb.shape[0]])
        dot = torch.mv(pb, g) if g is not None else pb.sum(dim=-1)
        if dg is not None:
            dg.addmv_(pb.t(), rb)
        if db is not None:
            db.add_(dyb.sum(dim=0))
        if outside:
            # r'(s) = -r^2 / (2 sqrt(s)), sqrt(s) = 1/r - eps recovered from the saved r would
            # lose precision; recompute sqrt(s) from the block, which is in cache.
            root = torch.linalg.vector_norm(xb[:, :k], dim=-1).div_(math.sqrt(k))
            coef = torch.where(root > 0, -rb * rb / torch.where(root > 0, root, 1.0), 0.0) / k
        else:
            coef = rb * rb * rb * (-1.0 / k)
        coef = coef.mul_(dot).unsqueeze(-1)
        rcol = rb.unsqueeze(-1)
        if g is not None:
            torch.mul(dyb, g, out=dxb).mul_(rcol)
        else:
            torch.mul(dyb, rcol, out=dxb)
        dxb[:, :k].addcmul_(xb[:, :k], coef)
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
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
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
