"""The numba row kernels behind `normkit.torch.kernels.cpu`: forward and backward of every kind.

Rows are float32, or the bits of bfloat16 (as int16) or float16 (as uint16): the array's dtype
selects, at compile time, how an element is read as float32 and how a float32 result is
rounded back (to nearest even, by integer operations), so every loop reads the input once from
memory and writes its output once, with no row buffer.

Per row the statistic is summed in float32 within chunks of `CHUNK` elements (eight lanes per
vector) and in float64 across chunks, so rows of n = 2**20 keep their precision; a sum that
overflows float32, or squares that underflow it, is taken again in float64. LayerNorm takes two
passes and corrects the mean by the mean of the centered values. The elementwise pass runs in
float32 on ``((x - m_hi) - m_lo) * r`` (the mean split into two float32 parts); a row whose
scalars leave float32's comfortable range (|x| near the float32 maximum, a tiny eps outside the
root, NaN or inf) takes the same pass in float64.

Each row is read from memory once: first by loops that only read (the forward's statistic, the
backward's dot products, LayerNorm's in float64 and shifted by the row's first element; the
backward reuses the forward's ``r``), then by the loop that writes its output from the cache.
A loop without stores vectorizes unconditionally, so a row's sums, and its bits, depend on the
row alone. Threads claim blocks of rows as they come (`_claim`).

The formulas are those of `normkit.reference.normalize` and `normalize_vjp`.
"""

# numba compiles this module: its scalars are numpy float32/float64 where the annotations say
# float, and intrinsics take numba's typing context implicitly.
# mypy: disable-error-code="call-arg, var-annotated, return-value, arg-type, assignment"

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

RMS, PARTIAL_RMS, LAYER = 0, 1, 2
NO_GATE, GATE_BEFORE, GATE_AFTER = 0, 1, 2
ROW_DTYPES = {"float32": np.float32, "bfloat16": np.int16, "float16": np.uint16}

_FAST_LOW = 1e-30
_FAST_HIGH = 1e30
_TWO_M24 = np.float32(2.0**-24)
_TWO_P24 = np.float32(2.0**24)
_TWO_P23 = np.float32(2.0**23)
_REDUCE = {"reassoc", "contract"}
CHUNK = 256
_UNCOUNTED: dict[str, Any] = {"_nrt": False}  # numba's option (untyped in its stubs)


def _row_jit(**options: Any) -> Any:
    """``njit`` for everything under the entry points (the tasks, the row functions, their
    loops): compiled without numba's reference counting (``_nrt=False``).

    With it every array a function receives, and every row slice it makes, costs an atomic
    increment and decrement of its owner's count: 40-50 per row in the backward, on counters
    all threads share, about 300 ns per row on one thread (8192 x 4096 float32: as much as a
    tenth of the call). These functions allocate nothing, and return an array only to one
    another (an entry point, which counts, would release a reference never taken): the
    arrays belong to the entry points' callers for the whole launch, and the entry points,
    which count, make each task's scratch rows (`_scratch`)."""
    return njit(cache=True, **_UNCOUNTED, **options)


def signatures(dtype: str) -> tuple[str, str]:
    """The numba signatures of `forward` and `backward` for rows of ``dtype``."""
    rows = f"{np.dtype(ROW_DTYPES[dtype]).name}[:, ::1]"
    vec = "float32[::1]"
    forward_sig = (
        f"void({rows}, {vec}, {vec}, {rows}, {vec}, int64, int64, float64, boolean, boolean, "
        "int64, int64)"
    )
    backward_sig = (
        f"void({rows}, {vec}, {rows}, {vec}, {rows}, float32[:, ::1], float32[:, ::1], {vec}, "
        f"{vec}, int64, int64, float64, boolean, boolean, boolean, int64, int64, int64)"
    )
    return forward_sig, backward_sig


def gated_signatures(dtype: str) -> tuple[str, str]:
    """The numba signatures of `gated_forward` and `gated_backward` for rows of ``dtype``."""
    rows = f"{np.dtype(ROW_DTYPES[dtype]).name}[:, ::1]"
    vec = "float32[::1]"
    table = "float32[:, ::1]"
    forward_sig = (
        f"void({rows}, {rows}, {vec}, {vec}, {rows}, {table}, int64, int64, int64, float64, "
        "boolean, boolean, int64, boolean, boolean, int64, int64)"
    )
    backward_sig = (
        f"void({rows}, {rows}, {table}, {rows}, {vec}, {vec}, {rows}, {rows}, {table}, {table}, "
        f"{vec}, {vec}, int64, int64, int64, float64, boolean, int64, boolean, boolean, "
        "boolean, int64, int64)"
    )
    return forward_sig, backward_sig


# ---- bit casts and the half formats ----------------------------------------------------------


@intrinsic
def _float_from_bits(typingctx: Any, bits: Any) -> Any:
    """The float32 whose bits are the uint32 ``bits``."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of_float(typingctx: Any, value: Any) -> Any:
    """The bits of the float32 ``value`` as a uint32."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@_row_jit()
def _bf16_value(h: int) -> float:
    return _float_from_bits(np.uint32(np.uint16(h)) << 16)


@_row_jit()
def _bf16_bits_of_number(v: float) -> int:
    """`_bf16_bits` of a ``v`` that is a number, an infinity or the NaN arithmetic makes from
    numbers (the default NaN, 0xFFC00000), without the test for other NaNs: a NaN's payload
    can carry the rounding's addition out of the exponent (0x7FFFFFFF to -0.0)."""
    u = _bits_of_float(v)
    return np.int16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@_row_jit()
def _bf16_bits(v: float) -> int:
    """``v`` rounded to nearest even bfloat16; NaN stays a (quiet) NaN."""
    u = _bits_of_float(v)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return np.int16((u >> 16) | 0x40)
    return _bf16_bits_of_number(v)


@_row_jit()
def _f16_value(h: int) -> float:
    e = np.uint32(h)
    sign = (e & 0x8000) << 16
    em = e & 0x7FFF
    if em >= 0x7C00:
        return _float_from_bits(sign | 0x7F800000 | ((em & 0x3FF) << 13))
    if em >= 0x400:
        return _float_from_bits(sign | ((em << 13) + 0x38000000))
    v = np.float32(em) * _TWO_M24
    return -v if sign else v


