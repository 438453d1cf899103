"""The normkit kernel for PyTorch: custom autograd.Functions with analytic backwards.

`NormFunction` computes the normalization kinds and `DytFunction` DyT; `WithValue` takes a
forward value with the gradient of another expression, and `RoundThrough`, one of its kind,
rounds the sum of a ``residual="rounded"`` add while its gradient passes unrounded.

Inputs are 2-D: rows of the ``n`` normalized elements. The forward saves only the input and one
statistic per row, ``r = r(s)`` (float32, or float64 for float64 input); the backward recomputes
what it needs from them. The formulas are those of `normkit.reference.normalize_vjp`.

Every row is computed in units where its squares neither overflow nor underflow (multiplied by
a power of two, which leaves the bits of an ordinary row as they are), by the same ops for
every row: no value is read back to the host (so a CUDA graph can capture a call), and a row's
result depends on that row alone. In plain eager mode the forward writes y over its own
temporary; under ``torch.compile`` or a ``torch.func`` transform the same formulas run as
functional whole-tensor ops, which compilers fuse.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch._subclasses.fake_tensor import FakeTensor

from normkit.torch._cached import cached
from normkit.torch._spec import RowSpec


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics and normalization are computed in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


# ---- rows in units where no square overflows or underflows ------------------------------------
# Each row is multiplied by a power of two, sigma, taken from its largest magnitude, before its
# statistic: a power of two scales every rounding of the sums, the root and the products exactly
# (short of subnormals), so an ordinary row gets the bits of the formulas on x itself and a row
# of 1e30 or 1e-30 the reference's values, and the result of a row depends on that row alone.
# No value is read back: the same ops run for every row, eager or traced.

_MANTISSA_BITS = {torch.float32: 23, torch.float64: 52}
_EXPONENT_BIAS = {torch.float32: 127, torch.float64: 1023}
_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64}


def _power_of_two(biased: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2**(biased - bias)`` exactly, from the biased exponent ``biased`` (an int tensor of
    ``dtype``'s width, within its normal range: its bits shifted into place)."""
    return (biased << _MANTISSA_BITS[dtype]).view(dtype)


def _unit_exponent(values: torch.Tensor, most: int) -> torch.Tensor:
    """Per row of ``values`` (rows, m), the biased exponent of the power of two that brings its
    largest magnitude into [1, 2), at most ``most`` (a biased exponent) and at least the least
    normal one. (rows, 1), an int. A row holding an infinity or a NaN gets the least: its
    values are NaN, zero or infinite whatever the scale, as the reference's."""
    dtype = values.dtype
    bias = _EXPONENT_BIAS[dtype]
    if values.requires_grad:
        values = values.detach()
    # max |v| as max(max v, -min v): two reductions that read the rows once each, where abs()
    # writes a copy and the inf-norm reduction took three times as long
    largest = torch.maximum(values.amax(dim=-1, keepdim=True),
                            values.amin(dim=-1, keepdim=True).neg_())
    field = largest.view(_INT_OF[dtype]) >> _MANTISSA_BITS[dtype]  # the exponent's field
    return (2 * bias - field).clamp_(1, most)


@cached(64)
def _largest_exponent(eps: float, outside: bool, dtype: torch.dtype) -> int:
    """The largest sigma's biased exponent: sigma stays below ``1 / sqrt(eps)`` (``1 / eps``
    outside), so that ``eps sigma**2`` (``eps sigma``) stays below 1: a row far below eps is
    dominated by eps, whose scaled value must not overflow."""
    floor = eps if outside else math.sqrt(eps)
    bias = _EXPONENT_BIAS[dtype]
    exponent = math.floor(math.log2(1 / floor)) if floor > 0 else bias
    return bias + max(0, min(exponent, bias))


def _mean_square(head: torch.Tensor) -> torch.Tensor:
    """``mean(head**2)`` per row, (rows, 1). Compiled for the CPU it is summed in float64:
    Inductor's CPU code sums a row into a few running float32 totals, whose roundings add up
    (2e-6 to 3e-5 of the sum on rows of 4096 where torch's own sum is within 2.4e-7)."""
    if _traced() and head.device.type == "cpu" and head.dtype == torch.float32:
        total = (head * head).sum(dim=-1, keepdim=True, dtype=torch.float64).to(head.dtype)
    else:
        total = torch.linalg.vecdot(head, head).unsqueeze(-1)
    return total / head.shape[-1]


