"""The normkit kernel for PyTorch: custom autograd.Functions with analytic backwards.

`NormFunction` computes the normalization kinds and `DytFunction` DyT; `WithValue` takes a
forward value with the gradient of another expression, and `RoundThrough`, one of its kind,
rounds the sum of a ``residual="rounded"`` add while its gradient passes unrounded.

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

import inspect
import math
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch._functorch.utils import unwrap_dead_wrappers
from torch._subclasses.fake_tensor import FakeTensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics and normalization are computed in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _in_place(x: torch.Tensor) -> bool:
    """Whether the in-place eager path applies to the rows ``x``."""
    return (
        x.dtype in (torch.float32, torch.float64)
        and not _shape_only(x)
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


# Rows whose r(s) falls outside [2**-e, 2**e] are recomputed in scaled units: there s (or the
# sums behind it) may have overflowed or underflowed, and r**3 would leave the dtype's range.
_SAFE_EXPONENT = {torch.float32: 32, torch.float64: 256}


def _rstd(s: torch.Tensor, eps: float | torch.Tensor, outside: bool) -> torch.Tensor:
    """``r(s)``: ``1/sqrt(s + eps)`` (inside) or ``1/(sqrt(s) + eps)`` (outside)."""
    return torch.reciprocal(torch.sqrt(s) + eps) if outside else torch.rsqrt(s + eps)


# Below this a row's s (the mean of squares) may have lost its value to underflow: a square
# under the dtype's normal range is rounded to a multiple of its smallest subnormal. For eps
# outside, whose gradient divides by sqrt(s), such rows take their direction in scaled units.
_TINY_S = {
    dtype: torch.finfo(dtype).tiny / torch.finfo(dtype).eps
    for dtype in (torch.float32, torch.float64)
}


def _out_of_range(r: torch.Tensor) -> torch.Tensor:
    """Per row: whether ``r`` is outside the range where the plain formulas hold, or NaN (a
    LayerNorm mean can overflow on finite rows; rows that hold a NaN are left as they are)."""
    bound = 2.0 ** _SAFE_EXPONENT[r.dtype]
    return ~((r >= 1 / bound) & (r <= bound))


def _traced() -> bool:
    """Whether data-dependent Python branches are unavailable (compile, vmap, grad transforms)."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def needs_graph(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on ``tensors`` must go through its Function's ``apply``, which records
    the autograd graph: grad mode on and one of them requiring grad, or a torch.func transform
    active (its wrappers decide). Otherwise the Function's ``forward`` alone computes the same
    values, without ``apply``'s 20 us of host time (inference: a row of 4096 takes the CPU
    kernel 2.3 us)."""
    if torch._C._are_functorch_transforms_active():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _without_data(t: torch.Tensor) -> bool:
    """Whether ``t`` is a meta or fake tensor (deferred initialization, shape inference): a
    shape, a dtype and a device, but no values."""
    return t.is_meta or isinstance(t, FakeTensor)


def _shape_only(t: torch.Tensor) -> bool:
    """Whether ``t``'s values cannot be read: when traced (`_traced`), or `_without_data`."""
    return _traced() or _without_data(t)


def _center(xf: torch.Tensor) -> torch.Tensor:
    """``x - mean(x)`` per row, with one correction pass (the mean of the centered values is
    subtracted again), which recovers what the rounding of a large mean loses."""
    if xf.shape[-1] == 2:
        # x - mean(x) = (x - x_other) / 2: one rounding, relative to the centered values.
        return (xf - xf.flip(-1)) / 2
    centered = xf - xf.mean(dim=-1, keepdim=True)
    return centered - centered.mean(dim=-1, keepdim=True)