@_row_jit()
def _f16_bits(v: float) -> int:
    """``v`` rounded to nearest even float16; beyond 65520 infinity; NaN a quiet NaN."""
    u = _bits_of_float(v)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return np.uint16(sign | 0x7E00 | ((a >> 13) & 0x3FF))
    if a >= 0x477FF000:
        return np.uint16(sign | 0x7C00)
    if a >= 0x38800000:
        m = a - 0x38000000
        return np.uint16(sign | ((m + 0xFFF + ((m >> 13) & 1)) >> 13))
    scaled = abs(v) * _TWO_P24
    return np.uint16(sign | np.uint32((scaled + _TWO_P23) - _TWO_P23))


@_row_jit()
def _round_to_odd(v: float) -> float:
    """The float64 ``v`` as float32, rounded to odd: a later rounding to a half format is then
    the correct rounding of ``v`` itself (no double-rounding error)."""
    f = np.float32(v)
    if np.float64(f) != v and np.isfinite(f):
        u = _bits_of_float(f)
        if (u & 1) == 0:
            u = u - 1 if abs(np.float64(f)) > abs(v) else u + 1
            f = _float_from_bits(u)
    return f


def _load(row: np.ndarray, j: int) -> float:
    """Element ``j`` of a row as float32 (bfloat16 / float16 bits widened exactly)."""
    raise NotImplementedError


def _store(row: np.ndarray, j: int, v: float) -> None:
    """Store the float32 ``v`` at element ``j``, rounded to nearest even for half rows."""
    raise NotImplementedError


def _round_like(row: np.ndarray, v: float) -> float:
    """The float64 ``v`` rounded once to the row's dtype, as float32."""
    raise NotImplementedError


def _store_number(row: np.ndarray, j: int, v: float) -> None:
    """`_store` of a ``v`` made by arithmetic from operands none of which is a NaN
    (`_bf16_bits_of_number`): a bfloat16 row's rounding skips the test for NaN, a third of
    the common forward loop's instructions."""
    raise NotImplementedError


# The implementations repeat the typing functions' parameters, annotations included: numba
# compares the two signatures.


@overload(_load)
def _load_impl(row: Any, j: Any) -> Any:
    if row.dtype == types.int16:

        def load_bf16(row: Any, j: Any) -> Any:
            return _bf16_value(row[j])

        return load_bf16
    if row.dtype == types.uint16:

        def load_f16(row: Any, j: Any) -> Any:
            return _f16_value(row[j])

        return load_f16

    def load_f32(row: Any, j: Any) -> Any:
        return row[j]

    return load_f32


def _storing(bf16_bits: Any) -> Any:
    """The overload implementation of a store whose bfloat16 rounding is ``bf16_bits``."""

    def implementation(row: Any, j: Any, v: Any) -> Any:
        if row.dtype == types.int16:

            def store_bf16(row: Any, j: Any, v: Any) -> Any:
                row[j] = bf16_bits(v)

            return store_bf16
        if row.dtype == types.uint16:

            def store_f16(row: Any, j: Any, v: Any) -> Any:
                row[j] = _f16_bits(v)

            return store_f16

        def store_f32(row: Any, j: Any, v: Any) -> Any:
            row[j] = v

        return store_f32

    return implementation


overload(_store)(_storing(_bf16_bits))
overload(_store_number)(_storing(_bf16_bits_of_number))


@overload(_round_like)
def _round_like_impl(row: Any, v: Any) -> Any:
    if row.dtype == types.int16:

        def round_bf16(row: Any, v: Any) -> Any:
            return _bf16_value(_bf16_bits(_round_to_odd(v)))

        return round_bf16
    if row.dtype == types.uint16:

        def round_f16(row: Any, v: Any) -> Any:
            return _f16_value(_f16_bits(_round_to_odd(v)))

        return round_f16

    def round_f32(row: Any, v: Any) -> Any:
        return np.float32(v)

    return round_f32


# ---- per-row reductions ---------------------------------------------------------------------
# A row's sums are float32 within chunks of `CHUNK` elements (eight float32 lanes per vector,
# reassociated) and float64 across chunks; a sum that is not finite, or a statistic too small
# for float32 squares, is taken again in float64 (`_exact_*`).


@_row_jit(fastmath=_REDUCE)
def _add(acc: float, v: float) -> float:
    """``acc + v``, reassociable: a loop accumulating with it vectorizes."""
    return acc + v


@_row_jit(fastmath=_REDUCE)
def _add_square(acc: float, v: float) -> float:
    """``acc + v^2``, reassociable: a loop accumulating with it vectorizes."""
    return acc + v * v


@_row_jit(inline="always")
def _chunk_sum(row: np.ndarray, square: bool, start: int, stop: int) -> float:
    """``sum(row)`` (``sum(row^2)`` with ``square``) over elements ``start:stop`` (unsigned: no
    negative-index check, so the loop vectorizes) in float32."""
    acc = np.float32(0.0)
    if square:
        for j in range(start, stop):
            acc = _add_square(acc, _load(row, j))
    else:
        for j in range(start, stop):
            acc = _add(acc, _load(row, j))
    return acc


@_row_jit()
def _exact_sum(row: np.ndarray, square: bool) -> float:
    """``sum(row)`` (``sum(row^2)`` with ``square``) in float64."""
    acc = 0.0
    if square:
        for j in range(row.size):
            acc = _add_square(acc, np.float64(_load(row, j)))
    else:
        for j in range(row.size):
            acc = _add(acc, np.float64(_load(row, j)))
    return acc


@_row_jit()
def _checked(total: float, row: np.ndarray, square: bool) -> float:
    """``total``, a chunked `_row_sum` of ``row``, or the exact one where float32 may have lost
    it: a sum of squares below `_FAST_LOW` (squares under float32's normal range) and any sum
    that is not finite (overflow, or a NaN or infinity in the row)."""
    if np.isfinite(total) and (not square or total > _FAST_LOW):
        return total
    return _exact_sum(row, square)


@_row_jit()
def _row_sum(row: np.ndarray, square: bool) -> float:
    """``sum(row)`` (``sum(row^2)`` with ``square``): float32 chunks added in float64."""
    n = np.uint64(row.size)
    chunk = np.uint64(CHUNK)
    acc = 0.0
    for start in range(np.uint64(0), n, chunk):
        acc += np.float64(_chunk_sum(row, square, start, min(start + chunk, n)))
    return _checked(acc, row, square)


@_row_jit(inline="always")
def _chunk_centered_sums(row: np.ndarray, m_hi: float, m_lo: float, start: int, stop: int
                         ) -> tuple[float, float]:
    """``sum(c)`` and ``sum(c^2)`` over elements ``start:stop`` (unsigned) in float32,
    ``c = (x - m_hi) - m_lo``."""
    s1 = np.float32(0.0)
    s2 = np.float32(0.0)
    for j in range(start, stop):
        c = (_load(row, j) - m_hi) - m_lo
        s1 = _add(s1, c)
        s2 = _add_square(s2, c)
    return s1, s2