def _center(xf: torch.Tensor) -> torch.Tensor:
    """``x - mean(x)`` per row, with one correction pass (the mean of the centered values is
    subtracted again), which recovers what the rounding of a large mean loses."""
    if xf.shape[-1] == 2:
        # x - mean(x) = (x - x_other) / 2: one rounding, relative to the centered values.
        return (xf - xf.flip(-1)) / 2
    centered = xf - xf.mean(dim=-1, keepdim=True)
    return centered - centered.mean(dim=-1, keepdim=True)


@dataclass(frozen=True)
class _Scaled:
    """Rows in scaled units: ``c = sigma * centered`` (the first ``k`` elements read by the
    statistic), ``s`` its statistic and ``eps`` the eps that gives the same ``y_hat = c r(s)``
    (``eps sigma**2`` inside, ``eps sigma`` outside); the true ``r`` is ``sigma * r(s)``. Per
    row scalars are (rows, 1)."""

    c: torch.Tensor
    s: torch.Tensor
    eps: torch.Tensor
    sigma: torch.Tensor


def _scaled(
    x: torch.Tensor, rows: RowSpec, in_place: bool = False, statistic: bool = True
) -> _Scaled:
    """`_Scaled` of the rows ``x`` (any float dtype; computed in the acc dtype).

    RMS rows are multiplied by the power of two that brings the largest magnitude the statistic
    reads into [1, 2); LayerNorm rows too, then centered, then scaled again by their largest
    centered value (a large mean leaves a small spread). sigma is capped by
    `_largest_exponent` and is a constant to autograd: ``y_hat`` does not depend on it.
    ``in_place`` (plain eager code, nothing recorded): c is formed in one buffer. Without
    ``statistic`` (a backward given the forward's r, eps inside), ``s`` is not summed (an
    empty tensor).
    """
    acc = _acc_dtype(x.dtype)
    xf = x.to(acc)
    most = _largest_exponent(rows.eps, rows.outside, acc)
    layer = rows.kind == "layer"
    e = _unit_exponent(xf if layer else xf[:, : rows.k], most)
    sigma = _power_of_two(e, acc)
    c = xf * sigma  # a buffer of this call's: x is never written
    if layer:
        bias = _EXPONENT_BIAS[acc]
        if in_place and c.shape[-1] > 2:
            # the second centering and the second scaling in one pass: (c - m2) sigma2 =
            # c sigma2 - m2 sigma2, each product exact
            c = c.sub_(c.mean(dim=-1, keepdim=True))
            sigma2 = _power_of_two(torch.minimum(_unit_exponent(c, most), most + bias - e), acc)
            c = torch.addcmul(c.mean(dim=-1, keepdim=True).mul_(-sigma2), c, sigma2, out=c)
        else:
            c = _center(c)
            sigma2 = _power_of_two(torch.minimum(_unit_exponent(c, most), most + bias - e), acc)
            c = c * sigma2
        sigma = sigma * sigma2  # exact: powers of two whose product is at most 2**most
    s = _mean_square(c[:, : rows.k]) if statistic else c.new_empty(0)
    eps = sigma * rows.eps if rows.outside else sigma * sigma * rows.eps
    return _Scaled(c, s, eps, sigma)


def _rstd(s: torch.Tensor, eps: float | torch.Tensor, outside: bool) -> torch.Tensor:
    """``r(s)``: ``1/sqrt(s + eps)`` (inside) or ``1/(sqrt(s) + eps)`` (outside)."""
    return torch.reciprocal(torch.sqrt(s) + eps) if outside else torch.rsqrt(s + eps)


def _direction(head: torch.Tensor) -> torch.Tensor:
    """``z = c / sqrt(s)`` over the elements the statistic reads, ``head`` (the first k of c;
    all of it for layer), 0 where s = 0: eps outside's ``x_i r'(s) = -r**2 z_i / 2``. z does not
    depend on the row's scale (|z| <= sqrt(k)): it is taken from the row multiplied by the power
    of two that brings its largest magnitude into [1, 2), uncapped, where no square
    underflows."""
    uncapped = 2 * _EXPONENT_BIAS[head.dtype]
    unit = head * _power_of_two(_unit_exponent(head, uncapped), head.dtype)
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