def _mean_square(head: torch.Tensor) -> torch.Tensor:
    """``mean(head**2)`` per row, (rows, 1). Compiled for the CPU it is summed in float64:
    Inductor's CPU code sums a row into a few running float32 totals, whose roundings add up
    (2e-6 to 3e-5 of the sum on rows of 4096 where torch's own sum is within 2.4e-7)."""
    if _traced() and head.device.type == "cpu" and head.dtype == torch.float32:
        total = (head * head).sum(dim=-1, keepdim=True, dtype=torch.float64).to(head.dtype)
    else:
        total = torch.linalg.vecdot(head, head).unsqueeze(-1)
    return total / head.shape[-1]


def _statistic(
    x: torch.Tensor, kind: str, k: int, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the centered values (``x``, or ``x - mean(x)`` for layer) in ``acc``, and ``s``."""
    xf = x.to(acc)
    centered = _center(xf) if kind == "layer" else xf
    return centered, _mean_square(centered[:, :k])


@dataclass(frozen=True)
class _Scaled:
    """Rows in scaled units: ``c = sigma * centered`` and ``s`` its statistic, ``eps`` the eps that
    gives the same ``y_hat = c r(s)``; the true ``r`` is ``sigma * r(s)``. ``sigma`` is None when
    no row is scaled."""

    c: torch.Tensor
    s: torch.Tensor
    eps: float | torch.Tensor
    sigma: torch.Tensor | None


def _rescaled(x: torch.Tensor, kind: str, k: int, eps: float, outside: bool) -> _Scaled:
    """Every row divided by its largest magnitude (at least eps's), so that s lies in [1/k, 1].

    ``sigma = 1 / max(max|x|, floor)`` with ``floor = sqrt(eps)`` (inside) or ``eps`` (outside);
    LayerNorm rows are scaled, centered, then scaled again by their largest centered value.
    sigma is a constant to autograd: ``y_hat`` does not depend on it.
    """
    acc = _acc_dtype(x.dtype)
    xf = x.to(acc)
    floor = eps if outside else math.sqrt(eps)
    stat = xf.detach() if kind == "layer" else xf.detach()[:, :k]
    sigma = 1 / stat.abs().amax(dim=-1, keepdim=True).clamp_min(floor)
    c = xf * sigma
    scaled_floor = floor * sigma
    if kind == "layer":
        c = _center(c)
        second = 1 / torch.maximum(c.detach().abs().amax(dim=-1, keepdim=True), scaled_floor)
        c, sigma, scaled_floor = c * second, sigma * second, scaled_floor * second
    s = _mean_square(c[:, :k])
    return _Scaled(c, s, scaled_floor if outside else scaled_floor * scaled_floor, sigma)


def _scaled_statistic(
    x: torch.Tensor, kind: str, k: int, eps: float, outside: bool, r: torch.Tensor | None = None
) -> _Scaled:
    """`_statistic`, with the rows that need it recomputed by `_rescaled`: those whose ``r`` is
    out of range, and those whose s is below `_TINY_S` (squares under the normal range lose
    their low bits, and a LayerNorm mean of such values more). Per-row scalars decide; eager
    code recomputes those rows only, traced code every row (then picks with a where).

    ``r``, when given, is the true ``r`` per row (rows, 1) saved by the forward; it decides
    which rows are out of range without recomputing ``r(s)``.
    """
    centered, s = _statistic(x, kind, k, _acc_dtype(x.dtype))
    bad = _out_of_range(_rstd(s, eps, outside) if r is None else r) | (s < _TINY_S[s.dtype])
    if _shape_only(x):
        return _picked(_rescaled(x, kind, k, eps, outside), centered, s, eps, bad)
    if not bool(bad.any()):
        return _Scaled(centered, s, eps, None)
    index = (bad.squeeze(-1).nonzero().squeeze(-1),)
    part = _picked(_rescaled(x[index], kind, k, eps, outside), centered[index], s[index], eps)
    assert part.sigma is not None
    return _Scaled(
        centered.index_put(index, part.c),
        s.index_put(index, part.s),
        torch.full_like(s, eps).index_put(index, torch.as_tensor(part.eps, dtype=s.dtype)),
        torch.ones_like(s).index_put(index, part.sigma),
    )


def _picked(
    scaled: _Scaled,
    centered: torch.Tensor,
    s: torch.Tensor,
    eps: float,
    use: torch.Tensor | None = None,
) -> _Scaled:
    """The rows of ``scaled`` (where ``use``, default all), else the plain ``centered`` and
    ``s``. Rows holding an inf get sigma = 0: they keep the plain values (NaN/inf where they
    belong)."""
    assert scaled.sigma is not None
    keep = scaled.sigma > 0 if use is None else use & (scaled.sigma > 0)
    return _Scaled(
        torch.where(keep, scaled.c, centered),
        torch.where(keep, scaled.s, s),
        torch.where(keep, scaled.eps, eps),
        torch.where(keep, scaled.sigma, 1.0),
    )


def _direction(c: torch.Tensor, s: torch.Tensor, kind: str, k: int) -> torch.Tensor:
    """``z = c / sqrt(s)`` over the elements the statistic reads (the first k; all for layer),
    0 where s = 0: eps outside's ``x_i r'(s) = -r**2 z_i / 2``.

    z does not depend on the rows' scale (|z| <= sqrt(k)), so rows whose s is below `_TINY_S`
    (their squares may have underflowed, even to s = 0) take it after dividing by their largest
    read magnitude: in eager code those rows only, when traced every row (a where).
    """
    head = c if kind == "layer" else c[:, :k]
    z = torch.where(s > 0, head / torch.sqrt(torch.where(s > 0, s, 1.0)), 0.0)
    tiny = (s < _TINY_S[s.dtype]).squeeze(-1)
    if _shape_only(c):
        return torch.where(tiny.unsqueeze(-1), _unit_direction(head), z)
    if not bool(tiny.any()):
        return z
    rows = tiny.nonzero().squeeze(-1)
    return z.index_put((rows,), _unit_direction(head[rows]))


def _unit_direction(head: torch.Tensor) -> torch.Tensor:
    """``head / sqrt(mean(head**2))`` per row, each row first divided by its largest magnitude
    (a constant to autograd), so that no square underflows; 0 for a row of zeros."""
    largest = head.detach().abs().amax(dim=-1, keepdim=True)
    unit = head / torch.where(largest > 0, largest, 1.0)
    s = _mean_square(unit)
    return torch.where(s > 0, unit / torch.sqrt(torch.where(s > 0, s, 1.0)), 0.0)


def _fast_statistic(x: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``variance="fast"``: ``(x - m1, max(0, m2 - m1^2))`` per row, each step in ``acc``, with
    ``m1 = mean(x)`` and ``m2 = mean(x^2)``."""
    xf = x.to(acc)
    m1 = xf.mean(dim=-1, keepdim=True)
    m2 = (xf * xf).mean(dim=-1, keepdim=True)
    return xf - m1, torch.clamp_min(m2 - m1 * m1, 0.0)


def _affine(
    y: torch.Tensor, g: torch.Tensor | None, b: torch.Tensor | None, in_place: bool = False
) -> torch.Tensor:
    """``y * g + b`` (either absent); ``in_place``: written over ``y``."""
    if g is not None and b is not None:
        return torch.addcmul(b, y, g, out=y) if in_place else torch.addcmul(b, y, g)
    if g is not None:
        return y.mul_(g) if in_place else y * g
    if b is not None:
        return y.add_(b) if in_place else y + b
    return y


def _rounded_to(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y`` rounded to the half dtype ``dtype``, kept in y's dtype (the before-scale cast)."""
    return round_through(y, dtype) if torch.compiler.is_compiling() else y.to(dtype).to(y.dtype)


def _plain_r(x: torch.Tensor, k: int, eps: float, outside: bool) -> torch.Tensor | None:
    """``r`` per row (shape ``(rows, 1)``) of the RMS kinds on float32/float64 rows, formed in
    place from the plain statistic ``s = sum(x[:k]**2) / k``; None when a row needs scaling
    (`_scaled_statistic`)."""
    head = x[:, :k]
    r = torch.linalg.vecdot(head, head).unsqueeze(-1).div_(k)
    if outside:
        r.sqrt_().add_(eps).reciprocal_()
    else:
        r.add_(eps).rsqrt_()
    return None if bool(_out_of_range(r).any()) else r


def _backward(
    x: torch.Tensor,
    r: torch.Tensor | None,
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

    In terms of ``y_hat = c r`` (bounded, unlike ``r**3``)::

        rms, partial_rms:  dx_i = r (d_i - [i < k] (1/k) u_i sum_j d_j y_hat_j)
        layer:             dx_i = r (d_i - mean(d) - (1/n) u_i sum_j d_j y_hat_j)

    with ``u = y_hat`` (inside) or ``u = c / sqrt(s)`` (outside, `_direction`: scale-free, so
    taken in scaled units where s underflows). Where a row has one element in the statistic
    (k = 1) or LayerNorm two, ``d_0 (1 - u_0 y_hat_0)`` cancels: it is taken in the closed form
    ``1 - u_0 y_hat_0 = eps r**2`` (inside) or ``eps r`` (outside). ``r`` None (the forward's r
    was that of ``variance="fast"``): the exact statistic is recomputed.
    """
    n = x.shape[-1]
    if r is None:
        rows = _scaled_statistic(x, kind, k, eps, outside)
    else:
        if _in_place(x) and kind != "layer" and k > 1:
            grads = _backward_in_place(x, r, g, dy.to(x.dtype), k, outside, need_g, need_b)
            if grads is not None:
                return grads
        rows = _scaled_statistic(x, kind, k, eps, outside, r.unsqueeze(-1))
    if r is None or rows.sigma is not None or torch.is_grad_enabled():
        # Under create_graph the saved r, a constant to autograd, would drop its dependence on x.
        r_scaled = _rstd(rows.s, rows.eps, outside)
    else:
        r_scaled = r.unsqueeze(-1)
    acc = r_scaled.dtype
    dyf = dy.to(acc)
    d = dyf * g if g is not None else dyf
    y_hat = rows.c * r_scaled
    if outside:
        u = _direction(rows.c, rows.s, kind, k)
        rest = rows.eps * r_scaled
    else:
        u = y_hat
        rest = rows.eps * r_scaled * r_scaled
    if kind == "layer":
        centered_d = d - d.mean(dim=-1, keepdim=True)
        if n == 2:
            inner = rest * centered_d
        else:
            dot = torch.sum(d * y_hat, dim=-1, keepdim=True)
            inner = centered_d - u * (dot / n)
    elif k == 1:
        others = torch.sum(d[:, 1:] * y_hat[:, 1:], dim=-1, keepdim=True)
        head = d[:, :1] * rest - u[:, :1] * others
        inner = torch.cat([head, d[:, 1:]], dim=-1)
    else:
        dot = torch.sum(d * y_hat, dim=-1, keepdim=True)
        inner = torch.cat([d[:, :k] - u[:, :k] * (dot / k), d[:, k:]], dim=-1)
    dx = r_scaled * inner
    if rows.sigma is not None:
        dx = dx * rows.sigma
    dg = torch.sum(dyf * y_hat, dim=0) if need_g else None
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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """`_backward` for the RMS kinds on float32/float64 rows with ``k > 1``, in one buffer;
    None when a row needs the general path: its ``r`` is out of range, its ``(2/k) r'(s) sum_j
    d_j x_j`` is not finite (``dy x`` large enough to overflow where ``dy y_hat`` does not, or a
    NaN or infinity in dy), or (eps outside) its s is below `_TINY_S` (`_direction`).

    ``p = dy * x`` gives ``sum_j d_j x_j = p @ g`` and ``dg = p^T r`` (matrix-vector
    products); ``p`` is then overwritten with ``dx = r (dy * g) + (2/k) r'(s) (sum_j d_j x_j) x``
    (the last term on the first k columns).
    """
    refused = _out_of_range(r)
    if outside:
        # r'(s) = -r^2 / (2 sqrt(s)); sqrt(s) is recomputed: 1/r - eps would lose precision.
        head = x[:, :k]
        s = torch.linalg.vecdot(head, head).div_(k)
        refused |= s < _TINY_S[s.dtype]
        root = s.sqrt_()
        coef = torch.where(root > 0, -r * r / torch.where(root > 0, root, 1.0), 0.0) / k
    else:
        coef = r * r * r * (-1.0 / k)
    p = torch.mul(dy, x)
    coef = coef.mul_(torch.mv(p, g) if g is not None else p.sum(dim=-1))
    if bool((refused | ~torch.isfinite(coef)).any()):
        return None
    dg = torch.mv(p.t(), r) if need_g else None
    db = dy.sum(dim=0) if need_b else None
    coef = coef.unsqueeze(-1)
    dx = torch.mul(dy, g, out=p) if g is not None else p.copy_(dy)
    dx.mul_(r.unsqueeze(-1))
    dx[:, :k].addcmul_(x[:, :k], coef)
    return dx, dg, db


_F = TypeVar("_F", bound=type[torch.autograd.Function])


def signature_once(function: _F) -> _F:
    """``function`` with its ``forward``'s signature computed once. Each ``apply`` of a Function
    with ``setup_context`` binds its arguments to that signature through ``inspect.signature``,
    which otherwise rebuilds it every call (about 20 us, as much as the CPU kernel's launch on a
    row of 4096)."""
    forward = function.forward
    forward.__signature__ = inspect.signature(forward)  # type: ignore[attr-defined]
    return function


def apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)``, every argument given positionally. In plain eager code it goes
    straight to autograd's own apply: `Function.apply` first binds the arguments to forward's
    signature, for ``setup_context``, which costs about 17 us a call, more than the CPU kernel
    takes on a row of 4096. Compiled code and torch.func transforms take `Function.apply`."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    base = super(torch.autograd.Function, function)
    return base.apply(*unwrap_dead_wrappers(args))  # type: ignore[attr-defined]


@signature_once
class NormFunction(torch.autograd.Function):
    """``y = normalize(x)`` on rows ``x`` of shape (rows, n), with an analytic backward.

    ``apply(x, g, b, kind, k, eps, outside, cast[, dtype, out, fast])``: ``g`` is the effective
    scale ``scale_offset + w`` and ``b`` the bias, both in the acc dtype (float32, float64 for
    float64 ``x``) or None; ``kind`` is a `NormSpec` kind, ``k`` its ``stat_size(n)``,
    ``outside`` whether eps is added outside the square root, ``cast`` the half-precision cast
    order; ``dtype`` the input dtype whose policy applies (default x's; the float32 values of a
    residual sum follow their half input's), ``out`` y's dtype (default ``dtype``), ``fast``
    LayerNorm's ``variance="fast"`` (whose gradient is that of the exact statistic). Returns
    ``(y, r)``, ``r`` the per-row ``r(s)``, not differentiable; the gradient of ``x`` has x's
    dtype.
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
        dtype: torch.dtype | None = None,
        out: torch.dtype | None = None,
        fast: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = x.dtype if dtype is None else dtype
        out = dtype if out is None else out
        acc = _acc_dtype(dtype)
        if fast:
            centered, s = _fast_statistic(x, acc)
            r = _rstd(s, eps, outside)
            y = centered * r
        else:
            if _in_place(x) and kind != "layer" and dtype == x.dtype:
                plain_r = _plain_r(x, k, eps, outside)
                if plain_r is not None:
                    y = _affine(torch.mul(x, plain_r), g, b, in_place=True)
                    return y.to(out), plain_r.squeeze(-1)
            rows = _scaled_statistic(x, kind, k, eps, outside)
            r = _rstd(rows.s, rows.eps, outside)
            y = rows.c * r
            if rows.sigma is not None:
                r = r * rows.sigma
        if dtype != acc and cast == "before_scale":
            y = _rounded_to(y, dtype)
        return _affine(y, g, b).to(out), r.squeeze(-1)

    @staticmethod
    def setup_context(
        ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        x, g, b, kind, k, eps, outside = inputs[:7]
        fast = len(inputs) > 10 and bool(inputs[10])
        ctx.save_for_backward(x, output[1], g)
        ctx.mark_non_differentiable(output[1])
        ctx.kind, ctx.k, ctx.eps, ctx.outside, ctx.has_b = kind, k, eps, outside, b is not None
        ctx.fast = fast

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor, _dr: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        x, r, g = ctx.saved_tensors
        need_x, need_g, need_b = ctx.needs_input_grad[:3]
        dx, dg, db = _backward(
            x, None if ctx.fast else r, g, dy, ctx.kind, ctx.k, ctx.eps, ctx.outside,
            need_g and g is not None, need_b and ctx.has_b,
        )
        return (dx if need_x else None), dg, db, None, None, None, None, None, None, None, None


@signature_once
class FusedNorm(torch.autograd.Function):
    """torch's fused LayerNorm or RMSNorm (``torch.native_layer_norm``,
    ``aten._fused_rms_norm``) on rows of the spec's defaults (eps inside; two-pass variance),
    with normkit's guards around it.

    ``apply(x, kind, shape, g, b, eps) -> (y, refused)``: ``kind`` ``"layer"`` or ``"rms"``
    (no bias), ``refused`` per row whether the fused kernel does not serve it: ``r`` out of
    range (a statistic that overflowed or underflowed; the kernel does not rescale), and for
    LayerNorm a mean larger than the spread (the kernel does not correct its mean: float32
    rows of mean 1e6 and spread 1 were off by 1e-2). The caller recomputes such batches.

    The fused backward is kept where its gradients come back finite: it sums ``dy x`` per row,
    which overflows where ``dy y_hat`` does not (dy ~ 1e29 on rows of |x| ~ 1e9). Gradients that
    come back NaN or infinite, and those of a double backward, are `_backward`'s, which has NaN
    and infinity only where the reference does."""

    @staticmethod
    def forward(
        x: torch.Tensor, kind: str, shape: list[int], g: torch.Tensor | None,
        b: torch.Tensor | None, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        if kind == "layer":
            y, mean, rstd = torch.native_layer_norm(x, shape, g, b, eps)
            return y, _out_of_range(rstd) | (mean.abs() * rstd > 1), mean, rstd
        y, rstd = torch.ops.aten._fused_rms_norm(x, shape, g, eps)
        return y, _out_of_range(rstd), None, rstd

    @staticmethod
    def setup_context(
        ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor | None, ...]
    ) -> None:
        x, kind, shape, g, b, eps = inputs
        _, refused, mean, rstd = output
        ctx.save_for_backward(x, g, b, mean, rstd)
        ctx.mark_non_differentiable(*(t for t in (refused, mean, rstd) if t is not None))
        ctx.kind, ctx.shape, ctx.eps = kind, shape, eps

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_: torch.Tensor | None) -> tuple[Any, ...]:
        x, g, b, mean, rstd = ctx.saved_tensors
        need_x, _, _, need_g, need_b = ctx.needs_input_grad[:5]
        need_g, need_b = need_g and g is not None, need_b and b is not None
        if not torch.is_grad_enabled():
            if ctx.kind == "layer":
                dx, dg, db = torch.ops.aten.native_layer_norm_backward(
                    dy, x, ctx.shape, mean, rstd, g, b, [need_x, need_g, need_b]
                )
            else:
                (dx, dg), db = torch.ops.aten._fused_rms_norm_backward(
                    dy, x, ctx.shape, rstd, g, [need_x, need_g]
                ), None
            # One sum per gradient: NaN or infinite where an element is (or where the sum of
            # finite ones overflows, which the analytic backward then serves too). isfinite over
            # every element takes 35 times a sum's time on the CPU.
            sums = torch.stack([t.sum() for t in (dx, dg, db) if t is not None])
            if bool(torch.isfinite(sums).all()):
                return dx, None, None, dg, db, None
        n = math.prod(ctx.shape)
        dx, dg, db = _backward(
            x.reshape(-1, n), rstd.reshape(-1), None if g is None else g.reshape(n),
            dy.reshape(-1, n), ctx.kind, n, ctx.eps, False, need_g, need_b,
        )
        return (
            dx.reshape(x.shape) if need_x else None, None, None,
            None if dg is None else dg.reshape(ctx.shape),
            None if db is None else db.reshape(ctx.shape), None,
        )


@signature_once
class DytFunction(torch.autograd.Function):
    """DyT on ``x``: ``y = tanh(alpha x) * g + b``, with an analytic backward.

    ``apply(x, g, b, alpha, cast, dtype, out)``: ``g`` (the effective scale) and ``b`` in the
    acc dtype of ``dtype`` or None, ``alpha`` a tensor of shape () or (1,); ``dtype`` the input
    dtype whose policy applies (tanh in float32 for half inputs; ``cast="before_scale"`` rounds
    ``tanh`` to it first), ``out`` y's dtype. The gradients (`normkit.reference.normalize_vjp`),
    with ``d = dy g`` and ``tanh'(u) = 1 / cosh(u)^2`` (no cancellation near |tanh| = 1)::

        dx = alpha tanh'(alpha x) d      dalpha = sum(x tanh'(alpha x) d)
        dg = sum over rows of dy tanh(alpha x)      db = sum over rows of dy
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor,
        g: torch.Tensor | None,
        b: torch.Tensor | None,
        alpha: torch.Tensor,
        cast: str,
        dtype: torch.dtype,
        out: torch.dtype,
    ) -> torch.Tensor:
        acc = _acc_dtype(dtype)
        y = torch.tanh(alpha.to(acc) * x.to(acc))
        if dtype != acc and cast == "before_scale":
            y = _rounded_to(y, dtype)
        return _affine(y, g, b).to(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, g, b, alpha, _, dtype, _ = inputs
        ctx.save_for_backward(x, g, alpha)
        ctx.acc, ctx.has_b = _acc_dtype(dtype), b is not None

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, g, alpha = ctx.saved_tensors
        need_x, need_g, need_b, need_alpha = ctx.needs_input_grad[:4]
        a = alpha.to(ctx.acc)
        xf = x.to(ctx.acc)
        u = a * xf
        dyf = dy.to(ctx.acc)
        d = dyf * g if g is not None else dyf
        slope_d = d / torch.cosh(u).square()
        dx = (a * slope_d).to(x.dtype) if need_x else None
        dg = torch.sum(dyf * torch.tanh(u), dim=0) if need_g and g is not None else None
        db = torch.sum(dyf, dim=0) if need_b and ctx.has_b else None
        dalpha = None
        if need_alpha:
            dalpha = torch.sum(xf * slope_d).reshape(alpha.shape).to(alpha.dtype)
        return dx, dg, db, dalpha, None, None, None


@signature_once
class GradInFormat(torch.autograd.Function):
    """``x`` itself, whose gradient is returned in ``memory_format`` (x's channels-last layout:
    torch's layers give an input's gradient the input's layout, whatever the ops between)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.memory_format = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.contiguous(memory_format=ctx.memory_format), None


@signature_once
class WithValue(torch.autograd.Function):
    """``value`` in the forward pass, the gradient of ``exact`` in the backward: the rounded
    result of the dtype policy, differentiated as the reference does, without its roundings."""

    generate_vmap_rule = True

    @staticmethod
    def forward(exact: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class RoundThrough(WithValue):
    """``x`` rounded to ``dtype`` (kept in x's dtype); the gradient passes through unrounded.

    The ``residual="rounded"`` sum: its value is the rounded one, but the gradients flowing into
    it are added in the compute dtype and rounded once, as the reference's VJP does.
    """

    @staticmethod
    def forward(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        return _rounded_to(x, dtype)
