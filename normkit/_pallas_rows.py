"""The row arithmetic of normkit's Pallas kernels (`normkit._pallas`): what one program
computes on a tile of rows held in registers, in float32, forward and backward.

A tile is ``(rows, n)``, or ``(rows, groups, group_size)`` with ``group_size``: the statistic
reduces the last axis. Every row is computed in units scaled by a power of two,
``u = x 2**t``, with ``t`` chosen from the row's largest magnitude read (`scale_exponent`):
scaling by a power of two commutes with float32 rounding, so an ordinary row gets the bits of
the plain program, and a row whose squares would overflow or underflow float32 gets the careful
program's answer, with no branch and no second read of the row. The true ``r`` is ``2**t r'``
with ``r' = r(s', eps')`` of the scaled statistic and the scaled eps (``eps 4**t`` inside,
``eps 2**t`` outside); ``y_hat = c' r'`` is scale-free, as is the input gradient's bracket.

Only the operations Pallas lowers to Triton appear here (no ``reduce_precision``, no generic
``reduce``): roundings to a half dtype go through `normkit._jax_rounding.round_bits`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from normkit import _dyt, _jax_exact
from normkit._jax_rounding import round_bits

F32 = jnp.float32
#: The powers of two a row is scaled by: 2**-126 .. 2**126, normal float32 numbers.
_LOWEST, _HIGHEST = -126, 126


@dataclass(frozen=True)
class RowMath:
    """What the kernels compute per row, from the spec and the dtypes (hashable, static).

    ``read``: the elements of a row (or group) the statistic reads (partial RMS's first k);
    ``size``: the elements of a row (or group); ``masked``: a call-time mask says which it
    reads instead, their number per row; ``half``: the input's half dtype, where its
    roundings apply (None for float32); ``offset_dtype``: the half dtype ``scale_offset + w``
    is rounded to (``offset_dtype="param"``); ``affine_dtype``: the half dtype the affine
    result is rounded to before a gate after the norm (``cast="before_scale"``);
    ``residual``: the spec's residual rounding."""

    kind: str
    eps: float
    outside: bool
    fast: bool
    read: int
    size: int
    offset: float
    has_scale: bool
    has_bias: bool
    half: jnp.dtype | None
    before_scale: bool
    offset_dtype: jnp.dtype | None
    affine_dtype: jnp.dtype | None
    gate: str | None
    activation: str
    residual: str | None
    masked: bool = False

    @property
    def statistic(self) -> bool:
        return self.kind != "dyt"

    @property
    def layer(self) -> bool:
        return self.kind == "layer"

    @property
    def unread(self) -> bool:
        """Whether a row may hold elements the statistic does not read (partial RMS, a mask)."""
        return self.read < self.size or self.masked

    @property
    def degenerate(self) -> bool:
        """Whether every row's gradient takes the closed form: one element read (RMS kinds) or
        two (LayerNorm), where the general formula cancels. With a mask it is decided per row
        (`closed_rows`)."""
        return self.statistic and not self.masked and self.read == self.closed_count

    @property
    def closed_count(self) -> int:
        return 2 if self.layer else 1

    @property
    def cotangent_units(self) -> int:
        """How far below 1 the scaled cotangent's largest magnitude is put: ``2**-u`` with
        ``2**u >= size**2``, so that no term of ``r' sum_j d'_j c'_j`` (an element the
        statistic does not read, a mask's, is unbounded by the row's scale: ``c'`` up to
        float32's largest; ``r'`` at most ``sqrt(size)``), no partial sum and no product by a
        ``y_hat_i`` read (at most ``sqrt(size)``) overflows."""
        return 2 * math.ceil(math.log2(max(self.size, 2)))

    @property
    def highest(self) -> int:
        """The largest exponent a row is scaled by: a row smaller than ``floor`` (``sqrt(eps)``
        inside, where eps dominates it; ``eps 2**-64`` outside, where rows far below eps still
        reach unit scale for the gradient's ``c / sqrt(s)``) is scaled as ``floor`` is, so
        that the scaled eps stays finite."""
        floor = math.sqrt(self.eps) if not self.outside else self.eps * 2.0**-64
        return max(_LOWEST, min(_HIGHEST, -math.frexp(floor)[1]))


class Stats(NamedTuple):
    """Per row, in scaled units: the exponent ``t`` (``u = x 2**t``, int32), LayerNorm's
    ``mean`` and ``correction`` (``c = (u - mean) - correction``; zeros for the RMS kinds),
    ``s`` and ``eps`` scaled, ``r = r(s, eps)``, and the number of elements read, ``reads``."""

    t: jax.Array
    mean: jax.Array
    correction: jax.Array
    s: jax.Array
    eps: jax.Array
    r: jax.Array
    reads: jax.Array


class Terms(NamedTuple):
    """Per row, the sums of the input gradient (`backward`): the exponent ``t_d`` of the
    scaled cotangent (int32), ``sum d'`` (LayerNorm), ``sum d' y_hat``, and for rows of one
    element read (two: LayerNorm) the mean of ``d'`` read and the sums of ``d' y_hat`` and
    ``d'`` (LayerNorm) over the others; zeros where the spec has none."""

    t_d: jax.Array
    layer_sum: jax.Array
    projection: jax.Array
    own: jax.Array
    others: jax.Array
    others_sum: jax.Array


def row_sum(value: jax.Array) -> jax.Array:
    return jnp.sum(value, axis=-1, keepdims=True)


def pow2(t: jax.Array) -> jax.Array:
    """``2**t`` for integer ``t`` in [-126, 127], exactly (built from its exponent bits)."""
    return lax.bitcast_convert_type(lax.shift_left(t + 127, np.int32(23)), F32)


def ldexp(value: jax.Array, t: jax.Array) -> jax.Array:
    """``value 2**t`` for ``t`` in [-252, 252], in two exact steps (no step leaves float32's
    normal range unless the result does)."""
    first = lax.shift_right_arithmetic(t, np.int32(1))
    return value * pow2(first) * pow2(t - first)


def scale_exponent(largest: jax.Array, highest: int) -> jax.Array:
    """``t`` with ``largest 2**t`` in [1/2, 1) (``largest`` >= 0 per row), clamped to
    [-126, ``highest``]: 0 and subnormal maxima take ``highest``, infinity and NaN -126."""
    biased = lax.shift_right_logical(lax.bitcast_convert_type(largest, jnp.int32), np.int32(23))
    t = np.int32(126) - (biased & np.int32(255))
    return jnp.where(biased == 0, np.int32(highest), jnp.clip(t, _LOWEST, highest))


def rsqrt_or_inverse(s: jax.Array, eps: jax.Array, outside: bool) -> jax.Array:
    """``r(s)``: ``1 / sqrt(s + eps)`` (inside) or ``1 / (sqrt(s) + eps)`` (outside).

    The kernels' own copy of `normkit.jax.functional._r` (as `_input_grad` is of its closed
    form), earned by speed: a kernel computes a tile in registers, with the ops Pallas lowers."""
    return 1 / (jnp.sqrt(s) + eps) if outside else lax.rsqrt(s + eps)


def statistics(v: jax.Array, valid: jax.Array, read: jax.Array, m: RowMath
               ) -> tuple[jax.Array, Stats]:
    """``(c, stats)``: the rows centered and their statistic in scaled units (see the module
    docstring). LayerNorm centers twice (the mean, then the mean of the centered values, which
    recovers what the rounding of a large mean loses); ``read`` marks the elements the
    statistic reads."""
    largest = jnp.max(jnp.where(read, jnp.abs(v), 0), axis=-1, keepdims=True)
    t = scale_exponent(largest, m.highest)
    scale = pow2(t)
    u = v * scale
    zero = jnp.zeros(largest.shape, F32)
    count = row_sum(read.astype(F32)) if m.masked else zero + m.read
    mean = correction = zero
    if m.layer:
        mean = row_sum(jnp.where(read, u, 0)) / count
        correction = row_sum(jnp.where(read, u - mean, 0)) / count
    st = Stats(t, mean, correction, zero, zero, zero, count)
    c = centered(v, valid, st, m)
    s = row_sum(jnp.where(read, c * c, 0)) / count
    eps = m.eps * scale if m.outside else (m.eps * scale) * scale
    return c, st._replace(s=s, eps=eps, r=rsqrt_or_inverse(s, eps, m.outside))


def centered(v: jax.Array, valid: jax.Array, st: Stats, m: RowMath) -> jax.Array:
    """``c`` of `statistics` from its per-row values (the same bits)."""
    u = v * pow2(st.t)
    return jnp.where(valid, (u - st.mean) - st.correction, 0) if m.layer else u


def fast_y_hat(v: jax.Array, read: jax.Array, m: RowMath) -> jax.Array:
    """``variance="fast"``'s ``y_hat = (x - m1) r(v)`` with the reference's roundings,
    ``m1 = c(mean(x))``, ``m2 = c(mean(c(x^2)))``, ``v = max(0, c(m2 - c(m1^2)))``: the sums of
    float32 values in float64 (exact but within about 2**-29 ulp of a halfway point), each
    product and difference a float32 operation rounded once (`normkit._jax_exact.product`,
    infinity where it overflows). Needs 64-bit mode at trace time (`normkit._pallas` enables it
    for this kernel)."""
    f64 = jnp.float64
    x = jnp.where(read, v, 0)
    count = row_sum(read.astype(f64)) if m.masked else m.size
    m1 = (row_sum(x.astype(f64)) / count).astype(F32)
    m2 = (row_sum(_jax_exact.product(x, x).astype(f64)) / count).astype(F32)
    difference = m2 - _jax_exact.product(m1, m1)
    variance = jnp.where(difference < 0, 0, difference)  # max(0, .), keeping a NaN
    return (v - m1) * rsqrt_or_inverse(variance, jnp.asarray(m.eps, F32), m.outside)


def y_hat(v: jax.Array, read: jax.Array, c: jax.Array, st: Stats, m: RowMath) -> jax.Array:
    """``c' r'``. Elements the statistic does not read (partial RMS's beyond the first k, a
    mask's) are not bounded by the scaled maximum: where the row was scaled up they take
    ``(x - mean) (2**t r')``, unscaled (``2**t r'``, the true r, is at most ``1 / sqrt(eps)``
    or ``1 / eps``), so that ``x 2**t`` cannot overflow."""
    value = c * st.r
    if m.unread:
        down = pow2(-st.t)
        unscaled = (v - st.mean * down) - st.correction * down if m.layer else v
        value = jnp.where(read | (st.t <= 0), value, unscaled * (pow2(st.t) * st.r))
    return value


def activation(z: jax.Array, name: str) -> tuple[jax.Array, jax.Array]:
    """``a(z)`` and ``a'(z)`` (SiLU or sigmoid), both sigmoids from ``e^-|z|``."""
    e = jnp.exp(-jnp.abs(z))
    positive = z >= 0
    sig = jnp.where(positive, 1.0, e) / (1.0 + e)
    sig_neg = jnp.where(positive, e, 1.0) / (1.0 + e)
    if name == "sigmoid":
        return sig, sig * sig_neg
    return z * sig, sig * (1.0 + z * sig_neg)


def gain(w: jax.Array | None, m: RowMath) -> jax.Array | None:
    """``scale_offset + w`` in float32 (rounded to w's half dtype with
    ``offset_dtype="param"``); None without a scale."""
    if w is None:
        return None
    g = w.astype(F32)
    if m.offset:
        g = g + m.offset
        if m.offset_dtype is not None:
            g = round_bits(g, m.offset_dtype)
    return g


def affine(
    y_hat: jax.Array, g: jax.Array | None, b: jax.Array | None, m: RowMath, rounded: bool
) -> jax.Array:
    """``u = y_hat g + b``; ``rounded``: with the before-scale roundings of a half input
    (``y_hat`` to its dtype first; the forward value only, the gradients read it exact)."""
    if rounded and m.before_scale:
        assert m.half is not None
        y_hat = round_bits(y_hat, m.half)
    u = y_hat if g is None else y_hat * g
    return u if b is None else u + b


def added(x: jax.Array, residual: jax.Array, m: RowMath) -> jax.Array:
    """``x + residual`` in float32, rounded to a half input's dtype for ``residual="rounded"``:
    the values normalized, and ``h`` (rounded again where it is stored in a half dtype)."""
    total = x + residual
    if m.residual == "rounded" and m.half is not None:
        total = round_bits(total, m.half)
    return total


def forward(
    v: jax.Array,
    valid: jax.Array,
    read: jax.Array,
    a: jax.Array | None,
    g: jax.Array | None,
    b: jax.Array | None,
    alpha: jax.Array | None,
    m: RowMath,
) -> jax.Array:
    """``y`` in float32 for the values ``v`` (after the residual add), the activated gate
    ``a`` (None without one), the gain ``g`` and bias ``b`` (broadcast to the tile) and DyT's
    ``alpha``, with the before-scale roundings."""
    if m.gate == "before":
        assert a is not None
        v = v * a
    if alpha is not None:
        normalized = jnp.tanh(alpha * v)
    elif m.fast:
        normalized = fast_y_hat(v, read, m)
    else:
        normalized = y_hat(v, read, *statistics(v, valid, read, m), m)
    y = affine(normalized, g, b, m, rounded=True)
    if m.gate == "after":
        assert a is not None
        if m.before_scale and m.affine_dtype is not None:
            y = round_bits(y, m.affine_dtype)
        y = y * a
    return y


class Grads(NamedTuple):
    """The backward pass of a tile, in float32: ``dv`` (the input's gradient, before any
    residual's ``dh``), ``dgate`` (None without a gate) and the tile's terms of the parameters'
    gradients (``dy y_hat``, ``dy``, DyT's ``d x sech(alpha x)^2``)."""

    dv: jax.Array
    dgate: jax.Array | None
    dscale: jax.Array
    dbias: jax.Array
    dalpha: jax.Array | None


def backward(
    v: jax.Array,
    dy: jax.Array,
    valid: jax.Array,
    read: jax.Array,
    z: tuple[jax.Array, jax.Array] | None,
    g: jax.Array | None,
    b: jax.Array | None,
    alpha: jax.Array | None,
    m: RowMath,
    rows: tuple[Stats, Terms] | None = None,
) -> Grads:
    """`normkit.reference.normalize_vjp` (``gated_normalize_vjp`` with a gate: ``z`` is
    ``(a(z), a'(z))``) on a tile, the statistic recomputed from ``v`` (or from its per-row
    values ``rows``, `row_terms`', where the tile is a slice of its rows); the fast variance has
    the two-pass variance's gradient. The general input gradient, in scaled units::

        dx_i = 2**(t - t_d) r' (d'_i - [i read] ([layer] sum_j d'_j + z_i sum_j d'_j y_hat_j) / k)

    with ``d' = dy g 2**t_d`` scaled by a power of two below its largest magnitude
    (`RowMath.cotangent_units`: so that the row sums of large cotangents, and of huge values a
    mask leaves out, stay finite) and ``z = y_hat`` (inside) or
    ``c' / sqrt(s')`` (outside, 0 where s' = 0). Rows of one element read (RMS kinds) or two
    (LayerNorm) take the closed form of `normkit.jax.functional._input_grad`:
    ``d' eps' r'^2`` (inside; ``eps' r'`` outside), less the sums over the elements not read.
    """
    gated = v * z[0] if m.gate == "before" and z is not None else v
    if alpha is not None:
        normalized = jnp.tanh(alpha * gated)
    elif rows is None:
        c, st = statistics(gated, valid, read, m)
        normalized = y_hat(gated, read, c, st, m)
    else:
        st = rows[0]
        c = centered(gated, valid, st, m)
        normalized = y_hat(gated, read, c, st, m)
    dgate = None
    if m.gate == "after":
        assert z is not None
        dgate = dy * affine(normalized, g, b, m, rounded=False) * z[1]
        dy = dy * z[0]
    d = dy if g is None else dy * g
    if alpha is not None:  # the slope sech(alpha x)^2 from e^-2|alpha x| (normkit._dyt)
        slope, unit = _dyt.tanh_slope(alpha * gated, jnp)
        sloped = (d * slope) * unit
        return Grads(alpha * sloped, dgate, dy * normalized, dy, sloped * gated)
    terms = _terms(d, c, normalized, st, valid, read, m) if rows is None else rows[1]
    dv = _input_grad(d, c, normalized, st, terms, valid, read, m)
    if m.gate == "before":
        assert z is not None
        dgate = dv * v * z[1]
        dv = dv * z[0]
    return Grads(dv, dgate, dy * normalized, dy, None)


def row_terms(
    v: jax.Array,
    dy: jax.Array,
    valid: jax.Array,
    read: jax.Array,
    a: jax.Array | None,
    g: jax.Array | None,
    m: RowMath,
) -> tuple[Stats, Terms]:
    """The per-row values `backward` reads from ``rows``: the statistic and the sums, from
    the whole rows (``a``: the activated gate, None without one)."""
    gated = v * a if m.gate == "before" and a is not None else v
    c, st = statistics(gated, valid, read, m)
    normalized = y_hat(gated, read, c, st, m)
    if m.gate == "after" and a is not None:
        dy = dy * a
    d = dy if g is None else dy * g
    return st, _terms(d, c, normalized, st, valid, read, m)


def _terms(d: jax.Array, c: jax.Array, normalized: jax.Array, st: Stats, valid: jax.Array,
           read: jax.Array, m: RowMath) -> Terms:
    """The row sums of `Terms`. The projections ``sum_j d'_j y_hat_j`` are taken as
    ``r' sum_j d'_j c'_j``: an element the statistic does not read (a mask's) is unbounded by
    the row's scale, and its ``y_hat`` may exceed float32's range where these terms do not;
    but for the elements not read of a row scaled up, whose ``c'`` may overflow where their
    ``y_hat`` (`y_hat`'s unscaled form) does not."""
    largest = jnp.max(jnp.where(valid, jnp.abs(d), 0), axis=-1, keepdims=True)
    t_d = jnp.maximum(scale_exponent(largest, _HIGHEST) - m.cotangent_units, _LOWEST)
    scaled = jnp.where(valid, d * pow2(t_d), 0)
    own_scale = read | (st.t <= 0) if m.unread else read

    def projected(where: jax.Array | None = None) -> jax.Array:
        """``sum_j d'_j y_hat_j`` over ``where`` (all of the row for None)."""
        with_c = own_scale if where is None else own_scale & where
        total = row_sum(jnp.where(with_c, scaled * c, 0)) * st.r
        if not m.unread:
            return total
        unscaled = ~own_scale if where is None else ~own_scale & where
        return total + row_sum(jnp.where(unscaled, scaled * normalized, 0))

    zero = jnp.zeros(largest.shape, F32)
    layer_sum = row_sum(scaled) if m.layer else zero
    projection = own = others = others_sum = zero
    closed = m.degenerate or m.masked
    if not m.degenerate:
        projection = projected()
    if closed and m.layer:
        own = row_sum(jnp.where(read, scaled, 0)) / st.reads
    if closed and m.unread:
        others = projected(~read)
        if m.layer:
            others_sum = row_sum(jnp.where(read, 0, scaled))
    return Terms(t_d, layer_sum, projection, own, others, others_sum)


def _input_grad(
    d: jax.Array,
    c: jax.Array,
    normalized: jax.Array,
    st: Stats,
    terms: Terms,
    valid: jax.Array,
    read: jax.Array,
    m: RowMath,
) -> jax.Array:
    """`backward`'s input gradient, elementwise from the per-row ``st`` and ``terms``."""
    scaled = jnp.where(valid, d * pow2(terms.t_d), 0)
    if m.outside:
        positive = st.s > 0
        zeta = c * jnp.where(positive, 1 / jnp.sqrt(jnp.where(positive, st.s, 1)), 0)
    else:
        zeta = normalized
    general = scaled - (terms.layer_sum + zeta * terms.projection) / st.reads
    if m.degenerate or m.masked:
        rest = st.eps * st.r if m.outside else st.eps * st.r * st.r
        closed = (scaled - terms.own) * rest
        if m.unread:
            closed = closed - (terms.others_sum + zeta * terms.others) / st.reads
        inner = closed if m.degenerate else jnp.where(st.reads == m.closed_count, closed,
                                                      general)
    else:
        inner = general
    inner = jnp.where(read, inner, scaled)
    return ldexp(inner * st.r, st.t - terms.t_d)
