"""Norm parameters between the frameworks' naming conventions and between offset conventions.

A norm's parameters are ``w`` and ``b`` (those its spec has) and, for DyT, ``alpha``, a learned
scalar of shape ``(1,)`` named ``alpha`` in every convention.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias

import ml_dtypes
import numpy as np

from normkit import dtypes
from normkit.spec import NormSpec

Convention: TypeAlias = Literal["torch", "keras", "flax", "numpy"]

#: The names of ``(w, b)`` in each convention. Keras' are the normkit layers' weight names.
NAMES: dict[str, tuple[str, str]] = {
    "torch": ("weight", "bias"),
    "keras": ("scale", "bias"),
    "flax": ("scale", "bias"),
    "numpy": ("scale", "bias"),
}
CONVENTIONS: tuple[str, ...] = tuple(NAMES)
#: DyT's learned scalar: its name in every convention, and its shape.
ALPHA = "alpha"
ALPHA_SHAPE = (1,)

__all__ = ["CONVENTIONS", "NAMES", "Convention", "convert", "param_names", "to_numpy"]


def param_names(spec: NormSpec, convention: str) -> list[str]:
    """The names, in ``convention``, of the parameters ``spec`` has (scale first, then bias,
    then DyT's ``alpha``)."""
    w, b = NAMES[_check_convention(convention, "convention")]
    present = ((w, spec.scale), (b, spec.bias), (ALPHA, spec.kind == "dyt"))
    return [name for name, has in present if has]


def to_numpy(value: Any) -> np.ndarray:
    """``value`` as a numpy array: numpy, a torch tensor or parameter (detached, moved to the
    CPU; bfloat16 kept), a Keras variable, a JAX array or a Flax ``Param``."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch, imported by whoever made it
        from normkit.backends import bridge

        return bridge("torch").to_numpy(value)
    if hasattr(value, "get_value") and not isinstance(value, np.ndarray):  # flax nnx Variable
        value = value.get_value()
    return np.asarray(value)


def convert(
    params: Mapping[str, Any] | Sequence[Any],
    spec: NormSpec,
    *,
    src: str,
    dst: str,
    dst_spec: NormSpec | None = None,
    change_offset_dtype: bool = False,
) -> dict[str, np.ndarray]:
    """The parameters of a ``spec`` norm, renamed from convention ``src`` to ``dst``.

    Conventions name ``(w, b)``: ``"torch"`` ``weight``/``bias``; ``"keras"``, ``"flax"`` and
    ``"numpy"`` ``scale``/``bias``; DyT's ``alpha`` (shape ``(1,)``) is ``alpha`` in all. With
    ``src="keras"``, ``params`` may also be the list of `keras.layers.Layer.get_weights`
    (``[scale, bias, alpha]``, those the spec has).

    With ``dst_spec`` differing from ``spec`` in ``scale_offset``, the scale moves to the
    destination offset: ``w' = w + (scale_offset - dst_spec.scale_offset)``, computed in float64
    and rounded once (to nearest even) to ``w``'s dtype, so ``dst_spec`` computes what ``spec``
    did up to that rounding.

    A change of ``offset_dtype`` must be asked for with ``change_offset_dtype=True``:

    - ``"param"`` to ``"float32"``: ``w' = round_w(scale_offset + w) - scale_offset``, exact in
      ``w``'s dtype, so the effective scale, and the output, are unchanged;
    - ``"float32"`` to ``"param"``: ``w`` is kept and the effective scale becomes
      ``round_w(scale_offset + w)``: the outputs move by up to half a unit in the last place of
      ``scale_offset + w`` in ``w``'s dtype (in bfloat16, 2^-8 of it).

    A move of both goes through ``"float32"`` at the source offset. Values are returned as numpy
    arrays (framework tensors accepted).

    Raises:
      ValueError: an unknown convention, a missing, unexpected or wrongly shaped parameter,
        specs that differ in a field other than ``scale_offset`` (and ``offset_dtype`` with
        ``change_offset_dtype=True``), or a move of the offset that overflows ``w``'s dtype or,
        rounded to it, changes the effective scale by more than one unit in the last place of
        its largest value.
      TypeError: a parameter that is not float16, bfloat16, float32 or float64.
    """
    src = _check_convention(src, "src")
    dst = _check_convention(dst, "dst")
    values = _canonical(params, spec, src)
    if dst_spec is not None:
        _check_same_function(spec, dst_spec, change_offset_dtype)
        values = _move_offset(values, spec, dst_spec)
    w, b = NAMES[dst]
    names = {"scale": w, "bias": b, ALPHA: ALPHA}
    return {names[name]: value for name, value in values.items()}


def _check_values(values: Mapping[str, np.ndarray], spec: NormSpec, names: Sequence[str]) -> None:
    """Check canonical ``{"scale", "bias", "alpha"}`` values against ``spec``: present exactly as
    the spec says, float; the scale and bias one size per normalized axis, both of one shape;
    alpha of shape ``(1,)``. ``names`` are the parameter names in the caller's convention, for
    the messages."""
    shapes = {}
    for (name, value), shown in zip(values.items(), names, strict=True):
        dtypes.as_float_dtype(value.dtype, f"parameter {shown!r}")
        if name == ALPHA:
            if value.shape != ALPHA_SHAPE:
                raise ValueError(
                    f"parameter {shown!r} has shape {value.shape}: DyT's alpha is a scalar of "
                    f"shape {ALPHA_SHAPE} in every framework"
                )
            continue
        if value.ndim != len(spec.axis) or 0 in value.shape:
            raise ValueError(
                f"parameter {shown!r} has shape {value.shape}, but the spec normalizes over axis "
                f"{spec.axis}: it needs {len(spec.axis)} positive size(s), one per axis"
            )
        shapes[shown] = value.shape
    if len(set(shapes.values())) > 1:
        raise ValueError(f"the scale and bias must have one shape, got {shapes}")


def _check_convention(name: str, what: str) -> str:
    if name not in NAMES:
        raise ValueError(f"{what}={name!r} is not a convention; expected one of {CONVENTIONS}")
    return name


def _canonical(
    params: Mapping[str, Any] | Sequence[Any], spec: NormSpec, src: str
) -> dict[str, np.ndarray]:
    """``params`` of convention ``src`` as numpy arrays named ``scale``/``bias``, checked."""
    expected = param_names(spec, src)
    if not isinstance(params, Mapping):
        if src != "keras" or isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
            raise ValueError(
                f"params must be a mapping of {expected} (a list is accepted for src='keras' "
                f"only), got {type(params).__name__}"
            )
        if len(params) != len(expected):
            raise ValueError(
                f"params is a list of {len(params)} arrays, but a layer with scale={spec.scale}, "
                f"bias={spec.bias} has {len(expected)}: {expected} (get_weights() order)"
            )
        params = dict(zip(expected, params, strict=True))
    missing = [n for n in expected if n not in params]
    extra = sorted(str(n) for n in params if n not in expected)
    if missing or extra:
        problems = [f"missing {missing}"] * bool(missing) + [f"unexpected {extra}"] * bool(extra)
        named = sorted(str(n) for n in params)
        others = [c for c in CONVENTIONS if c != src and sorted(param_names(spec, c)) == named]
        hint = (
            f"; these are the {others[0]} convention's names: pass convention={others[0]!r} "
            f"(save, save_norms) or src={others[0]!r} (convert)" if others else ""
        )
        raise ValueError(
            f"params ({src} convention) {' and '.join(problems)}: a spec with scale={spec.scale}, "
            f"bias={spec.bias} has exactly {expected}{hint}"
        )
    canonical = {NAMES[src][0]: "scale", NAMES[src][1]: "bias", ALPHA: ALPHA}
    values = {canonical[n]: to_numpy(params[n]) for n in expected}
    _check_values(values, spec, expected)
    return values


def _check_same_function(spec: NormSpec, dst_spec: NormSpec, change_offset_dtype: bool) -> None:
    """ValueError unless the specs differ in ``scale_offset`` only (and ``offset_dtype`` when
    its change is asked for)."""
    free = {"scale_offset", "offset_dtype"} if change_offset_dtype else {"scale_offset"}
    differing = [
        f.name
        for f in dataclasses.fields(NormSpec)
        if f.name not in free and getattr(spec, f.name) != getattr(dst_spec, f.name)
    ]
    if differing:
        detail = ", ".join(
            f"{n}: {getattr(spec, n)!r} -> {getattr(dst_spec, n)!r}" for n in differing
        )
        hint = (
            "; a change of offset_dtype rounds or rewrites the scale: pass "
            "change_offset_dtype=True to ask for it"
            if differing == ["offset_dtype"]
            else ", any other field changes what the norm computes"
        )
        raise ValueError(
            f"the specs differ in {differing} ({detail}); convert changes scale_offset"
            f"{' and offset_dtype' if change_offset_dtype else ''} only{hint}"
        )


def _move_offset(
    values: dict[str, np.ndarray], spec: NormSpec, dst_spec: NormSpec
) -> dict[str, np.ndarray]:
    """The scale for ``dst_spec``: to ``offset_dtype="float32"`` at the source offset (exact),
    to the destination offset, then to the destination's offset dtype (``w`` kept)."""
    if not spec.scale:
        return values
    scale = values["scale"]
    if spec.offset_dtype == "param" and spec != dst_spec:
        scale = _offset_in_float32(scale, spec.scale_offset)
    shift = spec.scale_offset - dst_spec.scale_offset
    if shift != 0:
        with np.errstate(over="ignore", invalid="ignore"):
            moved = dtypes.round_to(scale.astype(np.float64) + shift, scale.dtype)
        _check_moved(scale, moved, spec.scale_offset, dst_spec.scale_offset)
        scale = moved
    return {**values, "scale": scale}


def _offset_in_float32(scale: np.ndarray, offset: float) -> np.ndarray:
    """``w'`` with ``offset + w' = round_w(offset + w)`` exactly: the scale of
    ``offset_dtype="float32"`` that computes what ``"param"`` did with ``w``."""
    rounded = dtypes.round_to(scale.astype(np.float64) + offset, scale.dtype).astype(np.float64)
    moved = dtypes.round_to(rounded - offset, scale.dtype)
    lost = moved.astype(np.float64) != rounded - offset
    if np.any(lost & np.isfinite(rounded)):
        index = tuple(int(i) for i in np.argwhere(lost & np.isfinite(rounded))[0])
        raise ValueError(
            f"the scale_offset {offset:g} + w rounded in {scale.dtype.name} minus the offset is "
            f"not exact in {scale.dtype.name} at index {index}: the offset dtype cannot be "
            "changed without changing the effective scale"
        )
    return moved


def _check_moved(scale: np.ndarray, moved: np.ndarray, offset: float, dst_offset: float) -> None:
    """Refuse a moved scale ``w'`` that overflows ``w``'s dtype, or that changes the effective
    scale, ``offset + w`` before and ``dst_offset + w'`` after, by more than one unit in the last
    place of its largest value (a shift that dwarfs the scale, e.g. an offset of 1e30)."""
    dtype = scale.dtype
    shift = offset - dst_offset
    move = f"moving the scale from scale_offset {offset:g} to {dst_offset:g}"
    finite = np.isfinite(scale)
    w = np.where(finite, scale.astype(np.float64), 0.0)
    overflow = finite & ~np.isfinite(moved)
    if overflow.any():
        index = tuple(int(i) for i in np.argwhere(overflow)[0])
        raise ValueError(
            f"{move} overflows {dtype.name}: w' = w + ({shift:g}) is {w[index] + shift:.4g} at "
            f"index {index}, beyond {dtype.name}'s largest value "
            f"{float(ml_dtypes.finfo(dtype).max):.4g} (it would be stored as infinity); keep "
            "the source offset"
        )
    # (w' - shift) - w is the change of the effective scale; w' - shift is exact or nearly so
    # (the two are within a factor of two when the shift dominates), so this holds in float64
    # too, where w + shift itself may have lost w.
    change = np.abs(np.where(finite, (moved.astype(np.float64) - shift) - w, 0.0))
    effective = np.abs(w + offset)
    unit = float(dtypes.ulp(effective.max(initial=0.0), dtype))
    if change.max(initial=0.0) > unit:
        index = tuple(int(i) for i in np.unravel_index(int(np.argmax(change)), change.shape))
        raise ValueError(
            f"{move} loses the scale in {dtype.name}: rounding w' = w + "
            f"({offset - dst_offset:g}) changes the effective scale (scale_offset + w) by "
            f"{change[index]:.4g} at index {index}, more than one {dtype.name} ulp ({unit:.3g}) "
            f"of its largest value {effective.max():.4g}; keep the source offset"
        )