@_row_jit(fastmath=_REDUCE)
def _exact_centered_sums(row: np.ndarray, m0: float) -> tuple[float, float]:
    """``sum(x - m0)`` and ``sum((x - m0)^2)`` in float64."""
    s1 = 0.0
    s2 = 0.0
    for j in range(row.size):
        v = np.float64(_load(row, j)) - m0
        s1 += v
        s2 += v * v
    return s1, s2


@_row_jit()
def _centered_sums(row: np.ndarray, m0: float) -> tuple[float, float]:
    """``sum(x - m0)`` and ``sum((x - m0)^2)``: float32 chunks of the centered row (``m0``
    split into two float32 parts) added in float64; in float64 where that is not finite or
    ``m0`` is not a float32-safe scalar."""
    if not _fast_or_zero(m0):
        return _exact_centered_sums(row, m0)
    m_hi, m_lo = _split(m0)
    n = np.uint64(row.size)
    chunk = np.uint64(CHUNK)
    s1 = 0.0
    s2 = 0.0
    for start in range(np.uint64(0), n, chunk):
        c1, c2 = _chunk_centered_sums(row, m_hi, m_lo, start, min(start + chunk, n))
        s1 += np.float64(c1)
        s2 += np.float64(c2)
    if np.isfinite(s2) and s2 > _FAST_LOW:
        return s1, s2
    return _exact_centered_sums(row, m0)


@_row_jit()
def _scaled(dy: float, g: float, wide: bool) -> float:
    """``d = dy g`` of float32 ``dy`` and ``g`` in float64: their float32 product (the one the
    float32 loops use), or with ``wide`` the product of the widened factors, which cannot
    overflow."""
    if wide:
        return np.float64(dy) * np.float64(g)
    return np.float64(dy * g)


@_row_jit(fastmath=_REDUCE)
def _exact_dot(row: np.ndarray, dy: np.ndarray, g: np.ndarray) -> float:
    """``sum(dy * g * x)`` in float64, products too (``dy * g`` may overflow float32)."""
    acc = 0.0
    for j in range(row.size):
        acc += _scaled(_load(dy, j), g[j], True) * np.float64(_load(row, j))
    return acc


@_row_jit()
def _corrected(m0: float, s1: float, s2: float, n: int) -> tuple[float, float]:
    """``(mean, s)`` from ``s1 = sum(x - m0)`` and ``s2 = sum((x - m0)^2)``: the mean ``m0``
    corrected by that of ``x - m0``, the variance clamped at 0 (a NaN stays NaN)."""
    s = (s2 - s1 * s1 / n) / n
    if s < 0.0:  # noqa: PLR1730 (a NaN must stay NaN)
        s = 0.0
    return m0 + s1 / n, s


@_row_jit()
def _layer_moments(row: np.ndarray) -> tuple[float, float]:
    """``(mean, s)`` in two passes (`_corrected`)."""
    return _layer_moments_from(row, _row_sum(row, False))


@_row_jit()
def _layer_moments_from(row: np.ndarray, total: float) -> tuple[float, float]:
    """`_layer_moments` given the row's sum ``total`` (its first pass)."""
    m0 = total / row.size
    s1, s2 = _centered_sums(row, m0)
    return _corrected(m0, s1, s2, row.size)


@_row_jit()
def _exact_moments(row: np.ndarray, kind: int, k: int) -> tuple[float, float]:
    """``(mean, s)`` summed in float64 throughout (the mean 0 for the RMS kinds)."""
    if kind != LAYER:
        return 0.0, _exact_sum(row[:k], True) / k
    m0 = _exact_sum(row, False) / row.size
    s1, s2 = _exact_centered_sums(row, m0)
    return _corrected(m0, s1, s2, row.size)


@_row_jit()
def _moments(x: np.ndarray, kind: int, k: int, exact: bool) -> tuple[float, float]:
    """``(mean, s)`` of a row: with ``exact`` summed in float64 throughout (`_exact_moments`),
    else in float32 chunks (LayerNorm in two passes, `_layer_moments`)."""
    if exact:
        # y_hat is rounded once, as the reference rounds it, only from a statistic exact to
        # float64: float32 chunk sums move y_hat across rounding midpoints of the half dtype.
        return _exact_moments(x, kind, k)
    if kind == LAYER:
        return _layer_moments(x)
    return 0.0, _row_sum(x[:k], True) / k


@_row_jit()
def _rstd(s: float, eps: float, outside: bool) -> float:
    if outside:
        return 1.0 / (np.sqrt(s) + eps)
    return 1.0 / np.sqrt(s + eps)


@_row_jit()
def _dr_ds(r: float, s: float, outside: bool) -> float:
    """``r'(s)``: ``-r^3/2`` inside, ``-r^2/(2 sqrt(s))`` outside (0 at s = 0)."""
    if not outside:
        return -0.5 * r * r * r
    if s > 0.0:
        return -0.5 * r * r / np.sqrt(s)
    return 0.0


@_row_jit()
def _fast(v: float) -> bool:
    """Whether a row scalar is safe to apply in float32: finite, far from under/overflow."""
    return _FAST_LOW < abs(v) < _FAST_HIGH


@_row_jit()
def _fast_or_zero(v: float) -> bool:
    """Whether a row scalar is 0 or `_fast`."""
    return v == 0.0 or _fast(v)


@_row_jit()
def _split(mean: float) -> tuple[float, float]:
    """``mean`` as a sum of two float32 values, high part first."""
    hi = np.float32(mean)
    return hi, np.float32(mean - np.float64(hi))


# ---- scheduling -----------------------------------------------------------------------------


