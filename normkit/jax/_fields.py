"""What the linen and NNX modules share: the translation between a `NormSpec` and their
keyword arguments (normkit's and Flax's, both ways), the layout of Flax's parameters over its
feature axes, and what a module does on a call (`module_output`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from normkit.jax import functional
from normkit.spec import Kind, NormSpec, OutputDtype, Variance

Axes: TypeAlias = int | Sequence[int]
Initializer: TypeAlias = Any  # a jax.nn.initializers function: (key, shape, dtype) -> array
#: A module's ``(scale, bias, alpha)``, each None where the spec lacks it.
Params: TypeAlias = tuple[jax.Array | None, jax.Array | None, jax.Array | None]


# The spec fields every module takes as they are, by the module's name for each (Flax's
# use_scale and use_bias for scale and bias); axis and output_dtype follow Flax's arguments.
SHARED_FIELDS = {
    "use_scale": "scale",
    "scale_offset": "scale_offset",
    "use_bias": "bias",
    "cast": "cast",
    "residual": "residual",
    "offset_dtype": "offset_dtype",
    "backward": "backward",
}


def module_kwargs(spec: NormSpec) -> dict[str, Any]:
    """The keyword arguments that make a linen or NNX module of ``spec.kind`` compute ``spec``."""
    kwargs: dict[str, Any] = {name: getattr(spec, field) for name, field in SHARED_FIELDS.items()}
    kwargs.update(axis=spec.axis, output_dtype=spec.output_dtype)
    if spec.kind == "dyt":
        kwargs["alpha_init"] = spec.alpha_init
        return kwargs
    kwargs.update(
        epsilon=spec.eps, eps_placement=spec.eps_placement, gate=spec.gate,
        gate_activation=spec.gate_activation, group_size=spec.group_size,
    )
    if spec.kind == "partial_rms":
        kwargs["p"] = spec.p
    if spec.kind == "layer":
        kwargs["variance"] = spec.variance
    return kwargs


def flax_spec(
    kind: Kind,
    *,
    axis: int | tuple[int, ...],
    output_dtype: OutputDtype | None,
    dtype: DTypeLike | None,
    **fields: Any,
) -> NormSpec:
    """The spec a linen or NNX module of ``kind`` computes, from its fields by the modules'
    names (the inverse of `module_kwargs`): `SHARED_FIELDS`, the kind's own fields by the spec's
    names and, for the normalization kinds, ``epsilon``, Flax's ``use_fast_variance``
    (`flax_variance`) and ``axis_index_groups`` (only None); ``axis`` is the spec's
    (`flax_axis`), ``output_dtype`` follows Flax's rule (`flax_output_dtype`)."""
    if kind != "dyt":
        check_axis_index_groups(fields.pop("axis_index_groups"))
        fields["eps"] = fields.pop("epsilon")
        variance = fields.pop("variance", None)
        fields["variance"] = flax_variance(kind, variance, fields.pop("use_fast_variance"))
    named = {SHARED_FIELDS.get(name, name): value for name, value in fields.items()}
    return NormSpec(
        kind=kind, axis=axis, output_dtype=flax_output_dtype(output_dtype, dtype), **named
    )


