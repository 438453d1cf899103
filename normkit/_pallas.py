"""Pallas kernels (experimental) for normkit.jax and normkit.tf on Keras' JAX backend: every
`NormSpec` computed in one read of each input and one write of each output, forward and
backward, on NVIDIA GPUs through Pallas' Triton lowering, and anywhere in Pallas' interpreter
(tests). It imports JAX alone (not Flax), so that both adapters can call it; its public face
is `normkit.jax.pallas`.

`run` computes a spec with its analytic VJP (`jax.custom_vjp`); `normkit.jax.functional` and
`normkit.tf.layers` call it on GPUs when the kernels are selected (`selected`; docs/jax.md),
and on any platform inside `interpreted`.

Layout: the normalized axes must be the trailing ones (a reshape to rows, no copy), the row (or
the group, with ``group_size``) at most `MAX_BLOCK` elements, padded to a power of two in
registers. The forward runs one program per tile of rows (`LAUNCH`);
the backward runs `programs` programs, each taking every ``programs``-th tile and summing its
rows' terms of the parameters' gradients in registers, then writes them once; those partial
sums are added by XLA in a fixed order (deterministic). The row arithmetic is
`normkit._pallas_rows`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from normkit import _pallas_rows as rows_math
from normkit._pallas_rows import F32, RowMath
from normkit.spec import NormSpec

__all__ = ["KERNELS_VARIABLE", "MAX_BLOCK", "interpreted", "interpreting", "run", "selected",
           "supports"]

#: The most elements of a row (of a group, with ``group_size``, padded to a power of two) the
#: kernels hold in registers; longer rows take the XLA program.
MAX_BLOCK = 32768
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_KERNEL_DTYPES = (*_HALF, jnp.dtype(jnp.float32))
#: The launch configuration, a first guess until a GPU run measures it (scripts/jax_probe.py
#: times others by setting these): elements per tile (rows of fewer are taken several at a
#: time); elements per warp, forward (Triton's 1024 of normkit.torch's kernels) and backward
#: (which holds about twice as many values per element); the backward's programs at most (two
#: per multiprocessor of an H200) and tiles per program at least, so that the partial sums
#: stay small; the longest row (padded) the backward holds whole with its parameters' sums, and
#: the slices it takes longer ones in (`_slices`).
LAUNCH = {"tile": 2048, "forward_per_warp": 1024, "backward_per_warp": 512,
          "programs": 264, "tiles_per_program": 2, "fused": 8192, "slice": 4096}


#: The environment variable that selects the kernels (``"pallas"``) or the XLA program
#: (``"xla"``) where a call does not say.
KERNELS_VARIABLE = "NORMKIT_JAX_KERNELS"
_CHOICES = ("xla", "pallas")


def selected(implementation: str | None) -> bool:
    """Whether a call asks for the kernels: ``implementation`` (``"xla"`` or ``"pallas"``), else
    `KERNELS_VARIABLE`, else not; ValueError for another value, naming where it came from."""
    chosen = implementation
    where = "implementation"
    if chosen is None:
        chosen = os.environ.get(KERNELS_VARIABLE) or "xla"
        where = f"the environment variable {KERNELS_VARIABLE}"
    if chosen not in _CHOICES:
        raise ValueError(f"{where}={chosen!r}: expected one of {_CHOICES}")
    return chosen == "pallas"


_INTERPRETED = [False]


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Within it, calls traced with ``implementation="pallas"`` run the kernels in Pallas'
    interpreter on every platform (slowly: for tests and debugging without a GPU). A jitted
    function traced before keeps its program."""
    _INTERPRETED.append(True)
    try:
        yield
    finally:
        _INTERPRETED.pop()


def interpreting() -> bool:
    """Whether calls are traced inside `interpreted`."""
    return _INTERPRETED[-1]