@intrinsic
def _claim(typingctx: Any, counter: Any) -> Any:
    """Atomically add 1 to ``counter[0]`` (an int64 array) and return its value before."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array = context.make_array(signature.args[0])(context, builder, args[0])
        one = ir.Constant(ir.IntType(64), 1)
        return builder.atomic_rmw("add", array.data, one, "monotonic")

    return types.int64(counter), codegen


# ---- forward ---------------------------------------------------------------------------------


@_row_jit()
def _scale_span(x: np.ndarray, y: np.ndarray, g: np.ndarray, b: np.ndarray, r: float,
                m_hi: float, m_lo: float, centered: bool, biased: bool) -> None:
    """``y = ((x - m_hi) - m_lo) r g + b`` in float32 (``y = x r g + b`` unless ``centered``,
    the same values for a zero mean, two operations fewer; without ``biased`` the loop does
    not read ``b``, which is then -0.0 throughout, the one value whose addition changes no
    float). No operand is a NaN (`_forward_row`): the values are stored by `_store_number`."""
    if centered and biased:
        for j in range(x.size):
            _store_number(y, j, ((_load(x, j) - m_hi) - m_lo) * r * g[j] + b[j])
    elif centered:
        for j in range(x.size):
            _store_number(y, j, ((_load(x, j) - m_hi) - m_lo) * r * g[j])
    elif biased:
        for j in range(x.size):
            _store_number(y, j, _load(x, j) * r * g[j] + b[j])
    else:
        for j in range(x.size):
            _store_number(y, j, _load(x, j) * r * g[j])


@_row_jit()
def _biased(b: np.ndarray) -> bool:
    """Whether the bias ``b`` has an element other than -0.0 (adding -0.0 changes no float,
    +0.0 turns -0.0 into +0.0). A count over every element rather than a search that stops
    at the first: the count vectorizes, the search ran one element at a time (a row of 4096
    read by the scans of ``g`` and ``b`` cost 3 us, most of a one-token call's kernel time)."""
    others = 0
    for j in range(b.size):
        others += np.int64(_bits_of_float(b[j]) != np.uint32(0x80000000))
    return others != 0


@_row_jit()
def _nan_free(values: np.ndarray) -> bool:
    """Whether no element of ``values`` is a NaN (a count, as in `_biased`)."""
    nans = 0
    for j in range(values.size):
        nans += np.int64(np.isnan(values[j]))
    return nans == 0


@_row_jit()
def _forward_row(x: np.ndarray, y: np.ndarray, g: np.ndarray, b: np.ndarray, kind: int,
                 k: int, eps: float, outside: bool, before_scale: bool, biased: bool,
                 clean: bool) -> float:
    """``y = (x - mean) * r * g + b`` for one row; returns ``r``. The statistic is read first
    (a loop that only reads, so its machine code, and the order of its sums, cannot depend on
    where the arrays lie), then ``y`` is written from the row, now in the cache.
    With ``before_scale`` the normalized value is rounded to ``y``'s dtype before the
    affine step; without ``biased`` (`_biased`) the common case does not read ``b``. The
    common case needs ``clean`` parameters (no NaN in ``g`` or ``b``, `_nan_free`); a row it
    takes has no NaN either (its statistic would be one)."""
    n = x.size
    mean, s = _moments(x, kind, k, before_scale)
    r = _rstd(s, eps, outside)
    fast = _fast(r) and _fast_or_zero(mean)
    if fast and clean and not before_scale:
        m_hi, m_lo = _split(mean)
        _scale_span(x, y, g, b, np.float32(r), m_hi, m_lo, kind == LAYER, biased)
    elif fast and before_scale:
        # y_hat in float64, rounded once: its rounding is that of the reference.
        for j in range(n):
            v = _round_like(y, (np.float64(_load(x, j)) - mean) * r)
            _store(y, j, v * g[j] + b[j])
    else:
        for j in range(n):
            v = (np.float64(_load(x, j)) - mean) * r
            if before_scale:
                v = np.float64(_round_like(y, v))
            _store(y, j, np.float32(v * g[j] + b[j]))
    return r


@_row_jit()
def _blocks(rows: int, block: int) -> int:
    """How many blocks of ``block`` rows cover ``rows`` rows (the last may be short)."""
    return (rows + block - 1) // block


@njit(cache=True)
def _counter() -> np.ndarray:
    """A block counter for `_claim`, at 0. Not ``np.zeros``: a parallel function turns that
    fill into a parallel region of its own, the very cost a single worker avoids."""
    counter = np.empty(1, np.int64)
    counter[0] = 0
    return counter


@njit(cache=True)
def _scratch(x: np.ndarray, count: int, workers: int, block: int) -> np.ndarray:
    """``count`` float32 rows of ``x``'s width for each task of a launch over ``x``'s rows:
    (tasks, count, n), at least one task. The tasks count no references (`_row_jit`), so
    their scratch is made here, by the entry point."""
    rows, n = x.shape
    tasks = 1 if workers == 1 else max(1, min(workers, _blocks(rows, block)))
    return np.empty((tasks, count, n), np.float32)


@_row_jit()
def _forward_task(x: np.ndarray, g: np.ndarray, b: np.ndarray, y: np.ndarray, r: np.ndarray,
                  kind: int, k: int, eps: float, outside: bool, before_scale: bool,
                  biased: bool, clean: bool, block: int, claimed: np.ndarray) -> None:
    """One task of `forward`: claims blocks of ``block`` rows (``claimed``) until none is
    left."""
    rows = x.shape[0]
    blocks = _blocks(rows, block)
    blk = _claim(claimed)
    while blk < blocks:
        for i in range(blk * block, min(rows, blk * block + block)):
            r[i] = _forward_row(x[i], y[i], g, b, kind, k, eps, outside, before_scale, biased,
                                clean)
        blk = _claim(claimed)


@njit(parallel=True, cache=True)
def forward(x: np.ndarray, g: np.ndarray, b: np.ndarray, y: np.ndarray, r: np.ndarray,
            kind: int, k: int, eps: float, outside: bool, before_scale: bool, block: int,
            workers: int) -> None:
    """``y = normalize(x)`` for rows ``x`` into ``y`` (same dtype) and ``r(s)`` of each row
    into ``r`` (float32); ``g`` the effective scale, ``b`` the bias (float32). Each of
    ``workers`` tasks claims blocks of ``block`` rows until none is left, so a thread slowed
    by another process on its core takes fewer blocks instead of holding up the call; a row's
    values depend on that row alone. One worker runs the one task on the calling thread, with
    no parallel region (`SERIAL`)."""
    biased = _biased(b)
    clean = _nan_free(g) and _nan_free(b)
    claimed = _counter()
    if workers == 1:
        _forward_task(x, g, b, y, r, kind, k, eps, outside, before_scale, biased, clean, block,
                      claimed)
        return
    for _ in prange(min(workers, _blocks(x.shape[0], block))):
        _forward_task(x, g, b, y, r, kind, k, eps, outside, before_scale, biased, clean, block,
                      claimed)


# ---- backward --------------------------------------------------------------------------------


@_row_jit()
def _first_of_one(x0: float, d0: float, tail: float, r: float, eps: float, outside: bool
                  ) -> float:
    """``dx_0`` when the statistic reads one element: ``r^3 (eps d_0 - x_0 S_1)`` inside,
    ``r^2 (eps d_0 - sign(x_0) S_1)`` outside, ``S_1 = sum_{i >= 1} d_i x_i``."""
    if outside:
        sign = 1.0 if x0 > 0.0 else (-1.0 if x0 < 0.0 else 0.0)
        return r * r * (eps * d0 - sign * tail)
    return r * r * r * (eps * d0 - x0 * tail)


@_row_jit(inline="always")
def _chunk_dot(x: np.ndarray, dy: np.ndarray, g: np.ndarray, start: int, stop: int) -> float:
    """``sum(dy g x)`` over elements ``start:stop`` (unsigned) in float32."""
    acc = np.float32(0.0)
    for j in range(start, stop):
        acc = _add(acc, _load(dy, j) * g[j] * _load(x, j))
    return acc


@_row_jit()
def _dot(x: np.ndarray, dy: np.ndarray, g: np.ndarray, start: int, stop: int
         ) -> tuple[float, bool]:
    """``sum(dy g x)`` over elements ``start:stop``, and whether float32 products overflowed:
    float32 chunks added in float64, taken again in float64 (`_exact_dot`) where that is not
    finite (then the products, ``dy g`` perhaps, overflowed, or a value is NaN or infinite)
    or below `_FAST_LOW` (products under float32's normal range)."""
    chunk = np.uint64(CHUNK)
    hi = np.uint64(stop)
    acc = 0.0
    for lo in range(np.uint64(start), hi, chunk):
        acc += np.float64(_chunk_dot(x, dy, g, lo, min(lo + chunk, hi)))
    if np.isfinite(acc) and abs(acc) > _FAST_LOW:
        return acc, False
    return _exact_dot(x[start:stop], dy[start:stop], g[start:stop]), not np.isfinite(acc)


@_row_jit()
def _layer_backward_sums(x: np.ndarray, dy: np.ndarray, g: np.ndarray, wide: bool
                         ) -> tuple[float, float, float]:
    """``sum(c)``, ``sum(d)`` and ``sum(d c)`` in float64, ``c = x - x_0`` (the row shifted by
    its first element, so that a large mean does not cancel), ``d = dy g`` (`_scaled`: with
    ``wide`` a float64 product)."""
    m0 = np.float64(_load(x, 0))
    sc = 0.0
    sd = 0.0
    sdc = 0.0
    for j in range(x.size):
        d = _scaled(_load(dy, j), g[j], wide)
        c = np.float64(_load(x, j)) - m0
        sc = _add(sc, c)
        sd = _add(sd, d)
        sdc = _add(sdc, d * c)
    return sc, sd, sdc


@_row_jit()
def _gradient_span(x: np.ndarray, dy: np.ndarray, dx: np.ndarray, g: np.ndarray,
                   dg: np.ndarray, db: np.ndarray, r: float, q: float, mean_d: float,
                   m_hi: float, m_lo: float, rms_only: bool) -> None:
    """``dx = r (dy g - mean_d) + c q`` in float32, ``c = (x - m_hi) - m_lo``, with
    ``dg += dy c r`` and ``db += dy``; with ``rms_only`` (an RMS row without a bias: ``c = x``,
    ``mean_d = 0``) the loop without ``db``. No operand is a NaN: a NaN in the row, its ``dy``
    or ``g`` makes the row's sums NaN, and `_backward_row` then takes its float64 loop; ``dx``
    is stored by `_store_number`."""
    if rms_only:
        for j in range(x.size):
            xj = _load(x, j)
            dyj = _load(dy, j)
            dg[j] += dyj * (xj * r)
            _store_number(dx, j, r * (dyj * g[j]) + xj * q)
    else:
        for j in range(x.size):
            c = (_load(x, j) - m_hi) - m_lo
            dyj = _load(dy, j)
            dg[j] += dyj * (c * r)
            db[j] += dyj
            _store_number(dx, j, r * (dyj * g[j] - mean_d) + c * q)


@_row_jit()
def _backward_row(x: np.ndarray, saved_r: float, dy: np.ndarray, dx: np.ndarray, g: np.ndarray,
                  dg: np.ndarray, db: np.ndarray, kind: int, k: int, eps: float,
                  outside: bool, need_b: bool) -> tuple[float, float]:
    """``dx`` of one row; adds ``dy * y_hat`` to ``dg`` and ``dy`` to ``db``; returns the row's
    ``(mean, r)`` (float64, the mean 0 for the RMS kinds). The row's sums
    are read first (loops that only read), then ``dx`` is written from the cached row.

    The forward's float32 ``r`` serves where it determines ``r'(s)`` (eps inside, r in
    float32's comfortable range); elsewhere the statistic is recomputed. ``dx`` is written in
    float32 where every scalar it applies (``r``, ``q``, ``mean(d)``, the mean) is 0 or `_fast`
    and no product ``dy g`` overflowed float32; elsewhere in float64. (``q ~ dx / x`` leaves
    float32 on rows of large values: about 1e-50 on a row of 1e25, where ``r`` is 1e-25.)

    ``dx_j = r (d_j - mean(d)) + [j < k] c_j (2/k) r'(s) sum_i d_i c_i`` with ``d = dy * g``
    and ``c`` the centered row (``mean(d)`` only for layer); for k = 1 element 0 takes the
    cancellation-free closed form of `_first_of_one`.
    """
    n = x.size
    reuse_r = not outside and _fast(saved_r)
    tail = 0.0  # sum_{i >= 1} d_i x_i, for element 0's closed form (k = 1) only
    if kind == LAYER:
        sc, sd, sdc = _layer_backward_sums(x, dy, g, False)
        wide = not (np.isfinite(sd) and np.isfinite(sdc))  # float32 products overflowed
        if wide:
            sc, sd, sdc = _layer_backward_sums(x, dy, g, True)
        mean = np.float64(_load(x, 0)) + sc / n
        dot = sdc - (sc / n) * sd
        mean_d = sd / n
        s = 0.0 if reuse_r else _layer_moments(x)[1]
    else:
        # sum_i d_i x_i over the whole row in one pass from its start, as the memory streams
        # it (the tail first, then the head, took partial RMS 3-8 % longer than RMS); apart
        # only where element 0's closed form needs the tail.
        if k == 1:
            tail, wide_tail = _dot(x, dy, g, 1, n)
            head, wide = _dot(x, dy, g, 0, 1)
            dot = head + tail
            wide = wide or wide_tail
        else:
            dot, wide = _dot(x, dy, g, 0, n)
        mean = 0.0
        s = 0.0 if reuse_r else _row_sum(x[:k], True) / k
        mean_d = 0.0
    r = np.float64(saved_r) if reuse_r else _rstd(s, eps, outside)
    q = (2.0 / k) * _dr_ds(r, s, outside) * dot
    if (not wide and _fast(r) and _fast_or_zero(q) and _fast_or_zero(mean_d)
            and _fast_or_zero(mean)):
        m_hi, m_lo = _split(mean)
        rms_only = kind != LAYER and not need_b
        _gradient_span(x[:k], dy[:k], dx[:k], g[:k], dg[:k], db[:k], np.float32(r),
                       np.float32(q), np.float32(mean_d), m_hi, m_lo, rms_only)
        _gradient_span(x[k:], dy[k:], dx[k:], g[k:], dg[k:], db[k:], np.float32(r),
                       np.float32(0.0), np.float32(mean_d), m_hi, m_lo, rms_only)
    else:
        for j in range(n):
            c = np.float64(_load(x, j)) - mean
            dyj = np.float64(_load(dy, j))
            dg[j] += dyj * c * r
            db[j] += dyj
            v = r * (dyj * g[j] - mean_d)
            _store(dx, j, np.float32(v + c * q if j < k else v))
    if kind != LAYER and k == 1:
        d0 = np.float64(_load(dy, 0)) * g[0]
        dx0 = _first_of_one(np.float64(_load(x, 0)), d0, tail, r, eps, outside)
        _store(dx, 0, np.float32(dx0))
    return mean, r


@njit(cache=True)
def _add_rows(partial: np.ndarray, total: np.ndarray) -> None:
    """``total`` = the rows of ``partial`` added up in float64, rounded to float32."""
    acc = np.zeros(total.size)
    for row in partial:
        for j in range(total.size):
            acc[j] += row[j]
    for j in range(total.size):
        total[j] = np.float32(acc[j])


@_row_jit()
def _block_sums(dg: np.ndarray, db: np.ndarray, scratch: np.ndarray, blk: int, need_g: bool,
                need_b: bool) -> tuple[np.ndarray, np.ndarray]:
    """Row block ``blk``'s sums of the scale's and the bias's gradients, zeroed: ``dg[blk]`` and
    ``db[blk]``, or a ``scratch`` row for a sum nobody asked for."""
    dg_rows = dg[blk] if need_g else scratch[0]
    db_rows = db[blk] if need_b else scratch[1]
    dg_rows[:] = 0.0
    db_rows[:] = 0.0
    return dg_rows, db_rows


@_row_jit()
def _backward_task(x: np.ndarray, r: np.ndarray, dy: np.ndarray, dx: np.ndarray, g: np.ndarray,
                   dg: np.ndarray, db: np.ndarray, kind: int, k: int, eps: float, outside: bool,
                   need_g: bool, need_b: bool, block: int, claim: int, claimed: np.ndarray,
                   scratch: np.ndarray) -> None:
    """One task of `backward`: claims ``claim`` blocks of rows at a time until none is left,
    each block's rows' ``dx`` and their sums into ``dg[blk]`` and ``db[blk]`` (into the task's
    ``scratch`` rows where not needed)."""
    rows = x.shape[0]
    blocks = _blocks(rows, block)
    first = _claim(claimed) * claim
    while first < blocks:
        for blk in range(first, min(blocks, first + claim)):
            dg_rows, db_rows = _block_sums(dg, db, scratch, blk, need_g, need_b)
            for i in range(blk * block, min(rows, blk * block + block)):
                _backward_row(x[i], r[i], dy[i], dx[i], g, dg_rows, db_rows, kind, k, eps,
                              outside, need_b)
        first = _claim(claimed) * claim


@njit(parallel=True, cache=True)
def backward(x: np.ndarray, r: np.ndarray, dy: np.ndarray, g: np.ndarray, dx: np.ndarray,
             dg: np.ndarray, db: np.ndarray, dg_total: np.ndarray, db_total: np.ndarray,
             kind: int, k: int, eps: float, outside: bool, need_g: bool, need_b: bool,
             block: int, claim: int, workers: int) -> None:
    """``dx`` of rows ``x`` (with the forward's ``r``) for the cotangent ``dy`` (all of one
    dtype). With ``need_g`` row block ``i`` sums its rows' ``dy * y_hat`` into ``dg[i]`` (float32)
    and ``dg_total`` receives the blocks' sums added in float64; with ``need_b`` the same for
    ``dy`` in ``db`` and ``db_total``. A sum nobody asked for goes to a scratch row of the block
    (one loop serves every case). The ``workers`` tasks claim ``claim`` blocks at a time, as
    `forward`'s claim rows; a block's sums do not depend on which thread took it. Everything
    happens in this one launch: no torch op between the kernels, whose threads would wait on
    numba's."""
    claimed = _counter()
    scratch = _scratch(x, 2, workers, block * claim)
    if workers == 1:  # the one task on the calling thread, no parallel region (`SERIAL`)
        _backward_task(x, r, dy, dx, g, dg, db, kind, k, eps, outside, need_g, need_b, block,
                       claim, claimed, scratch[0])
    else:
        for task in prange(scratch.shape[0]):
            _backward_task(x, r, dy, dx, g, dg, db, kind, k, eps, outside, need_g, need_b,
                           block, claim, claimed, scratch[task])
    if need_g:
        _add_rows(dg, dg_total)
    if need_b:
        _add_rows(db, db_total)


# ---- gated and grouped rows ------------------------------------------------------------------
# A group is a sub-row with its own statistic (``r[i, group]``) and its slice of g and b; the
# ungated row functions above serve each group. The gate's activation ``a(z)`` (and ``a'(z)``
# in the backward) is taken once per row into a float32 row buffer of the task, as is the
# norm's input ``v = x a(z)`` for ``gate="before"`` (float32, the rounding point of the
# reference's policy); a loop of the row then reads them from the cache.


@_row_jit()
def _activate(z: np.ndarray, a: np.ndarray, slope: np.ndarray, sigmoid: bool, with_slope: bool
              ) -> None:
    """``a = act(z)`` and, ``with_slope``, ``slope = act'(z)`` in float32, from ``e = e^-|z|``
    (no overflow, no cancellation)::

        sigmoid(z) = 1 / (1 + e) for z >= 0, else e / (1 + e); sigmoid(-z) the other one
        silu(z) = z sigmoid(z)         silu'(z) = sigmoid(z) (1 + z sigmoid(-z))
                                       sigmoid'(z) = sigmoid(z) sigmoid(-z)
    """
    one = np.float32(1.0)
    for j in range(a.size):
        zj = _load(z, j)
        e = np.exp(-abs(zj))
        near = one / (one + e)
        far = e / (one + e)
        sig, sig_neg = (near, far) if zj >= 0.0 else (far, near)
        if sigmoid:
            a[j] = sig
            if with_slope:
                slope[j] = sig * sig_neg
        else:
            a[j] = zj * sig
            if with_slope:
                slope[j] = sig * (one + zj * sig_neg)


@_row_jit()
def _times(x: np.ndarray, a: np.ndarray, out: np.ndarray) -> None:
    """``out = x a`` in float32."""
    for j in range(x.size):
        out[j] = _load(x, j) * a[j]


@_row_jit()
def _gated_scale_span(x: np.ndarray, y: np.ndarray, a: np.ndarray, g: np.ndarray,
                      b: np.ndarray, r: float, m_hi: float, m_lo: float) -> None:
    """``y = (((x - m_hi) - m_lo) r g + b) a`` in float32."""
    for j in range(x.size):
        _store(y, j, (((_load(x, j) - m_hi) - m_lo) * r * g[j] + b[j]) * a[j])


@_row_jit()
def _gate_after_row(x: np.ndarray, y: np.ndarray, a: np.ndarray, g: np.ndarray, b: np.ndarray,
                    kind: int, k: int, eps: float, outside: bool, before_scale: bool,
                    round_affine: bool) -> float:
    """``y = (y_hat g + b) a`` for one row (or group), ``y_hat = (x - mean) r``; returns ``r``.
    With ``before_scale`` ``y_hat`` is rounded to ``y``'s dtype, with ``round_affine`` also
    ``u = y_hat g + b``, each once from float64, as in the reference."""
    mean, s = _moments(x, kind, k, before_scale)
    r = _rstd(s, eps, outside)
    if _fast(r) and _fast_or_zero(mean) and not before_scale:
        m_hi, m_lo = _split(mean)
        _gated_scale_span(x, y, a, g, b, np.float32(r), m_hi, m_lo)
    else:
        for j in range(x.size):
            v = (np.float64(_load(x, j)) - mean) * r
            if before_scale:
                v = np.float64(_round_like(y, v))
            u = v * g[j] + b[j]
            if round_affine:
                u = np.float64(_round_like(y, u))
            _store(y, j, _round_like(y, u * a[j]))
    return r


@_row_jit()
def _gated_forward_row(x: np.ndarray, z: np.ndarray, y: np.ndarray, g: np.ndarray,
                       b: np.ndarray, r: np.ndarray, a: np.ndarray, v: np.ndarray, kind: int,
                       k: int, group: int, eps: float, outside: bool, before_scale: bool,
                       gate: int, sigmoid: bool, round_affine: bool, biased: bool,
                       clean: bool) -> None:
    """One row: ``y`` per group of ``group`` elements, each group's ``r`` into ``r``;
    ``gate="before"`` normalizes ``v = x a(z)``, ``"after"`` multiplies ``u`` by ``a(z)``."""
    if gate != NO_GATE:
        _activate(z, a, a, sigmoid, False)
    if gate == GATE_BEFORE:
        _times(x, a, v)
    for i in range(r.size):
        lo = i * group
        hi = lo + group
        if gate == GATE_BEFORE:
            r[i] = _forward_row(v[lo:hi], y[lo:hi], g[lo:hi], b[lo:hi], kind, k, eps, outside,
                                before_scale, biased, clean)
        elif gate == GATE_AFTER:
            r[i] = _gate_after_row(x[lo:hi], y[lo:hi], a[lo:hi], g[lo:hi], b[lo:hi], kind, k,
                                   eps, outside, before_scale, round_affine)
        else:
            r[i] = _forward_row(x[lo:hi], y[lo:hi], g[lo:hi], b[lo:hi], kind, k, eps, outside,
                                before_scale, biased, clean)


@_row_jit()
def _gated_forward_task(x: np.ndarray, z: np.ndarray, g: np.ndarray, b: np.ndarray,
                        y: np.ndarray, r: np.ndarray, kind: int, k: int, group: int, eps: float,
                        outside: bool, before_scale: bool, gate: int, sigmoid: bool,
                        round_affine: bool, biased: bool, clean: bool, block: int,
                        claimed: np.ndarray, buffers: np.ndarray) -> None:
    """One task of `gated_forward`, as `_forward_task`, with its two row ``buffers``."""
    rows = x.shape[0]
    blocks = _blocks(rows, block)
    blk = _claim(claimed)
    while blk < blocks:
        for i in range(blk * block, min(rows, blk * block + block)):
            _gated_forward_row(x[i], z[i], y[i], g, b, r[i], buffers[0], buffers[1], kind, k,
                               group, eps, outside, before_scale, gate, sigmoid, round_affine,
                               biased, clean)
        blk = _claim(claimed)


@njit(parallel=True, cache=True)
def gated_forward(x: np.ndarray, z: np.ndarray, g: np.ndarray, b: np.ndarray, y: np.ndarray,
                  r: np.ndarray, kind: int, k: int, group: int, eps: float, outside: bool,
                  before_scale: bool, gate: int, sigmoid: bool, round_affine: bool, block: int,
                  workers: int) -> None:
    """`forward` for a gated or grouped spec: ``r`` is (rows, groups); ``z`` the gate rows
    (``x``'s shape; (rows, 0) and unread for `NO_GATE`), ``gate`` its position, ``sigmoid``
    the activation (else SiLU), ``round_affine`` as in `_gate_after_row`. Blocks are claimed
    as in `forward`; a row's values depend on that row alone."""
    biased = _biased(b)
    clean = _nan_free(g) and _nan_free(b)
    claimed = _counter()
    buffers = _scratch(z, 2, workers, block)
    if workers == 1:  # the one task on the calling thread, no parallel region (`SERIAL`)
        _gated_forward_task(x, z, g, b, y, r, kind, k, group, eps, outside, before_scale, gate,
                            sigmoid, round_affine, biased, clean, block, claimed, buffers[0])
        return
    for task in prange(buffers.shape[0]):
        _gated_forward_task(x, z, g, b, y, r, kind, k, group, eps, outside, before_scale, gate,
                            sigmoid, round_affine, biased, clean, block, claimed, buffers[task])


@_row_jit()
def _gate_after_gradient_span(x: np.ndarray, dy: np.ndarray, dz: np.ndarray,
                              slope: np.ndarray, g: np.ndarray, b: np.ndarray, r: float,
                              m_hi: float, m_lo: float) -> None:
    """``dz = dy (((x - m_hi) - m_lo) r g + b) slope`` in float32."""
    for j in range(x.size):
        u = ((_load(x, j) - m_hi) - m_lo) * r * g[j] + b[j]
        _store(dz, j, _load(dy, j) * u * slope[j])


@_row_jit()
def _gate_after_gradient(x: np.ndarray, dy: np.ndarray, dz: np.ndarray, slope: np.ndarray,
                         g: np.ndarray, b: np.ndarray, r: float, mean: float) -> None:
    """``dz = dy u a'(z)``, ``u = (x - mean) r g + b`` (unrounded): in float32 with the mean
    split, in float64 where the row's scalars are not float32-safe (`_fast`)."""
    if _fast(r) and _fast_or_zero(mean):
        m_hi, m_lo = _split(mean)
        _gate_after_gradient_span(x, dy, dz, slope, g, b, np.float32(r), m_hi, m_lo)
    else:
        for j in range(x.size):
            u = (np.float64(_load(x, j)) - mean) * r * g[j] + b[j]
            _store(dz, j, _round_like(dz, np.float64(_load(dy, j)) * u * slope[j]))


@_row_jit()
def _gate_before_gradient(x: np.ndarray, e: np.ndarray, a: np.ndarray, slope: np.ndarray,
                          dx: np.ndarray, dz: np.ndarray) -> None:
    """``dx = e a`` and ``dz = e x slope`` in float32."""
    for j in range(x.size):
        _store(dx, j, e[j] * a[j])
        _store(dz, j, e[j] * _load(x, j) * slope[j])


@_row_jit()
def _gated_backward_row(x: np.ndarray, z: np.ndarray, r: np.ndarray, dy: np.ndarray,
                        dx: np.ndarray, dz: np.ndarray, g: np.ndarray, b: np.ndarray,
                        dg: np.ndarray, db: np.ndarray, a: np.ndarray, slope: np.ndarray,
                        v: np.ndarray, e: np.ndarray, kind: int, k: int, group: int,
                        eps: float, outside: bool, gate: int, sigmoid: bool, need_b: bool
                        ) -> None:
    """``dx`` and ``dz`` of one row, adding to ``dg`` and ``db``; with ``J`` the norm's VJP per
    group (`_backward_row`)::

        gate="before":  e = J(v)^T dy, v = x a(z)     dx = e a(z)   dz = e x a'(z)
        gate="after":   dx = J(x)^T (dy a(z))         dz = dy (y_hat g + b) a'(z)

    and ``dg``, ``db`` those of the norm at its input for its cotangent."""
    if gate != NO_GATE:
        _activate(z, a, slope, sigmoid, True)
    if gate == GATE_BEFORE:
        _times(x, a, v)
    elif gate == GATE_AFTER:
        _times(dy, a, v)
    for i in range(r.size):
        lo = i * group
        hi = lo + group
        if gate == GATE_BEFORE:
            _backward_row(v[lo:hi], r[i], dy[lo:hi], e[lo:hi], g[lo:hi], dg[lo:hi], db[lo:hi],
                          kind, k, eps, outside, need_b)
        elif gate == GATE_AFTER:
            mean, r_used = _backward_row(x[lo:hi], r[i], v[lo:hi], dx[lo:hi], g[lo:hi],
                                         dg[lo:hi], db[lo:hi], kind, k, eps, outside, need_b)
            _gate_after_gradient(x[lo:hi], dy[lo:hi], dz[lo:hi], slope[lo:hi], g[lo:hi],
                                 b[lo:hi], r_used, mean)
        else:
            _backward_row(x[lo:hi], r[i], dy[lo:hi], dx[lo:hi], g[lo:hi], dg[lo:hi], db[lo:hi],
                          kind, k, eps, outside, need_b)
    if gate == GATE_BEFORE:
        _gate_before_gradient(x, e, a, slope, dx, dz)


@_row_jit()
def _gated_backward_task(x: np.ndarray, z: np.ndarray, r: np.ndarray, dy: np.ndarray,
                         dx: np.ndarray, dz: np.ndarray, g: np.ndarray, b: np.ndarray,
                         dg: np.ndarray, db: np.ndarray, kind: int, k: int, group: int,
                         eps: float, outside: bool, gate: int, sigmoid: bool, need_g: bool,
                         need_b: bool, block: int, claimed: np.ndarray, scratch: np.ndarray,
                         buffers: np.ndarray) -> None:
    """One task of `gated_backward`, as `_backward_task`, with its four row ``buffers``."""
    rows = x.shape[0]
    blocks = _blocks(rows, block)
    blk = _claim(claimed)
    while blk < blocks:
        dg_rows, db_rows = _block_sums(dg, db, scratch, blk, need_g, need_b)
        for i in range(blk * block, min(rows, blk * block + block)):
            _gated_backward_row(x[i], z[i], r[i], dy[i], dx[i], dz[i], g, b, dg_rows, db_rows,
                                buffers[0], buffers[1], buffers[2], buffers[3], kind, k, group,
                                eps, outside, gate, sigmoid, need_b)
        blk = _claim(claimed)


@njit(parallel=True, cache=True)
def gated_backward(x: np.ndarray, z: np.ndarray, r: np.ndarray, dy: np.ndarray, g: np.ndarray,
                   b: np.ndarray, dx: np.ndarray, dz: np.ndarray, dg: np.ndarray,
                   db: np.ndarray, dg_total: np.ndarray, db_total: np.ndarray, kind: int,
                   k: int, group: int, eps: float, outside: bool, gate: int, sigmoid: bool,
                   need_g: bool, need_b: bool, block: int, workers: int) -> None:
    """`backward` for a gated or grouped spec (`gated_forward`'s arguments, and its ``r``):
    also ``dz``, the gate's gradient ((rows, 0) and unwritten for `NO_GATE`); ``b`` the bias,
    which ``dz`` reads after the norm. The parameters' gradients are summed per block of rows
    as in `backward`."""
    claimed = _counter()
    scratch = _scratch(x, 2, workers, block)
    buffers = _scratch(z, 4, workers, block)
    if workers == 1:  # the one task on the calling thread, no parallel region (`SERIAL`)
        _gated_backward_task(x, z, r, dy, dx, dz, g, b, dg, db, kind, k, group, eps, outside,
                             gate, sigmoid, need_g, need_b, block, claimed, scratch[0],
                             buffers[0])
    else:
        for task in prange(scratch.shape[0]):
            _gated_backward_task(x, z, r, dy, dx, dz, g, b, dg, db, kind, k, group, eps,
                                 outside, gate, sigmoid, need_g, need_b, block, claimed,
                                 scratch[task], buffers[task])
    if need_g:
        _add_rows(dg, dg_total)
    if need_b:
        _add_rows(db, db_total)