def module_output(
    module: object,
    spec: NormSpec,
    x: jax.Array,
    residual: jax.Array | None,
    feature_axes: tuple[int, ...],
    params: Callable[[jax.Array, tuple[int, ...]], Params],
    **call: Any,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """A module's call: the residual checked against the spec (`check_residual`), ``x`` as an
    array, the parameters ``params(x, features)`` (``scale`` and ``bias`` in Flax's layout over
    the feature axes, `feature_positions`, and DyT's ``alpha``) spread to the spec's shape
    (`spread`), and the norm (`normalize_or_add`, which takes the keyword arguments ``call``:
    ``gate``, ``mask``, ``dtype``, ``axis_name``, ``implementation``)."""
    layer = type(module).__name__
    check_residual(layer, spec, residual)
    x = functional.as_array("x", x)
    features = feature_positions(spec, feature_axes, x.ndim)
    scale, bias, alpha = params(x, features)
    scale, bias = (None if p is None else spread(p, spec, features, x.shape) for p in (scale, bias))
    return normalize_or_add(layer, spec, x, residual, scale, bias, alpha, **call)


def check_residual(layer: str, spec: NormSpec, residual: object) -> None:
    """A residual exactly when ``spec`` has one: TypeError for a missing one, ValueError for one
    the spec has no rounding for."""
    if spec.residual is not None and residual is None:
        raise TypeError(
            f"{layer} has residual={spec.residual!r}: call it with the residual, "
            "layer(x, residual), and it returns (y, h)"
        )
    if spec.residual is None and residual is not None:
        raise ValueError(
            f"{layer} was given a residual but its spec has residual=None; build it with "
            "residual='rounded', 'float32' or 'float32_normalized' to add one before the norm "
            "(Flax's mask is keyword-only here: layer(x, mask=mask))"
        )


def normalize_or_add(
    layer: str,
    spec: NormSpec,
    x: jax.Array,
    residual: jax.Array | None,
    scale: jax.Array | None,
    bias: jax.Array | None,
    alpha: jax.Array | None,
    *,
    gate: jax.Array | None,
    mask: jax.Array | None,
    dtype: DTypeLike | None,
    axis_name: str | None,
    implementation: functional.Implementation | None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """A module's output: `functional.normalize` of ``x`` (with ``gate`` and ``mask``), or for a
    ``residual``, ``(y, h)`` of `functional.add_norm`, which takes neither (ValueError); by the
    program ``implementation`` selects (`functional.normalize`)."""
    if residual is None:
        return functional.normalize(
            x, spec, scale, bias, gate=gate, alpha=alpha, dtype=dtype, axis_name=axis_name,
            mask=mask, implementation=implementation,
        )
    if mask is not None:
        raise ValueError(
            f"{layer} has residual={spec.residual!r}: mask is supported without a residual only"
        )
    if gate is not None:
        raise ValueError(f"{layer} has residual={spec.residual!r}: a gated norm has no residual")
    return functional.add_norm(
        x, residual, spec, scale, bias, alpha=alpha, dtype=dtype, axis_name=axis_name,
        implementation=implementation,
    )


# --- Flax's arguments --------------------------------------------------------------------------


def flax_axis(
    axis: int | tuple[int, ...] | None, reduction_axes: Axes, feature_axes: Axes
) -> tuple[int | tuple[int, ...], tuple[int, ...]]:
    """``(spec axis, feature axes)`` from normkit's ``axis`` and Flax's ``reduction_axes`` and
    ``feature_axes`` (Flax's default -1 each). ``axis``, when given, sets both; a Flax argument
    given with another value than ``axis`` is a ValueError naming both."""
    if axis is None:
        return as_axes(reduction_axes), as_axes(feature_axes)
    for name, value in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
        if as_axes(value) not in ((-1,), as_axes(axis)):
            raise ValueError(
                f"axis={axis!r} and {name}={value!r} conflict: axis sets both the reduction and "
                "the feature axes; give one of them"
            )
    return axis, as_axes(axis)


def as_axes(axes: Axes) -> tuple[int, ...]:
    """An int or a sequence of ints as a tuple."""
    return (axes,) if isinstance(axes, int) else tuple(axes)


def flax_variance(
    kind: str, variance: Variance | None, use_fast_variance: bool
) -> Variance | None:
    """The spec's ``variance``: the one given, else (LayerNorm) Flax's ``use_fast_variance``,
    ``"fast"`` or ``"two_pass"``; None, the spec default, for the RMS kinds, whose statistic has
    no mean (Flax's RMSNorm ignores the flag too). ``variance="fast"`` with
    ``use_fast_variance=False`` is a ValueError naming both."""
    if variance == "fast" and not use_fast_variance:
        raise ValueError(
            "variance='fast' and use_fast_variance=False conflict: give one of them"
        )
    if variance is not None or kind != "layer":
        return variance
    return "fast" if use_fast_variance else "two_pass"


def flax_output_dtype(output_dtype: OutputDtype | None, dtype: DTypeLike | None) -> OutputDtype:
    """The spec's ``output_dtype``: the one given, else Flax's rule: ``"promote"`` (the result
    type of the input and the parameters) without ``dtype``, ``"input"`` (``dtype`` itself) with
    it."""
    if output_dtype is not None:
        return output_dtype
    return "promote" if dtype is None else "input"


def check_axis_index_groups(axis_index_groups: object) -> None:
    """Only None: the statistics are reduced across the whole of ``axis_name``."""
    if axis_index_groups is not None:
        raise ValueError(
            f"axis_index_groups={axis_index_groups!r} is not supported: the statistics are "
            "reduced across the whole mesh axis axis_name (leave axis_index_groups None)"
        )


def feature_positions(
    spec: NormSpec, feature_axes: tuple[int, ...], ndim: int
) -> tuple[int, ...]:
    """The feature axes of an input of rank ``ndim`` (non-negative, increasing); ValueError if
    one is out of range, or, when the layer has a scale or bias, not a normalized axis (the
    spec's parameters span the normalized axes)."""
    resolved = set()
    for a in feature_axes:
        if not -ndim <= a < ndim:
            raise ValueError(
                f"feature_axes={feature_axes!r}: axis {a} is out of range for an input of rank "
                f"{ndim}"
            )
        resolved.add(a % ndim)
    if (spec.scale or spec.bias) and not resolved <= set(spec.resolve_axes(ndim)):
        raise ValueError(
            f"feature_axes={feature_axes!r} must be among the reduction axes {spec.axis}: "
            "NormSpec's scale and bias vary only over the normalized axes (Flax's "
            "InstanceNorm-style layout, parameters along a batch axis, is not expressible)"
        )
    return tuple(sorted(resolved))


def spread(
    param: jax.Array, spec: NormSpec, features: tuple[int, ...], shape: tuple[int, ...]
) -> jax.Array:
    """A parameter over the feature axes (Flax's layout) repeated over the other normalized
    axes: the spec's parameter of shape ``spec.param_shape(shape)``."""
    axes = spec.resolve_axes(len(shape))
    if features == axes:
        return param
    have = tuple(shape[a] for a in features)
    if jnp.shape(param) != have:
        raise ValueError(
            f"a parameter has shape {jnp.shape(param)}, but x of shape {shape} has {have} "
            f"features over the feature axes {features}: wrong feature size for this layer"
        )
    layout = [shape[a] if a in features else 1 for a in axes]
    return jnp.broadcast_to(jnp.reshape(param, layout), spec.param_shape(shape))