@dataclass(frozen=True)
class _Layout:
    """Rows of ``size`` elements, ``groups`` per row (a group is a row of the statistic), as
    tiles of ``block_rows`` rows padded to powers of two."""

    rows: int
    groups: int
    size: int
    block_rows: int

    @property
    def grouped(self) -> bool:
        return self.groups > 1

    @property
    def inner(self) -> tuple[int, ...]:
        """A row's shape in the kernels' arrays: ``(n,)``, or ``(groups, group_size)``."""
        return (self.groups, self.size) if self.grouped else (self.size,)

    @property
    def block_inner(self) -> tuple[int, ...]:
        return tuple(pl.next_power_of_2(d) for d in self.inner)

    @property
    def tile(self) -> tuple[int, ...]:
        return (self.block_rows, *self.block_inner)

    @property
    def tiles(self) -> int:
        return pl.cdiv(self.rows, self.block_rows)

    def warps(self, backward: bool) -> int:
        per_warp = LAUNCH["backward_per_warp" if backward else "forward_per_warp"]
        return max(2, min(32, pl.next_power_of_2(max(math.prod(self.tile) // per_warp, 1))))

    @property
    def programs(self) -> int:
        """The backward's programs: ``LAUNCH["programs"]`` at most, each taking at least
        ``LAUNCH["tiles_per_program"]`` tiles."""
        return max(1, min(LAUNCH["programs"], self.tiles // LAUNCH["tiles_per_program"]))


def _layout(rows: int, n: int, groups: int) -> _Layout:
    size = n // groups
    width = pl.next_power_of_2(groups) * pl.next_power_of_2(size) if groups > 1 else (
        pl.next_power_of_2(size))
    block_rows = max(1, min(pl.next_power_of_2(rows), LAUNCH["tile"] // width))
    return _Layout(rows, groups, size, block_rows)


@dataclass(frozen=True)
class _Kernel:
    """Everything static about one call: the row arithmetic, the layout, the dtypes of the
    arrays the kernels read and write, and whether Pallas interprets them."""

    math: RowMath
    layout: _Layout
    x_dtype: jnp.dtype
    out_dtype: jnp.dtype
    residual_dtype: jnp.dtype | None
    h_dtype: jnp.dtype | None
    interpret: bool

    @property
    def saves_h(self) -> bool:
        """Whether the backward reads ``h`` (what was normalized, returned by the forward)
        instead of ``x`` and the residual (``"float32_normalized"`` returns ``h`` rounded)."""
        return self.math.residual in ("rounded", "float32")

    def compiler_params(self, backward: bool) -> Any:
        return plgpu.CompilerParams(num_warps=self.layout.warps(backward), num_stages=1)


def supports(
    x: jax.Array,
    spec: NormSpec,
    axes: tuple[int, ...],
    params: Sequence[jax.Array | None] = (),
) -> bool:
    """Whether the kernels compute ``spec`` on ``x`` normalized over ``axes``: an exact
    backward, x in float32, bfloat16 or float16, parameters of those, the normalized axes
    trailing, rows (or groups) of at most `MAX_BLOCK` elements, at least one row."""
    if spec.backward != "exact" or jnp.dtype(x.dtype) not in _KERNEL_DTYPES or x.size == 0:
        return False
    if any(p is not None and jnp.dtype(p.dtype) not in _KERNEL_DTYPES for p in params):
        return False
    if axes != tuple(range(x.ndim - len(axes), x.ndim)):
        return False
    n = math.prod(x.shape[a] for a in axes)
    groups = spec.group_count(n) if spec.kind in ("rms", "layer") else 1
    return math.prod(_layout(1, n, groups).block_inner) <= MAX_BLOCK


# --- the kernels ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """What of each row a program's tile covers: ``shape`` (a row's padded block, or a slice of
    it along its first axis), from ``start`` on that axis (0, or the slice's, traced)."""

    shape: tuple[int, ...]
    start: Any = 0


def _whole(k: _Kernel) -> _Piece:
    return _Piece(k.layout.block_inner)


def _masks(k: _Kernel, first_row: jax.Array, piece: _Piece, mask: Any = None
           ) -> tuple[jax.Array, jax.Array]:
    """``(valid, read)`` of a tile starting at ``first_row``: the elements inside the arrays,
    and those the statistic reads (partial RMS's first k; where ``mask``, a call's mask
    (int8 rows), is not 0)."""
    tile = (k.layout.block_rows, *piece.shape)
    valid = lax.broadcasted_iota(jnp.int32, tile, 0) + first_row < k.layout.rows
    for axis, size in enumerate(k.layout.inner, start=1):
        index = lax.broadcasted_iota(jnp.int32, tile, axis)
        valid &= (index + piece.start if axis == 1 else index) < size
    read = valid
    if k.math.read < k.math.size:
        read = valid & (lax.broadcasted_iota(jnp.int32, tile, 1) + piece.start < k.math.read)
    if mask is not None:
        read = read & (plgpu.load(_at(mask, k, first_row, piece), mask=valid, other=0) != 0)
    return valid, read


def _inner(piece: _Piece) -> tuple[Any, ...]:
    return (pl.ds(piece.start, piece.shape[0]), *(pl.ds(0, b) for b in piece.shape[1:]))


def _at(ref: Any, k: _Kernel, first_row: jax.Array, piece: _Piece) -> Any:
    """The tile of ``ref`` (a row-major array of rows) at ``first_row`` and ``piece``."""
    return ref.at[(pl.ds(first_row, k.layout.block_rows), *_inner(piece))]


def _load(ref: Any, k: _Kernel, first_row: jax.Array, piece: _Piece, valid: jax.Array
          ) -> jax.Array:
    return plgpu.load(_at(ref, k, first_row, piece), mask=valid, other=0).astype(F32)


def _store(ref: Any, k: _Kernel, first_row: jax.Array, piece: _Piece, valid: jax.Array,
           value: jax.Array) -> None:
    plgpu.store(_at(ref, k, first_row, piece), value.astype(ref.dtype), mask=valid)


def _columns(k: _Kernel, piece: _Piece) -> jax.Array:
    """Which elements of ``piece`` lie inside a row (a parameter's mask)."""
    masks = []
    for axis, size in enumerate(k.layout.inner):
        index = lax.broadcasted_iota(jnp.int32, piece.shape, axis)
        masks.append((index + piece.start if axis == 0 else index) < size)
    return functools.reduce(jnp.logical_and, masks)


def _load_param(ref: Any | None, k: _Kernel, piece: _Piece) -> jax.Array | None:
    """A parameter (of a row's shape) over ``piece``, in float32, broadcast over the rows."""
    if ref is None:
        return None
    value = plgpu.load(ref.at[_inner(piece)], mask=_columns(k, piece), other=0)
    return value.astype(F32)[None]


def _load_alpha(ref: Any | None) -> jax.Array | None:
    if ref is None:
        return None
    return jnp.sum(plgpu.load(ref.at[pl.ds(0, 1)]).astype(F32))


@dataclass(frozen=True)
class _Refs:
    """The kernels' inputs, by name, in the order they are passed (absent ones skipped)."""

    names: tuple[str, ...]

    def bind(self, refs: Sequence[Any]) -> tuple[dict[str, Any], Iterator[Any]]:
        it = iter(refs)
        return {name: next(it) for name in self.names}, it


def _forward_kernel(*refs: Any, k: _Kernel, inputs: _Refs) -> None:
    got, outputs = inputs.bind(refs)
    y_ref = next(outputs)
    h_ref = next(outputs, None)
    m = k.math
    piece = _whole(k)
    first_row = pl.program_id(0) * k.layout.block_rows
    valid, read = _masks(k, first_row, piece, got.get("mask"))
    v = _load(got["x"], k, first_row, piece, valid)
    if "residual" in got:
        v = rows_math.added(v, _load(got["residual"], k, first_row, piece, valid), m)
        assert h_ref is not None
        _store(h_ref, k, first_row, piece, valid, v)
    a = None
    if "gate" in got:
        a = rows_math.activation(_load(got["gate"], k, first_row, piece, valid), m.activation)[0]
    g = rows_math.gain(_load_param(got.get("scale"), k, piece), m)
    y = rows_math.forward(v, valid, read, a, g, _load_param(got.get("bias"), k, piece),
                          _load_alpha(got.get("alpha")), m)
    _store(y_ref, k, first_row, piece, valid, y)


def _loaded(got: dict[str, Any], k: _Kernel, first_row: jax.Array, piece: _Piece,
            valid: jax.Array) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """``(v, z, dy)`` of a backward tile: the values normalized (the residual added), the gate
    (None without one) and the cotangent, in float32."""
    v = _load(got["source"], k, first_row, piece, valid)
    if "residual" in got:
        v = rows_math.added(v, _load(got["residual"], k, first_row, piece, valid), k.math)
    z = _load(got["gate"], k, first_row, piece, valid) if "gate" in got else None
    return v, z, _load(got["dy"], k, first_row, piece, valid)


def _row_values_kernel(*refs: Any, k: _Kernel, inputs: _Refs, names: tuple[str, ...]) -> None:
    """The per-row values of the backward (`normkit._pallas_rows.row_terms`) from whole rows,
    for `_backward_kernel` on slices of them: one value per row (per group) and name."""
    got, outputs = inputs.bind(refs)
    m = k.math
    piece = _whole(k)
    first_row = pl.program_id(0) * k.layout.block_rows
    valid, read = _masks(k, first_row, piece, got.get("mask"))
    v, z, dy = _loaded(got, k, first_row, piece, valid)
    a = None if z is None else rows_math.activation(z, m.activation)[0]
    g = rows_math.gain(_load_param(got.get("scale"), k, piece), m)
    st, terms = rows_math.row_terms(v, dy, valid, read, a, g, m)
    values = {**st._asdict(), **terms._asdict()}
    row_piece = _Piece((*piece.shape[:-1], 1))
    row_valid = _masks(k, first_row, row_piece)[0]
    for name in names:
        _store(next(outputs), k, first_row, row_piece, row_valid, values[name])


def _row_values(m: RowMath) -> tuple[str, ...]:
    """The per-row values (`Stats`, `Terms`) the spec's backward reads; ``eps`` and ``r``
    follow from ``t`` and ``s``, and the others are zeros."""
    names = ["t", "s", "t_d"]
    if m.layer:
        names += ["mean", "correction", "layer_sum"]
    if not m.degenerate:
        names.append("projection")
    closed = m.degenerate or m.masked
    if closed and m.layer:
        names.append("own")
    if closed and m.unread:
        names += ["others", "others_sum"] if m.layer else ["others"]
    if m.masked:
        names.append("reads")
    return tuple(names)


def _backward_kernel(*refs: Any, k: _Kernel, inputs: _Refs, slice_shape: tuple[int, ...] | None
                     ) -> None:
    """One program's tiles, every ``programs``-th from its own index: their input gradients,
    and the parameters' terms summed over its tiles in registers, written once. With a
    ``slice_shape``, the program's slice of the rows (the grid's second axis), the statistic
    and the sums read from `_row_values_kernel`'s output."""
    got, outputs = inputs.bind(refs)
    m = k.math
    piece = _whole(k)
    if slice_shape is not None:
        piece = _Piece(slice_shape, pl.program_id(1) * slice_shape[0])
    dx_ref = next(outputs)
    dresidual_ref = next(outputs) if m.residual is not None else None
    dgate_ref = next(outputs) if "gate" in got else None
    summed = [name for name in ("scale", "bias", "alpha") if name in got]
    sum_refs = [next(outputs) for _ in summed]
    g = rows_math.gain(_load_param(got.get("scale"), k, piece), m)
    b = _load_param(got.get("bias"), k, piece)
    alpha = _load_alpha(got.get("alpha"))
    program = pl.program_id(0)
    programs = k.layout.programs
    tile_shape = (k.layout.block_rows, *piece.shape)

    def rows(first_row: jax.Array) -> tuple[rows_math.Stats, rows_math.Terms] | None:
        """The tile's per-row values, where the rows were taken whole before (a slice)."""
        if slice_shape is None or alpha is not None:
            return None
        grouped = k.layout.grouped
        row_piece = _Piece((*piece.shape[:-1], 1), piece.start if grouped else 0)
        if not grouped:
            row_piece = _Piece((1,))
        valid = _masks(k, first_row, row_piece)[0]
        zero = jnp.zeros(valid.shape, F32)
        found = {name: plgpu.load(_at(got[name], k, first_row, row_piece), mask=valid, other=0)
                 for name in _row_values(m)}
        t = found["t"]
        scale = rows_math.pow2(t)
        eps = m.eps * scale if m.outside else (m.eps * scale) * scale
        r = rows_math.rsqrt_or_inverse(found["s"], eps, m.outside)
        st = rows_math.Stats(t, found.get("mean", zero), found.get("correction", zero),
                             found["s"], eps, r, found.get("reads", zero + m.read))
        terms = rows_math.Terms(*(found.get(n, zero) for n in rows_math.Terms._fields))
        return st, terms

    def tile(i: jax.Array, sums: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        first_row = (program + i * programs) * k.layout.block_rows
        valid, read = _masks(k, first_row, piece, got.get("mask"))
        v, z, dy = _loaded(got, k, first_row, piece, valid)
        activated = None if z is None else rows_math.activation(z, m.activation)
        grads = rows_math.backward(v, dy, valid, read, activated, g, b, alpha, m,
                                   rows(first_row))
        dv = grads.dv
        if "dh" in got:
            dv = dv + _load(got["dh"], k, first_row, piece, valid)
        _store(dx_ref, k, first_row, piece, valid, dv)
        if dresidual_ref is not None:
            _store(dresidual_ref, k, first_row, piece, valid, dv)
        if dgate_ref is not None:
            assert grads.dgate is not None
            _store(dgate_ref, k, first_row, piece, valid, grads.dgate)
        terms = {"scale": grads.dscale, "bias": grads.dbias, "alpha": grads.dalpha}
        return tuple(total + jnp.where(valid, terms[name], 0)  # type: ignore[arg-type]
                     for name, total in zip(summed, sums, strict=True))

    zeros = tuple(jnp.zeros(tile_shape, F32) for _ in summed)
    sums = lax.fori_loop(0, pl.cdiv(k.layout.tiles, programs), tile, zeros)
    for name, ref, total in zip(summed, sum_refs, sums, strict=True):
        if name == "alpha":
            for _ in tile_shape:  # one axis at a time, as Triton reduces
                total = jnp.sum(total, axis=-1)
            plgpu.store(ref.at[pl.ds(program, 1), pl.ds(pl.program_id(1), 1)],
                        total.reshape(1, 1))
        else:
            plgpu.store(ref.at[(pl.ds(program, 1), *_inner(piece))],
                        jnp.sum(total, axis=0, keepdims=True), mask=_columns(k, piece)[None])


# --- the calls --------------------------------------------------------------------------------


def _rows(value: jax.Array | None, k: _Kernel) -> jax.Array | None:
    return None if value is None else value.reshape((k.layout.rows, *k.layout.inner))


def _row_param(value: jax.Array | None, k: _Kernel) -> jax.Array | None:
    return None if value is None else value.reshape(k.layout.inner)


def _scoped(k: _Kernel) -> contextlib.AbstractContextManager[Any]:
    """64-bit mode while the fast variance's kernel is traced (its sums are float64)."""
    return jax.enable_x64(True) if k.math.fast else contextlib.nullcontext()


def _kernel_inputs(k: _Kernel, arrays: dict[str, jax.Array | None]) -> dict[str, jax.Array]:
    """The arrays given, as the kernels read them: rows, a row's shape, alpha of shape (1,)."""
    found = {}
    for name, a in arrays.items():
        if a is None:
            continue
        if name in ("scale", "bias"):
            found[name] = a.reshape(k.layout.inner)
        else:
            found[name] = a.reshape(1) if name == "alpha" else a.reshape(
                (k.layout.rows, *k.layout.inner))
    return found


def _call_forward(
    k: _Kernel, arrays: dict[str, jax.Array | None]
) -> tuple[jax.Array, jax.Array | None]:
    """``(y, h)`` of the forward kernel (``h`` None without a residual), in x's shape."""
    shape = arrays["x"].shape  # type: ignore[union-attr]
    inputs = _kernel_inputs(k, arrays)
    array = (k.layout.rows, *k.layout.inner)
    outs = [jax.ShapeDtypeStruct(array, k.out_dtype)]
    if k.math.residual is not None:
        assert k.h_dtype is not None
        outs.append(jax.ShapeDtypeStruct(array, k.h_dtype))
    kernel = functools.partial(_forward_kernel, k=k, inputs=_Refs(tuple(inputs)))
    with _scoped(k):
        results = pl.pallas_call(
            kernel, grid=(k.layout.tiles,), out_shape=outs, interpret=k.interpret,
            compiler_params=k.compiler_params(backward=False), name="normkit_norm_forward",
        )(*inputs.values())
    y = results[0].reshape(shape)
    return y, (results[1].reshape(shape) if len(results) > 1 else None)


def _slices(k: _Kernel) -> tuple[int, ...] | None:
    """The shape of the slices the backward takes rows in, where a row's block is longer than
    ``LAUNCH["fused"]`` elements (holding it whole with the parameters' sums would spill
    registers): slices of about ``LAUNCH["slice"]`` elements along its first axis (columns, or
    whole groups). None: rows whole."""
    block = k.layout.block_inner
    if math.prod(block) <= LAUNCH["fused"]:
        return None
    rest = math.prod(block[1:])
    first = max(1, min(block[0], LAUNCH["slice"] // rest))
    return None if first == block[0] else (first, *block[1:])


def _call_backward(
    k: _Kernel, arrays: dict[str, jax.Array | None], dtypes: dict[str, jnp.dtype]
) -> dict[str, jax.Array]:
    """The gradients by name (``dx``, ``dresidual``, ``dgate``, ``dscale``, ``dbias``,
    ``dalpha``, those the call has), each in its array's dtype (``dtypes``). Rows longer than
    `_slices` allows are taken in slices, their per-row values computed first from the whole
    rows (`_row_values_kernel`): one more read of the inputs, no spilled registers."""
    shape = arrays["dy"].shape  # type: ignore[union-attr]
    inputs = _kernel_inputs(k, arrays)
    array = (k.layout.rows, *k.layout.inner)
    programs = k.layout.programs
    slice_shape = _slices(k)
    slices = 1 if slice_shape is None else pl.cdiv(k.layout.block_inner[0], slice_shape[0])
    if slice_shape is not None and "alpha" not in inputs:
        value_names = _row_values(k.math)
        values = _row_values_call(k, inputs, value_names)
        inputs = {**inputs, **dict(zip(value_names, values, strict=True))}
    names = ["dx"]
    outs = [jax.ShapeDtypeStruct(array, dtypes["dx"])]
    if k.math.residual is not None:
        names.append("dresidual")
        outs.append(jax.ShapeDtypeStruct(array, dtypes["dresidual"]))
    if "gate" in inputs:
        names.append("dgate")
        outs.append(jax.ShapeDtypeStruct(array, dtypes["dgate"]))
    for name in ("scale", "bias"):
        if name in inputs:
            names.append("d" + name)
            outs.append(jax.ShapeDtypeStruct((programs, *k.layout.inner), F32))
    if "alpha" in inputs:
        names.append("dalpha")
        outs.append(jax.ShapeDtypeStruct((programs, slices), F32))
    kernel = functools.partial(_backward_kernel, k=k, inputs=_Refs(tuple(inputs)),
                               slice_shape=slice_shape)
    results = pl.pallas_call(
        kernel, grid=(programs, slices), out_shape=outs, interpret=k.interpret,
        compiler_params=k.compiler_params(backward=True), name="normkit_norm_backward",
    )(*inputs.values())
    found = dict(zip(names, results, strict=True))
    grads = {}
    for name, value in found.items():
        if name in ("dx", "dresidual", "dgate"):
            grads[name] = value.reshape(shape)
        else:  # partial sums, one per program (and slice), added in a fixed order
            total = jnp.sum(value, axis=0)
            if name == "dalpha":
                total = jnp.sum(total, axis=0)
            target = arrays[name[1:]]
            assert target is not None
            grads[name] = total.reshape(target.shape).astype(dtypes[name])
    return grads


def _row_values_call(k: _Kernel, inputs: dict[str, jax.Array], names: tuple[str, ...]
                     ) -> list[jax.Array]:
    """`_row_values_kernel`'s per-row values, one array (rows, [groups,] 1) per name."""
    shape = (k.layout.rows, *k.layout.inner[:-1], 1)
    outs = [jax.ShapeDtypeStruct(shape, jnp.int32 if name in ("t", "t_d") else F32)
            for name in names]
    read = {n: a for n, a in inputs.items()
            if n in ("source", "residual", "gate", "scale", "dy", "mask")}
    kernel = functools.partial(_row_values_kernel, k=k, inputs=_Refs(tuple(read)), names=names)
    return list(pl.pallas_call(
        kernel, grid=(k.layout.tiles,), out_shape=outs, interpret=k.interpret,
        compiler_params=k.compiler_params(backward=False), name="normkit_norm_backward_rows",
    )(*read.values()))


# --- the custom VJP ---------------------------------------------------------------------------

_Arrays = tuple[jax.Array | None, ...]
_NAMES = ("x", "residual", "gate", "scale", "bias", "alpha", "mask")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(k: _Kernel, *arrays: jax.Array | None) -> jax.Array | tuple[jax.Array, jax.Array]:
    return _norm_fwd(k, *arrays)[0]


def _norm_fwd(
    k: _Kernel, *arrays: jax.Array | None
) -> tuple[jax.Array | tuple[jax.Array, jax.Array], _Arrays]:
    named = dict(zip(_NAMES, arrays, strict=True))
    y, h = _call_forward(k, named)
    if h is None:
        return y, arrays
    saved = (h, None, *arrays[2:]) if k.saves_h else arrays
    return (y, h), saved


def _norm_bwd(
    k: _Kernel, saved: _Arrays, cotangent: jax.Array | tuple[jax.Array, jax.Array]
) -> tuple[jax.Array | None, ...]:
    source, residual, gate, scale, bias, alpha, mask = saved
    assert source is not None
    dy, dh = cotangent if k.math.residual is not None else (cotangent, None)
    arrays = {"source": source, "residual": residual, "gate": gate, "scale": scale,
              "bias": bias, "alpha": alpha, "dy": dy, "dh": dh, "mask": mask}
    dtypes = {"dx": k.x_dtype, "dresidual": k.residual_dtype}
    for name in ("gate", "scale", "bias", "alpha"):
        if arrays[name] is not None:
            dtypes["d" + name] = jnp.dtype(arrays[name].dtype)  # type: ignore[union-attr]
    grads = _call_backward(k, arrays, dtypes)  # type: ignore[arg-type]
    return tuple(grads.get("d" + name) for name in _NAMES)  # none for the mask


_norm.defvjp(_norm_fwd, _norm_bwd)


# --- the public functions ---------------------------------------------------------------------


def _math(
    spec: NormSpec,
    dtype: jnp.dtype,
    scale: jax.Array | None,
    bias: jax.Array | None,
    n: int,
    groups: int,
    masked: bool,
) -> RowMath:
    half = dtype if dtype in _HALF else None
    before_scale = half is not None and spec.cast == "before_scale"
    offset_dtype = None
    if scale is not None and spec.scale_offset and spec.offset_dtype == "param":
        offset_dtype = jnp.dtype(scale.dtype) if jnp.dtype(scale.dtype) in _HALF else None
    affine_dtype = None
    if spec.gate == "after" and before_scale:
        kinds = [dtype]
        if scale is not None:
            kinds.append(jnp.dtype(scale.dtype))
            if spec.scale_offset and spec.offset_dtype == "float32":
                kinds.append(jnp.dtype(F32))
        if bias is not None:
            kinds.append(jnp.dtype(bias.dtype))
        promoted = jnp.dtype(jnp.result_type(*kinds))
        affine_dtype = promoted if promoted in _HALF else None
    size = n // groups
    return RowMath(
        kind=spec.kind, eps=1.0 if spec.eps is None else spec.eps,
        outside=spec.eps_placement == "outside", fast=spec.variance == "fast",
        read=spec.stat_size(size) if spec.kind != "dyt" else size, size=size,
        offset=spec.scale_offset, has_scale=scale is not None, has_bias=bias is not None,
        half=half, before_scale=before_scale, offset_dtype=offset_dtype,
        affine_dtype=affine_dtype, gate=spec.gate,
        activation=spec.gate_activation or "silu", residual=spec.residual, masked=masked,
    )


def run(
    x: jax.Array,
    residual: jax.Array | None,
    spec: NormSpec,
    scale: jax.Array | None,
    bias: jax.Array | None,
    gate: jax.Array | None,
    alpha: jax.Array | None,
    out: jnp.dtype,
    mask: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``spec`` through the kernels, with its analytic VJP: ``y``, or ``(y, h)`` with a
    residual, ``y`` in ``out``; ``mask`` (booleans of x's shape) restricts the statistic as
    `normkit.reference.normalize`'s does. The arguments are checked and cast by
    `normkit.jax.functional` or `normkit.tf.layers`, which call this (``x`` in its compute
    dtype); ``interpret`` runs the kernels in Pallas' interpreter. ValueError where `supports`
    is False."""
    axes = spec.resolve_axes(x.ndim)
    if not supports(x, spec, axes, (residual, gate, scale, bias, alpha)):
        raise ValueError(
            f"normkit's Pallas kernels do not compute {spec} on x of shape {x.shape} and dtype "
            f"{x.dtype}: it needs backward='exact', float32, bfloat16 or float16 arrays, the "
            f"normalized axes trailing and rows of at most {MAX_BLOCK} elements"
        )
    n = math.prod(x.shape[a] for a in axes)
    groups = spec.group_count(n) if spec.kind in ("rms", "layer") else 1
    dtype = jnp.dtype(x.dtype)
    h_dtype = None
    if residual is not None:
        h_dtype = jnp.dtype(F32) if spec.residual == "float32" else dtype
    k = _Kernel(
        math=_math(spec, dtype, scale, bias, n, groups, mask is not None),
        layout=_layout(x.size // n, n, groups), x_dtype=dtype, out_dtype=jnp.dtype(out),
        residual_dtype=None if residual is None else jnp.dtype(residual.dtype),
        h_dtype=h_dtype, interpret=interpret,
    )
    if alpha is not None:
        alpha = jnp.asarray(alpha)
    if mask is not None:
        mask = mask.astype(jnp.int8)  # what a kernel loads (booleans are not memory types)
    return _norm(k, x, residual, gate, scale, bias, alpha, mask)
