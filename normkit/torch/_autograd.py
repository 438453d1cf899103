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

from normkit.torch import _memory
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

_MANTISSA_BITS = {torch.float32: 23, torch.float64: 52, torch.bfloat16: 7, torch.float16: 10}
_EXPONENT_BIAS = {torch.float32: 127, torch.float64: 1023, torch.bfloat16: 127, torch.float16: 15}
_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
           torch.float16: torch.int16}
#: From this many elements on, a CPU input's extremes are read by ``amax`` and ``amin``, two
#: reductions each faster than the one ``aminmax`` (8192 x 4096 float32: 3.5 ms each against
#: 36 ms); below, ``aminmax`` is one op instead of two.
_AMINMAX_MOST = 2**16


def _power_of_two(biased: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2**(biased - bias)`` exactly, from the biased exponent ``biased`` (an int tensor of
    ``dtype``'s width, within its normal range: its bits shifted into place)."""
    return (biased << _MANTISSA_BITS[dtype]).view(dtype)


def _extremes(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max, min)`` of each row of ``values`` (rows, m), (rows, 1) each, read without
    autograd: max and min are exact, so the way they are read changes no bit."""
    if values.requires_grad:
        values = values.detach()
    if _traced() or values.device.type == "cpu" and values.numel() >= _AMINMAX_MOST:
        return values.amax(dim=-1, keepdim=True), values.amin(dim=-1, keepdim=True)
    lo, hi = torch.aminmax(values, dim=-1, keepdim=True)
    return hi, lo


def _unit_exponent(
    values: torch.Tensor, most: int, dtype: torch.dtype, sums: RowSums | None = None
) -> torch.Tensor:
    """Per row of ``values`` (rows, m), the biased exponent in ``dtype`` (float32 or float64)
    of the power of two that brings its largest magnitude into [1, 2), at most ``most`` (a
    biased exponent) and at least the least normal one. (rows, 1), an int. A row holding an
    infinity or a NaN gets the least: its values are NaN, zero or infinite whatever the scale,
    as the reference's. ``sums`` reads the extremes (None: `_extremes`)."""
    bias = _EXPONENT_BIAS[dtype]
    # max |v| as max(max v, -min v): reductions that read the rows, where abs() writes a copy
    # and the inf-norm reduction took three times as long
    hi, lo = _extremes(values) if sums is None else sums.extremes(values)
    largest = torch.maximum(hi, lo.neg_())
    if largest.dtype != dtype:
        largest = largest.to(dtype)
    field = largest.view(_INT_OF[dtype]) >> _MANTISSA_BITS[dtype]  # the exponent's field
    return (2 * bias - field).clamp(1, most)  # clamp_ has no batching rule (torch.func.vmap)


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
    """``mean(head**2)`` per row, (rows, 1), of rows scaled so that no square overflows.

    In eager code ``vecdot(head, head) / k``: on the CPU the same products and the same
    inner-dim reduction as Hugging Face's and torch's ``x.pow(2).mean(-1)``, so that a swapped
    norm keeps their bits (tests/port); torch's 2-norm reads a row 35 times faster on the CPU
    (8192 x 4096 float32) but sums it in another order. A row of more than `_NORM_BLOCK`
    elements is taken in blocks of it, then the blocks' sums: torch's CPU reductions split such
    a row among threads in some batch sizes and not in others (a row of 40000 alone and in a
    batch of 16), which changed its bits; a block is always summed on one thread. Compiled, the
    ops are those Inductor fuses; for the CPU summed in float64 (its CPU code sums a row into a
    few running float32 totals, whose roundings add up to 2e-6 to 3e-5 of the sum on rows of
    4096)."""
    k = head.shape[-1]
    if _traced() and head.device.type == "cpu" and head.dtype == torch.float32:
        total = (head * head).sum(dim=-1, keepdim=True, dtype=torch.float64).to(head.dtype)
    elif _traced() or k <= _NORM_BLOCK:
        total = torch.linalg.vecdot(head, head).unsqueeze(-1)
    else:
        whole = k // _NORM_BLOCK * _NORM_BLOCK
        blocks = head[:, :whole].reshape(head.shape[0], -1, _NORM_BLOCK)
        parts = torch.linalg.vecdot(blocks, blocks)
        if whole < k:
            tail = head[:, whole:]
            parts = torch.cat([parts, torch.linalg.vecdot(tail, tail).unsqueeze(-1)], dim=-1)
        total = parts.sum(dim=-1, keepdim=True)
    return total / k


#: The longest row `_mean_square` and `_row_sum` sum in one piece.
_NORM_BLOCK = 4096


def _row_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of each row of ``t`` (rows, m), (rows, 1). In eager code a row longer than
    `_NORM_BLOCK` is summed in blocks of it, then their sums: torch's CPU sum splits a long row
    among threads in some batch sizes and not in others (a row of 40000 alone and in a batch
    of 16), which changed its bits; a block is always summed on one thread. Traced, the plain
    sum, which compilers fuse."""
    m = t.shape[-1]
    if _traced() or m <= _NORM_BLOCK:
        return t.sum(dim=-1, keepdim=True)
    whole = m // _NORM_BLOCK * _NORM_BLOCK
    parts = t[:, :whole].reshape(t.shape[0], -1, _NORM_BLOCK).sum(dim=-1)
    if whole < m:
        parts = torch.cat([parts, t[:, whole:].sum(dim=-1, keepdim=True)], dim=-1)
    return parts.sum(dim=-1, keepdim=True)


def _row_mean(t: torch.Tensor) -> torch.Tensor:
    """The mean of each row of ``t``, (rows, 1), as `_row_sum` sums it."""
    return t.mean(dim=-1, keepdim=True) if _traced() else _row_sum(t) / t.shape[-1]


def _center(xf: torch.Tensor) -> torch.Tensor:
    """``x - mean(x)`` per row, with one correction pass (the mean of the centered values is
    subtracted again), which recovers what the rounding of a large mean loses."""
    if xf.shape[-1] == 2:
        # x - mean(x) = (x - x_other) / 2: one rounding, relative to the centered values.
        return (xf - xf.flip(-1)) / 2
    centered = xf - _row_mean(xf)
    return centered - _row_mean(centered)


class RowSums:
    """How the composite math reduces along its rows: over each row of a tensor that holds the
    whole row (`LOCAL_ROWS`: the functions above). ``normkit.torch.distributed`` subclasses it
    for rows whose elements are spread across ranks: the same math, its sums all-reduced."""

    extremes = staticmethod(_extremes)
    sum = staticmethod(_row_sum)
    mean = staticmethod(_row_mean)
    mean_square = staticmethod(_mean_square)
    center = staticmethod(_center)

    def length(self, t: torch.Tensor) -> int:
        """The length of the rows ``t`` holds blocks of (here: the whole of them)."""
        return t.shape[-1]

    def head(self, k: int) -> int:
        """How many of the statistic's first ``k`` elements the blocks hold."""
        return k

    def mean_and_sum(self, t: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean of each row of t, sum of each row of u)``, in one reduction where it can."""
        return _row_mean(t), _row_sum(u)


LOCAL_ROWS = RowSums()


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
    x: torch.Tensor, rows: RowSpec, in_place: bool = False, statistic: bool = True,
    sums: RowSums = LOCAL_ROWS,
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
    most = _largest_exponent(rows.eps, rows.outside, acc)
    layer = rows.kind == "layer"
    k = sums.head(rows.k)
    whole = layer or k == x.shape[-1]  # the statistic reads every element
    if in_place:  # the extremes read from x as it is, c written in one pass of its own
        e = _unit_exponent(x if whole else x[:, :k], most, acc, sums)
        sigma = _power_of_two(e, acc)
        c = _converted(x, acc).mul_(sigma) if x.dtype != acc else torch.mul(
            x, sigma, out=_memory.empty_like(x))
    else:
        xf = x.to(acc)
        e = _unit_exponent(xf if layer else xf[:, :k], most, acc, sums)
        sigma = _power_of_two(e, acc)
        c = xf * sigma  # x is never written
    if layer:
        bias = _EXPONENT_BIAS[acc]
        if in_place and c.shape[-1] > 2:
            # the second centering and the second scaling in one pass: (c - m2) sigma2 =
            # c sigma2 - m2 sigma2, each product exact
            c = c.sub_(sums.mean(c))
            sigma2 = _power_of_two(
                torch.minimum(_unit_exponent(c, most, acc, sums), most + bias - e), acc)
            c = torch.addcmul(sums.mean(c).mul_(-sigma2), c, sigma2, out=c)
        else:
            c = sums.center(c)
            sigma2 = _power_of_two(
                torch.minimum(_unit_exponent(c, most, acc, sums), most + bias - e), acc)
            c = c * sigma2
        sigma = sigma * sigma2  # exact: powers of two whose product is at most 2**most
    s = sums.mean_square(c if whole else c[:, :k]) if statistic else c.new_empty(0)
    eps = sigma * rows.eps if rows.outside else sigma * sigma * rows.eps
    return _Scaled(c, s, eps, sigma)


def _rstd(s: torch.Tensor, eps: float | torch.Tensor, outside: bool) -> torch.Tensor:
    """``r(s)``: ``1/sqrt(s + eps)`` (inside) or ``1/(sqrt(s) + eps)`` (outside).

    The composite paths' one r(s) (ops, sharded). Other copies are earned: the numba and Triton
    kernels' in their row loops (speed), `normkit.torch._eager`'s in the host's op order (bits)."""
    return torch.reciprocal(torch.sqrt(s) + eps) if outside else torch.rsqrt(s + eps)


def _direction(head: torch.Tensor, sums: RowSums = LOCAL_ROWS) -> torch.Tensor:
    """``z = c / sqrt(s)`` over the elements the statistic reads, ``head`` (the first k of c;
    all of it for layer), 0 where s = 0: eps outside's ``x_i r'(s) = -r**2 z_i / 2``. z does not
    depend on the row's scale (|z| <= sqrt(k)): it is taken from the row multiplied by the power
    of two that brings its largest magnitude into [1, 2), uncapped, where no square
    underflows."""
    uncapped = 2 * _EXPONENT_BIAS[head.dtype]
    unit = head * _power_of_two(_unit_exponent(head, uncapped, head.dtype, sums), head.dtype)
    s = sums.mean_square(unit)
    return torch.where(s > 0, unit / torch.sqrt(torch.where(s > 0, s, 1.0)), 0.0)


def _fast_statistic(x: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``variance="fast"``: ``(x - m1, max(0, m2 - m1^2))`` per row, each step in ``acc``, with
    ``m1 = mean(x)`` and ``m2 = mean(x^2)``."""
    xf = x.to(acc)
    m1 = _row_mean(xf)
    m2 = _row_mean(xf * xf)
    return xf - m1, torch.clamp_min(m2 - m1 * m1, 0.0)


def _converted(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, in eager code a buffer of the call's (``t`` itself where it has that
    dtype): on the CPU an op that reads one dtype and writes another is 8-10 times slower than
    a conversion followed by ops in one dtype (8192 x 4096 bfloat16 into float32: 84 ms against
    10 ms)."""
    return t if t.dtype == dtype else _memory.empty_like(t, dtype).copy_(t)


def _affine(
    y: torch.Tensor, g: torch.Tensor | None, b: torch.Tensor | None, in_place: bool = False,
    out: torch.dtype | None = None,
) -> torch.Tensor:
    """``y * g + b`` (either absent) in ``out`` (default y's dtype); ``in_place``: written over
    ``y`` (then converted)."""
    if out is None or out == y.dtype:
        if g is not None and b is not None:
            return torch.addcmul(b, y, g, out=y) if in_place else torch.addcmul(b, y, g)
        if g is not None:
            return y.mul_(g) if in_place else y * g
        if b is not None:
            return y.add_(b) if in_place else y + b
        return y
    if not in_place:
        return _affine(y, g, b).to(out)
    return _converted(_affine(y, g, b, in_place=True), out)


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
    sums: RowSums = LOCAL_ROWS,
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
    dependence on x): it is recomputed. In plain eager code an RMS row with eps inside takes
    ``y_hat = x r`` from the saved r (a product that neither overflows nor underflows where
    y_hat does not), without the scaled rows.
    """
    n, k = sums.length(x), rows.k
    head = sums.head(k)
    in_place = sums is LOCAL_ROWS and not torch.is_grad_enabled() and not _traced()
    layer = rows.kind == "layer"
    if in_place and r is not None and not rows.outside and not layer and k > 1:
        r_row = r.unsqueeze(-1)
        y_hat = _converted(x, r.dtype).mul_(r_row) if x.dtype != r.dtype else torch.mul(
            x, r_row, out=_memory.empty_like(x))
        return _backward_in_place(y_hat, r_row, g, dy, rows, x.dtype, need_g, need_b)
    scaled = _scaled(x, rows, in_place, statistic=r is None, sums=sums)
    if r is None:
        r_scaled = _rstd(scaled.s, scaled.eps, rows.outside)
    else:
        r_scaled = r.unsqueeze(-1).to(scaled.sigma.dtype) / scaled.sigma  # exact: a power of two
    if in_place and not rows.outside and (k > 2 if layer else k > 1):
        y_hat = scaled.c.mul_(r_scaled)
        return _backward_in_place(y_hat, r_scaled * scaled.sigma, g, dy, rows, x.dtype,
                                  need_g, need_b)
    acc = r_scaled.dtype
    dyf = dy.to(acc)
    d = dyf * g if g is not None else dyf
    u = _direction(scaled.c if layer else scaled.c[:, :head], sums) if rows.outside else None
    y_hat = scaled.c * r_scaled
    if rows.outside:
        rest = scaled.eps * r_scaled
    else:
        u = y_hat if layer or head == x.shape[-1] else y_hat[:, :head]
        rest = scaled.eps * r_scaled * r_scaled
    assert u is not None
    inner = _gradient_direction(d, y_hat, u, rest, layer, n, k, head, sums)
    dx = r_scaled * inner * scaled.sigma
    dg = torch.sum(dyf * y_hat, dim=0) if need_g else None
    db = torch.sum(dyf, dim=0) if need_b else None
    return dx.to(x.dtype), dg, db


def _gradient_direction(
    d: torch.Tensor, y_hat: torch.Tensor, u: torch.Tensor, rest: torch.Tensor, layer: bool,
    n: int, k: int, head: int, rows: RowSums,
) -> torch.Tensor:
    """``dx / r`` of `_backward`'s closed forms, from ``d = dy g``, ``y_hat``, ``u`` (the first
    ``head`` elements of its row's ``k``) and ``rest = 1 - u_0 y_hat_0`` (``eps r**2`` inside,
    ``eps r`` outside), on blocks of rows of ``n`` elements whose statistic reads the first
    ``k``; ``head`` of them are in this block, and ``rows`` takes the row sums::

        layer:          d - mean(d) - u sum(d y_hat) / n     (n = 2: rest (d - mean(d)))
        rms, k = 1:     d_0 rest - u_0 sum_{j >= 1} d_j y_hat_j, then d_j
        rms:            d - [i < k] u sum(d y_hat) / k
    """
    if layer:
        mean_d, dot = rows.mean_and_sum(d, d * y_hat)
        centered_d = d - mean_d
        return rest * centered_d if n == 2 else centered_d - u * (dot / n)
    if k == 1:  # the head's 1 - u_0 y_hat_0 cancels: taken as rest
        others = rows.sum(d[:, head:] * y_hat[:, head:])
        return torch.cat([d[:, :head] * rest - u[:, :head] * others, d[:, head:]], dim=-1)
    dot = rows.sum(d * y_hat)
    if head == d.shape[-1]:
        return d - u * (dot / k)
    return torch.cat([d[:, :head] - u * (dot / k), d[:, head:]], dim=-1)


def _backward_in_place(
    y_hat: torch.Tensor, r: torch.Tensor, g: torch.Tensor | None, dy: torch.Tensor,
    rows: RowSpec, dtype: torch.dtype, need_g: bool, need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`_backward` with eps inside (``u = y_hat``), for LayerNorm rows and RMS rows with
    ``k > 1``, in plain eager code, from ``y_hat`` (a buffer of the call's, in the acc dtype)
    and the true ``r`` per row (rows, 1): in two buffers, y_hat and ``p = dy * y_hat`` (then
    dx). ``p`` gives ``dg`` (its column sums) and the rows' ``sum_j d_j y_hat_j`` (the row sums
    of ``p g``), then becomes ``dx = r (d - mean(d) - y_hat dot / k)``, written in x's
    ``dtype``."""
    n, k = y_hat.shape[-1], rows.k
    dy = _converted(dy, y_hat.dtype)
    p = torch.mul(dy, y_hat, out=_memory.empty_like(y_hat))
    dg = p.sum(dim=0) if need_g else None
    db = dy.sum(dim=0) if need_b else None
    # sum_j d_j y_hat_j as a row sum of p g (a matrix-vector product, BLAS's gemv, sums a
    # batch of one row in another order than a row of a larger batch)
    dot = _row_sum(p.mul_(g) if g is not None else p)
    d = torch.mul(dy, g, out=p) if g is not None else p.copy_(dy)
    if rows.kind == "layer":
        d.sub_(_row_mean(d))
        d.addcmul_(y_hat, dot.div_(-n))
    else:
        d[:, :k].addcmul_(y_hat[:, :k], dot.div_(-k))
    return _converted(d.mul_(r), dtype), dg, db


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
        return _affine(y, g, b, in_place=not _traced(), out=out), r.squeeze(-1)

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


# ---- torch's fused kernels on rows preconditioned one by one -----------------------------------
# torch's LayerNorm kernel (``native_layer_norm``) and, on CUDA, its RMSNorm kernel
# (``_fused_rms_norm``) neither rescale nor recenter a row: one whose squares overflow comes
# back NaN, and a LayerNorm row whose mean dwarfs its spread loses digits to the mean. Before
# them each row is preconditioned, by the same ops for every row (nothing is read back): a
# LayerNorm row that does not cross zero and whose range is at most its least magnitude is
# shifted by that value (the row minus it is exact: Sterbenz), and a row whose (shifted)
# magnitude reaches 2**L is scaled down by a power of two to below it (`_FUSED_LIMIT`). An
# ordinary row is multiplied by 1 and shifted by 0: the kernel reads it as it is and gives it
# torch's bits. eps needs no correction: it decides r only where a row is far below 1, which
# is never scaled, and is negligible beside a row large enough to be (`_FUSED_EPS`).

#: Rows whose magnitude (a LayerNorm row's: its range) reaches 2**L are scaled to below it,
#: where no sum of the kernels' squares overflows (``n 2**(2L+2)`` below the largest float for
#: n < 2**30); the statistic of a row so scaled is at least 2**(2L-3) / n.
_FUSED_LIMIT = {torch.float32: 48, torch.bfloat16: 48, torch.float16: 48, torch.float64: 300}
#: The eps (in the acc dtype) with which torch's kernels get every row right, preconditioned:
#: at least the least with which a row too small to scale is right as it is (where its squares
#: underflow, |x| < 2**-63 in float32, s < 2**-126 is below 2**-26 eps: eps alone decides r to
#: float32's precision whatever the squares lost), at most the largest beside which a scaled
#: row's statistic (`_FUSED_LIMIT`) leaves eps negligible (below 2**-30 of it for n < 2**28 in
#: float32), as it is beside the row's own.
_FUSED_EPS = {torch.float32: (2.0**-100, 2.0**16), torch.float64: (2.0**-968, 2.0**500)}


def fused_computes(rows: RowSpec, dtype: torch.dtype, values: torch.dtype, out: torch.dtype,
                   device: str, bias: bool) -> bool:
    """Whether `FusedNorm` computes ``rows`` on rows of ``values`` whose dtype policy is
    ``dtype``'s (y in ``out``) on ``device`` (a device type; ``bias``: whether there is one):
    LayerNorm with eps inside and the two-pass variance (n > 2: smaller rows take the closed
    form) on float32, float64 and, cast after the scale, half inputs; on CUDA, RMSNorm with eps
    inside and no bias on float32 and float64 (torch's CPU RMSNorm is slower than the
    composite path's, and it has no CPU backward)."""
    least, most = _FUSED_EPS[_acc_dtype(dtype)]
    acc = _acc_dtype(dtype)
    if values != dtype or out != dtype or rows.outside or not least <= rows.eps <= most:
        return False
    if rows.kind == "layer":
        return rows.n > 2 and not rows.fast_variance and not (rows.before_scale and dtype != acc)
    return rows.kind == "rms" and device == "cuda" and dtype == acc and rows.n > 1 and not bias


def _preconditioner(x: torch.Tensor, shift: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(sigma, offset)`` per row of ``x`` (rows, 1), in x's dtype: the preconditioned row is
    ``x sigma + offset = (x - t) sigma``, exactly. sigma is a power of two, 1 below
    `_FUSED_LIMIT`; with ``shift`` (LayerNorm), ``t`` is the row's value nearest zero where the
    row does not cross zero and its range is at most that value's magnitude, else 0 (offset None
    without ``shift``). A row with an infinity or a NaN is scaled by the least factor: it stays
    what it was."""
    hi, lo = _extremes(x)
    dtype = x.dtype
    offset = None
    if shift:
        spread = hi - lo  # after the shift the row's magnitude, else within a factor 2 of it
        near = torch.minimum(lo.clamp_min(0), hi)  # the value of [lo, hi] nearest zero
        t = torch.where(near.abs() >= spread, near, 0.0)
        magnitude = spread
    else:
        magnitude = torch.maximum(hi, lo.neg_())
    bias, bits = _EXPONENT_BIAS[dtype], _MANTISSA_BITS[dtype]
    field = magnitude.view(_INT_OF[dtype]) >> bits  # infinite or NaN: the largest field
    sigma = _power_of_two((2 * bias + _FUSED_LIMIT[dtype] - 1 - field).clamp_(max=bias), dtype)
    if shift:
        offset = torch.mul(t, sigma).neg_()
    return sigma, offset


_rms_norm_backward = torch.ops.aten._fused_rms_norm_backward
"""torch's RMSNorm backward kernel (CUDA's; it has none on the CPU, where a test puts torch's
decomposition of it in its place)."""


class FusedNorm(torch.autograd.Function):
    """``y = normalize(x)`` by torch's fused LayerNorm or (CUDA) RMSNorm kernels, forward and
    backward, on rows preconditioned one by one (`_preconditioner`): an ordinary row gets torch's
    bits (``torch.nn.LayerNorm``'s, and on CUDA ``torch.nn.RMSNorm``'s), a row whose squares
    overflow or whose mean dwarfs its spread the reference's values. Plain eager code only
    (`fused_computes` says for which specs); ``apply(x, g, b, rows, dtype, out)`` as
    `NormFunction`'s, ``g`` and ``b`` in the acc dtype.

    The backward gives torch's backward kernel each row scaled by the power of two at or below
    its r (so that ``x`` and ``dy x`` stay far from overflow, whatever the row's size, and the
    kernel's ``r**3`` too), its mean and r scaled alike: the kernel's every rounding scales
    exactly, so an ordinary row's gradients keep torch's bits; dx is scaled back. Half inputs
    take it in float32, whose weight and bias gradients torch's kernels sum in float32 (in
    half precision, which they sum in otherwise, they were 3e-2 of their largest off). A second
    derivative takes `_backward`'s differentiable formulas.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, g: torch.Tensor | None, b: torch.Tensor | None,
        rows: RowSpec, dtype: torch.dtype, out: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = rows.kind == "layer"
        n = x.shape[-1]
        sigma, offset = _preconditioner(x, layer)
        pre = torch.mul(x, sigma, out=_memory.empty_like(x))
        if offset is not None:  # (x - t) sigma, exact (Sterbenz) in any dtype
            pre.add_(offset)  # in half precision mul and add take a sixth of addcmul's time
        if layer:
            y, mean, rstd = torch.native_layer_norm(pre, (n,), g, b, rows.eps)
        else:
            y, rstd = torch.ops.aten._fused_rms_norm(pre, [n], g, rows.eps)
            mean = None
        r = rstd.mul_(sigma).squeeze(-1)  # the true r: rstd in the rows' own units
        ctx.save_for_backward(x, g, b, r, mean, sigma, offset)
        ctx.rows = rows
        ctx.mark_non_differentiable(r)
        return y, r

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor, _dr: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        x, g, b, r, mean, sigma, offset = ctx.saved_tensors
        rows: RowSpec = ctx.rows
        need_x, need_g, need_b = ctx.needs_input_grad[:3]
        need_g, need_b = need_g and g is not None, need_b and b is not None
        if torch.is_grad_enabled():  # a second derivative: the differentiable formulas
            grads = _backward(x, None, g, dy, rows, need_g, need_b)
            return (grads[0] if need_x else None), grads[1], grads[2], None, None, None
        acc, n = r.dtype, x.shape[-1]
        r = r.unsqueeze(-1)
        bias = _EXPONENT_BIAS[acc]
        field = r.view(_INT_OF[acc]) >> _MANTISSA_BITS[acc]
        scale = _power_of_two(field.clamp_(1, 2 * bias), acc)  # 2**floor(log2 r)
        ratio = scale / sigma  # exact: powers of two
        if offset is None:
            rows_b = _converted(x, acc).mul_(scale) if x.dtype != acc else torch.mul(
                x, scale, out=_memory.empty_like(x))
        else:  # the forward's rows, then scaled: x scale itself can overflow (a constant row)
            rows_b = _converted(x, acc)
            rows_b = torch.addcmul(offset.to(acc), rows_b, sigma.to(acc),
                                   out=rows_b if rows_b is not x else _memory.empty_like(x))
            rows_b.mul_(ratio)
        dy = _converted(dy.contiguous(), acc)
        db = None
        if rows.kind == "layer":
            dx_b, dg, db = torch.ops.aten.native_layer_norm_backward(
                dy, rows_b, (n,), mean * ratio, r / scale, g, b, [need_x, need_g, need_b])
        else:
            dx_b, dg = _rms_norm_backward(dy, rows_b, [n], r / scale, g, [need_x, need_g])
        dx = None
        if need_x:
            dx = _converted(dx_b.mul_(scale), x.dtype)
        return dx, dg, db, None, None, None


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