def _backward(
    x: torch.Tensor,
    r: torch.Tensor | None,
    g: torch.Tensor | None,
    dy: torch.Tensor,
    rows: RowSpec,
    need_g: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dg, db)`` as in `normalize_vjp`: dx in x's dtype, dg and db in the acc dtype.

    In terms of ``y_hat = c r`` (bounded, unlike ``r**3``)::

        rms, partial_rms:  dx_i = r (d_i - [i < k] (1/k) u_i sum_j d_j y_hat_j)
        layer:             dx_i = r (d_i - mean(d) - (1/n) u_i sum_j d_j y_hat_j)

    with ``u = y_hat`` (inside) or ``u = c / sqrt(s)`` (outside, `_direction`). Where a row has
    one element in the statistic (k = 1) or LayerNorm two, ``d_0 (1 - u_0 y_hat_0)`` cancels:
    it is taken in the closed form ``1 - u_0 y_hat_0 = eps r**2`` (inside) or ``eps r``
    (outside). ``r``, the forward's true r per row, saves recomputing r(s); None (the forward's
    r was that of ``variance="fast"``, or a second derivative is being recorded, which needs r's
    dependence on x): it is recomputed.
    """
    n, k = x.shape[-1], rows.k
    in_place = not torch.is_grad_enabled() and not _traced()
    scaled = _scaled(x, rows, in_place, statistic=r is None or rows.outside)
    if r is None:
        r_scaled = _rstd(scaled.s, scaled.eps, rows.outside)
    else:
        r_scaled = r.unsqueeze(-1).to(scaled.sigma.dtype) / scaled.sigma  # exact: a power of two
    if in_place and not rows.outside and (k > 2 if rows.kind == "layer" else k > 1):
        return _backward_in_place(scaled, r_scaled, g, dy, rows, x.dtype, need_g, need_b)
    acc = r_scaled.dtype
    dyf = dy.to(acc)
    d = dyf * g if g is not None else dyf
    layer = rows.kind == "layer"
    u = _direction(scaled.c if layer else scaled.c[:, :k]) if rows.outside else None
    y_hat = scaled.c * r_scaled
    if rows.outside:
        rest = scaled.eps * r_scaled
    else:
        u = y_hat if layer or k == n else y_hat[:, :k]
        rest = scaled.eps * r_scaled * r_scaled
    assert u is not None
    if layer:
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
        inner = d - u * (dot / k) if k == n else torch.cat(
            [d[:, :k] - u * (dot / k), d[:, k:]], dim=-1
        )
    dx = r_scaled * inner * scaled.sigma
    dg = torch.sum(dyf * y_hat, dim=0) if need_g else None
    db = torch.sum(dyf, dim=0) if need_b else None
    return dx.to(x.dtype), dg, db


def _backward_in_place(
    scaled: _Scaled, r_scaled: torch.Tensor, g: torch.Tensor | None, dy: torch.Tensor,
    rows: RowSpec, dtype: torch.dtype, need_g: bool, need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`_backward` with eps inside (``u = y_hat``), for LayerNorm rows and RMS rows with
    ``k > 1``, in plain eager code: in two buffers, c (then y_hat) and ``p = dy * y_hat`` (then
    dx). ``p`` gives ``dg`` (its column sums) and the rows' ``sum_j d_j y_hat_j`` (the row sums
    of ``p g``), then becomes ``dx = r sigma (d - mean(d) - y_hat dot / k)``."""
    n, k = scaled.c.shape[-1], rows.k
    y_hat = scaled.c.mul_(r_scaled)
    dyf = dy.to(y_hat.dtype)
    p = torch.mul(dyf, y_hat)
    dg = p.sum(dim=0) if need_g else None
    db = dyf.sum(dim=0) if need_b else None
    # sum_j d_j y_hat_j as a row sum of p g (a matrix-vector product, BLAS's gemv, sums a
    # batch of one row in another order than a row of a larger batch)
    dot = (p.mul_(g) if g is not None else p).sum(dim=-1, keepdim=True)
    d = torch.mul(dyf, g, out=p) if g is not None else p.copy_(dyf)
    if rows.kind == "layer":
        d.sub_(d.mean(dim=-1, keepdim=True))
        d.addcmul_(y_hat, dot.div_(-n))
    else:
        d[:, :k].addcmul_(y_hat[:, :k], dot.div_(-k))
    dx = d.mul_(r_scaled * scaled.sigma)  # the true r: (d r_scaled) sigma, exactly
    return dx.to(dtype), dg, db


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
    straight to autograd's own apply (`apply_eager`). Compiled code and torch.func transforms
    take `Function.apply`."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return apply_eager(function, *args)


def apply_eager(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)`` in plain eager code (no compile, no torch.func transform):
    autograd's own apply, after dropping the wrappers of torch.func levels that have ended, as
    `Function.apply` does. `Function.apply` first binds the arguments to forward's signature,
    for ``setup_context``, which costs about 17 us a call, more than the CPU kernel takes on a
    row of 4096."""
    args_list = list(args)
    for i, arg in enumerate(args_list):
        if isinstance(arg, torch.Tensor):
            args_list[i] = _unwrap_if_dead(arg)
    return _BASE_APPLY(function, *args_list)


_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_BASE_APPLY = torch._C._FunctionBase.__dict__["apply"]


@signature_once
class NormFunction(torch.autograd.Function):
    """``y = normalize(x)`` on rows ``x`` of shape (rows, n), with an analytic backward.

    ``apply(x, g, b, rows, dtype, out)``: ``g`` is the effective scale ``scale_offset + w`` and
    ``b`` the bias, both in the acc dtype (float32, float64 for float64 ``x``) or None; ``rows``
    the `RowSpec` (its kind, k, eps and placement, cast order and variance); ``dtype`` the input
    dtype whose policy applies (the float32 values of a residual sum follow their half
    input's), ``out`` y's dtype. Returns ``(y, r)``, ``r`` the per-row ``r(s)`` in the acc
    dtype, not differentiable; the gradient of ``x`` has x's dtype. Every row is computed in
    units where its squares neither overflow nor underflow (`_scaled`); nothing is read back.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor,
        g: torch.Tensor | None,
        b: torch.Tensor | None,
        rows: RowSpec,
        dtype: torch.dtype,
        out: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = _acc_dtype(dtype)
        if rows.fast_variance:
            centered, s = _fast_statistic(x, acc)
            r = _rstd(s, rows.eps, rows.outside)
            y = centered * r
        else:
            scaled = _scaled(x, rows, in_place=not _traced())
            r_scaled = _rstd(scaled.s, scaled.eps, rows.outside)
            r = r_scaled * scaled.sigma
            # c is a temporary of this call: eager code scales it in place into y
            y = scaled.c * r_scaled if _traced() else scaled.c.mul_(r_scaled)
        if dtype != acc and rows.before_scale:
            y = _rounded_to(y, dtype)
        return _affine(y, g, b, in_place=not _traced()).to(out), r.squeeze(-1)

    @staticmethod
    def setup_context(
        ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        x, g, b, rows = inputs[:4]
        ctx.save_for_backward(x, output[1], g)
        ctx.mark_non_differentiable(output[1])
        ctx.rows, ctx.has_b = rows, b is not None

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor, _dr: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        x, r, g = ctx.saved_tensors
        need_x, need_g, need_b = ctx.needs_input_grad[:3]
        rows: RowSpec = ctx.rows
        # Under create_graph the saved r, a constant to autograd, would drop its dependence on x.
        saved = None if rows.fast_variance or torch.is_grad_enabled() else r
        dx, dg, db = _backward(x, saved, g, dy, rows, need_g and g is not None,
                               need_b and ctx.has_b)
        return (dx if need_x else None), dg, db, None, None, None


def _sech_squared_times(d: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``d tanh'(u) = d sech(u)**2``, taken as ``(d sech(u)) sech(u)`` with ``sech(u) = 2
    e**-|u| / (1 + e**-2|u|)``: no cancellation where |tanh(u)| is near 1 (``1 - tanh**2`` is
    0 past |u| = 9 in float32), no overflow (``cosh(u)**2`` overflows float32 past |u| = 44.4,
    where ``d sech(u)**2`` is 1.5e-13 at u = 50 for d = 1e30), and ``sech(u)``, not its
    square, is what must stay within range (to |u| = 87)."""
    e = torch.exp(-u.abs())
    sech = 2 * e / (1 + e * e)
    return d * sech * sech


@signature_once
class DytFunction(torch.autograd.Function):
    """DyT on ``x``: ``y = tanh(alpha x) * g + b``, with an analytic backward.

    ``apply(x, g, b, alpha, before_scale, dtype, out)``: ``g`` (the effective scale) and ``b``
    in the acc dtype of ``dtype`` or None, ``alpha`` a tensor of shape () or (1,); ``dtype`` the
    input dtype whose policy applies (tanh in float32 for half inputs; ``before_scale`` rounds
    ``tanh`` to it first), ``out`` y's dtype. The gradients (`normkit.reference.normalize_vjp`),
    with ``d = dy g`` and ``tanh'(u) = sech(u)^2`` (`_sech_squared_times`)::

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
        before_scale: bool,
        dtype: torch.dtype,
        out: torch.dtype,
    ) -> torch.Tensor:
        acc = _acc_dtype(dtype)
        y = torch.tanh(alpha.to(acc) * x.to(acc))
        if dtype != acc and before_scale:
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
        slope_d = _sech_squared_times(d, u)
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
