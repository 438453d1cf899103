"""Keras 3 layers that compute a `NormSpec`, written with ``keras.ops`` for every Keras backend."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, TypedDict, Unpack

import keras
import numpy as np
from keras import ops

from normkit import _gating, dtypes, reference
from normkit.spec import (
    DEFAULT_ALPHA_INIT,
    DEFAULT_EPS,
    Backward,
    Cast,
    EpsPlacement,
    Gate,
    GateActivation,
    NormSpec,
    OffsetDtype,
    OutputDtype,
    Residual,
    Variance,
)
from normkit.tf import _careful, _gated, _plain
from normkit.tf._fast import fast_normalized
from normkit.tf._host import eagerly, recording, traced_for_xla
from normkit.tf._programs import gradient_to, recomputed
from normkit.tf._rounding import rounded
from normkit.tf._rows import Rows, affine_step
from normkit.tf._tanh import dyt

__all__ = ["RMSNorm", "PartialRMSNorm", "LayerNorm", "DyT", "from_spec"]

_HALF = ("float16", "bfloat16")

# The defaults of the Keras layers these replace.
LAYER_NORM_EPSILON = 1e-3  # keras.layers.LayerNormalization
RMS_NORM_EPSILON = 1e-6  # keras.layers.RMSNormalization
WEIGHT_ATTRIBUTES = {"scale": "gamma", "bias": "beta", "alpha": "alpha"}
"""Every layer's attribute for each of its weights, by the name the weight is saved under (and
normkit's files and conformance call it); the attribute is None where the spec has no such
weight."""


def _promoted(dtype: str, *param_dtypes: str) -> str:
    """The promoted dtype of ``dtype`` and the parameters' dtypes, by the reference's rule
    (`normkit.reference.output_dtype`): the widest; float16 with bfloat16 gives float32."""
    given = [np.empty(0, dtypes.as_float_dtype(d)) for d in param_dtypes]
    return reference.output_dtype(dtype, _PROMOTE, *given).name


_PROMOTE = NormSpec(output_dtype="promote")


class _Norm(keras.layers.Layer):
    """The shared machinery: weights, dtype policy, shape checks and the spec's arithmetic.

    Dtypes, as Keras' layers: a floating input is first cast to the policy's compute dtype
    (float32 under ``"float32"``, bfloat16 under ``"mixed_bfloat16"``, ...), unless the layer is
    built with Keras' ``autocast=False``, which keeps the input's dtype. The spec then applies to
    that input: the statistic and the normalized value in float32 (float64 for float64), the
    output in its dtype (``output_dtype="input"``) or in its promotion with the variables' dtypes
    (``"promote"``). Variables have ``param_dtype``, by default the policy's variable dtype, and
    are never autocast. The weights are ``gamma`` (``w``), ``beta`` (``b``) and ``alpha`` (DyT),
    None where the spec has none, stored under the names ``"scale"``, ``"bias"``, ``"alpha"``.
    """

    def __init__(self, spec: NormSpec, param_dtype: str | None = None, **kwargs: Any) -> None:
        # Keras' autocast argument, applied in `call`: Keras' own cast in __call__ (which reads
        # self.autocast) would also round a float32 residual stream to a half compute dtype.
        autocast = bool(kwargs.pop("autocast", True))
        super().__init__(autocast=False, **kwargs)
        self._autocast_inputs = autocast
        self._warned_of_policy = False  # `_warn_of_policy`
        self._spec = spec
        self._param_dtype = None if param_dtype is None else _float_dtype(param_dtype)
        self.supports_masking = True
        self._param_shape: tuple[int, ...] | None = None
        self.gamma: Any = None
        self.beta: Any = None
        self.alpha: Any = None
        self._grouped: Any = None  # the inner norm of gated and grouped specs (`build`)

    @property
    def spec(self) -> NormSpec:
        """The `NormSpec` this layer computes."""
        return self._spec

    @property
    def axis(self) -> int | list[int]:
        """The normalized axes as given: an int, or a list of ints for several."""
        axes = self._spec.axis
        return axes[0] if len(axes) == 1 else list(axes)

    @property
    def epsilon(self) -> float | None:
        """``eps`` (None for DyT, which has no statistic)."""
        return self._spec.eps

    @property
    def param_dtype(self) -> str:
        """The dtype of the variables: ``param_dtype``, or the policy's variable dtype."""
        return self._param_dtype or keras.backend.standardize_dtype(self.variable_dtype)

    def _axes(self, shape: tuple[int | None, ...]) -> tuple[int, ...]:
        try:
            return self._spec.resolve_axes(len(shape))
        except ValueError as err:
            raise ValueError(f"{self.name}: input of shape {shape}: {err}") from None

    def _input_dtype(self, dtype: Any) -> str:
        """The dtype the spec sees: the compute dtype (Keras' autocast), or with
        ``autocast=False`` the input's. TypeError for a non-floating input (Keras' own layers
        compute on integers in integer arithmetic)."""
        dtype = keras.backend.standardize_dtype(dtype)
        if not keras.backend.is_float_dtype(dtype):
            raise TypeError(
                f"{self.name}: the input has dtype {dtype}; {type(self).__name__} needs a "
                "floating input (float16, bfloat16, float32 or float64)"
            )
        seen = self.compute_dtype if self._autocast_inputs else dtype
        if dtype in _HALF and seen != dtype and not self._warned_of_policy:
            self._warn_of_policy(dtype, seen)
        return seen

    def _warn_of_policy(self, dtype: str, seen: str) -> None:
        """Warn (once per layer) where the policy casts a half input to another dtype and the
        spec has steps that act on half inputs: they then act on ``seen`` values, and the layer
        no longer computes what the reference and the other adapters compute for ``dtype``."""
        spec = self._spec
        steps = [f"cast={spec.cast!r}"] * (spec.cast == "before_scale")
        steps += [f"backward={spec.backward!r}"] * (spec.backward == "autograd")
        steps += [f"residual={spec.residual!r}"] * (spec.residual in ("rounded",
                                                                      "float32_normalized"))
        if not steps:
            return
        self._warned_of_policy = True
        policy = f"mixed_{dtype}" if self.param_dtype == "float32" else dtype
        warnings.warn(
            f"{self.name}: a {dtype} input is cast to {seen} by the dtype policy "
            f"{self.dtype_policy.name!r} (Keras' autocast), so the spec's half-precision steps "
            f"({', '.join(steps)}) act on {seen} values, not on the {dtype} ones "
            f"normkit.reference, normkit.torch and normkit.jax take them on: y is {seen} and "
            f"differs from theirs by about an ulp of {dtype}. To compute the spec on {dtype} "
            f"inputs, build the layer with dtype={policy!r} (or autocast=False).",
            UserWarning,
            stacklevel=2,
        )

    def _present(self) -> list[str]:
        """The names of the variables the spec has, in the order `build` creates them."""
        spec = self._spec
        names = ["alpha"] if spec.kind == "dyt" else []
        return names + ["scale"] * spec.scale + ["bias"] * bool(spec.bias)

    def _output_dtype(self, dtype: str) -> str:
        """The output dtype for inputs the spec sees as ``dtype`` (see `_input_dtype`)."""
        if self._spec.output_dtype == "input":
            return dtype
        return _promoted(dtype, *[self.param_dtype] * len(self._present()))

    def _h_dtype(self, dtype: str) -> str:
        """The dtype of ``h``: the compute dtype with ``residual="float32"``, else ``dtype``."""
        if self._spec.residual != "float32":
            return dtype
        return "float64" if dtype == "float64" else "float32"

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        shape = tuple(input_shape)
        axes = self._axes(shape)
        param_shape = tuple(shape[a] for a in axes)
        if any(d is None for d in param_shape):
            raise ValueError(
                f"{self.name}: the normalized axes {axes} of input shape {shape} must have known "
                "sizes to create the weights"
            )
        self._param_shape = param_shape
        if self._spec.gate is not None or self._spec.group_size is not None:
            self._spec.group_count(math.prod(param_shape))
            # Each group's statistic, with this layer's guards and exact gradient.
            self._grouped = from_spec(_gating.group_spec(self._spec), autocast=False)
        dtype = self.param_dtype
        if self._spec.kind == "dyt":
            self.alpha = self.add_weight(
                name="alpha",
                shape=(1,),
                initializer=keras.initializers.Constant(self._spec.alpha_init),
                dtype=dtype,
                autocast=False,
            )
        if self._spec.scale:
            self.gamma = self.add_weight(
                name="scale",
                shape=param_shape,
                dtype=dtype,
                autocast=False,
                **self._weight_options("scale"),
            )
        if self._spec.bias:
            self.beta = self.add_weight(
                name="bias",
                shape=param_shape,
                dtype=dtype,
                autocast=False,
                **self._weight_options("bias"),
            )

    def _weight_options(self, name: str) -> dict[str, Any]:
        """The initializer (and regularizer, constraint) of the weight ``name``: ``w`` starts
        at ``1 - scale_offset`` (the effective scale at one), ``b`` at zero."""
        if name == "scale":
            return {"initializer": keras.initializers.Constant(self._spec.scale_init)}
        return {"initializer": "zeros"}

    def _broadcast_shape(self, shape: tuple[int | None, ...]) -> tuple[tuple[int, ...], list[int]]:
        """The normalized axes of ``shape``, checked against the built sizes, and the shape that
        broadcasts a parameter over the input (1 on the other axes)."""
        axes = self._axes(shape)
        assert self._param_shape is not None
        for a, size in zip(axes, self._param_shape, strict=True):
            if shape[a] is not None and shape[a] != size:
                raise ValueError(
                    f"{self.name}: axis {a} of the input (shape {shape}) has size {shape[a]}, but "
                    f"the layer was built for size {size} there (normalized sizes "
                    f"{self._param_shape} over axis {self._spec.axis})"
                )
        target = [1] * len(shape)
        for a, size in zip(axes, self._param_shape, strict=True):
            target[a] = size
        return axes, target

    def _residual_dtype(self, shape: tuple[Any, ...], residual: Any, dtype: str) -> str | None:
        """Check the call's residual against the spec; the dtype to add it in (None: none).

        A floating residual is autocast to the compute dtype, as the input is, except one in
        ``h``'s dtype with ``residual="float32"`` (a float32 residual stream next to half inputs).
        """
        spec = self._spec
        if spec.residual is None:
            if residual is not None:
                raise ValueError(
                    f"{self.name}: a residual was passed, but the layer's spec has residual=None; "
                    "build it with residual='rounded', 'float32' or 'float32_normalized' to add "
                    "one"
                )
            return None
        if residual is None:
            raise ValueError(
                f"{self.name}: the spec has residual={spec.residual!r}; call the layer as "
                "layer(x, residual), which returns (y, h)"
            )
        if tuple(residual.shape) != shape:
            raise ValueError(
                f"{self.name}: the residual has shape {tuple(residual.shape)}, expected the "
                f"input's shape {shape}"
            )
        found = keras.backend.standardize_dtype(residual.dtype)
        stream = self._h_dtype(dtype)
        allowed = {dtype, stream}
        if found in allowed:
            return found
        if self._autocast_inputs and keras.backend.is_float_dtype(found):
            return dtype
        names = " or ".join(sorted(allowed))
        raise TypeError(
            f"{self.name}: the residual has dtype {found}; residual={spec.residual!r} with an "
            f"input of dtype {dtype} needs {names}"
        )

    def call(self, inputs: Any, residual: Any = None, gate: Any = None) -> Any:
        """The spec applied to ``inputs`` (a floating tensor), in the output dtype above; with a
        residual spec, ``(y, h)`` for ``h = inputs + residual``; with a gated spec, the gated
        norm of ``inputs`` and ``gate`` (``layer(x, gate=z)``)."""
        kernels = self._pallas_kernels(inputs, residual, gate)
        return self._call_ops(inputs, residual, gate) if kernels is None else kernels

    def _pallas_kernels(self, inputs: Any, residual: Any, gate: Any) -> Any:
        """On Keras' JAX backend under ``jax.jit``, with normkit's Pallas kernels selected
        (``NORMKIT_JAX_KERNELS=pallas``, docs/jax.md) and computing the call: the kernels on
        NVIDIA GPUs, `_call_ops`' program on every other platform, chosen when the program is
        lowered (`jax.lax.platform_dependent`). None otherwise."""
        if keras.backend.backend() != "jax" or not traced_for_xla(inputs):
            return None
        from jax import lax

        from normkit import _pallas

        if not _pallas.selected(None):
            return None
        dtype = self._input_dtype(inputs.dtype)
        self._spec.check_eps(dtype)
        added = self._residual_dtype(tuple(inputs.shape), residual, dtype)
        self._check_gate(tuple(inputs.shape), gate)
        x = ops.cast(inputs, dtype)
        second = None if added is None else ops.cast(residual, added)
        weights = [None if w is None else ops.convert_to_tensor(w)
                   for w in (self.gamma, self.beta, self.alpha)]
        axes = self._axes(tuple(x.shape))
        arrays = [second, gate, *weights]
        if not _pallas.supports(x, self._spec, axes, arrays):
            return None

        def on_gpu(x: Any, second: Any, gate: Any, scale: Any, bias: Any, alpha: Any) -> Any:
            return _pallas.run(x, second, self._spec, scale, bias, gate, alpha,
                               self._output_dtype(dtype), interpret=_pallas.interpreting())

        if _pallas.interpreting():
            return on_gpu(x, *arrays)
        return lax.platform_dependent(x, *arrays, cuda=on_gpu,
                                      default=lambda *_: self._call_ops(inputs, residual, gate))

    def _call_ops(self, inputs: Any, residual: Any, gate: Any) -> Any:
        """`call` by the backend's operations (see the module docstring)."""
        spec = self._spec
        dtype = self._input_dtype(inputs.dtype)
        spec.check_eps(dtype)
        shape = tuple(inputs.shape)
        added = self._residual_dtype(shape, residual, dtype)
        work = "float64" if dtype == "float64" else "float32"
        x = _cast_to(inputs, dtype, work)
        self._check_gate(shape, gate)
        if spec.gate is not None or spec.group_size is not None:
            if added is not None:
                raise ValueError(
                    f"{self.name}: normkit.tf does not compute a residual with "
                    f"group_size={spec.group_size} (normkit.torch does); add the residual first"
                )
            scale = None if self.gamma is None else self._effective_scale(work, None)
            bias = None if self.beta is None else self._param(self.beta, work, None)
            return _gated.gated_or_grouped(
                x, gate, spec, dtype, work, scale, bias, self._affine_dtype(dtype),
                self._output_dtype(dtype), self._grouped, gate is not None and recording(gate),
            )
        if added is None:
            exact = keras.backend.standardize_dtype(inputs.dtype) == dtype
            return self._normalize(x, dtype, work, inputs if exact else x)
        total = _cast_to(residual, added, work) + x
        h = total if spec.residual == "float32" else ops.cast(total, dtype)
        normalized = total
        if spec.residual == "rounded" and spec.backward == "autograd":
            # The eager program: the norm reads the rounded h, so its cotangent is rounded to the
            # input dtype before dh is added (the sum is then rounded once, at x's cast).
            normalized = rounded(total, dtype)
        elif spec.residual == "rounded":
            # The rounded h's value; the gradient reaches the sum unrounded: dx = dh + dnorm.
            normalized = total + ops.stop_gradient(rounded(total, dtype) - total)
        return self._normalize(normalized, dtype, work, normalized), h

    def _check_gate(self, shape: tuple[Any, ...], gate: Any) -> None:
        """A gate exactly when the spec has one: a floating tensor of the input's shape."""
        if self._spec.gate is None:
            if gate is not None:
                raise ValueError(
                    f"{self.name}: a gate was given but the spec has gate=None; build the layer "
                    "with gate='before' or 'after' to gate the norm"
                )
            return
        if gate is None:
            raise ValueError(
                f"{self.name} has gate={self._spec.gate!r}: call it with the gate, "
                "layer(x, gate=z)"
            )
        name = keras.backend.standardize_dtype(gate.dtype)
        if not keras.backend.is_float_dtype(name):
            raise TypeError(f"{self.name}: the gate has dtype {name}; it must be floating")
        if tuple(gate.shape) != shape:
            raise ValueError(f"{self.name}: the gate has shape {tuple(gate.shape)}, x has {shape}")

    def _normalize(self, x: Any, dtype: str, work: str, source: Any) -> Any:
        """The spec on ``x`` (in the ``work`` dtype) with the dtype policy of ``dtype`` inputs;
        ``x`` is ``source`` cast to ``work`` (the branches cast it themselves, so that under XLA
        a half input crosses into them as it is, not as a float32 copy).

        The forward value rounds as the spec says (the fast variance, the before-scale cast);
        the gradient is that of the exact function (`normkit.reference`), or with
        ``backward="autograd"`` that of the eager program in the half dtype (`_eager_affine`).
        """
        spec = self._spec
        axes, target = self._broadcast_shape(tuple(x.shape))
        # Parameters broadcast as they are over trailing axes; elsewhere they are reshaped.
        param_target = None if axes[0] == len(target) - len(axes) else target
        output_dtype = self._output_dtype(dtype)

        def finish(x: Any, y_hat: Any) -> Any:
            return ops.cast(self._finish(x, y_hat, axes, dtype, param_target, work), output_dtype)

        if spec.kind == "dyt":
            alpha = ops.cast(self.alpha, work)
            return finish(x, dyt(alpha, x, recording(x, alpha)))
        affine = None
        if spec.variance != "fast" and not (spec.cast == "before_scale" and dtype in _HALF):
            # y = y_hat g + b: the plain rows compute it, and its gradient, in one function.
            scale = None if self.gamma is None else self._effective_scale(work, param_target)
            bias = None if self.beta is None else self._param(self.beta, work, param_target)
            affine = (scale, bias)
        return self._normalized(x, source, axes, target, work, finish, affine, output_dtype)

    def _finish(
        self,
        x: Any,
        y_hat: Any,
        axes: tuple[int, ...],
        dtype: str,
        param_target: list[int] | None,
        work: str,
    ) -> Any:
        """``y`` from ``y_hat`` in the ``work`` dtype: the fast variance's value, the
        before-scale rounding and the affine step, with the gradients `_normalize` states."""
        spec = self._spec
        value = y_hat
        if spec.kind != "dyt" and spec.variance == "fast":
            value = fast_normalized(spec, x, axes)
        before_scale = spec.cast == "before_scale" and dtype in _HALF
        if before_scale:
            value = rounded(value, dtype)
        if before_scale and spec.backward == "autograd":
            path, acc = self._eager_affine(y_hat, dtype, param_target, work)
            affine = ops.cast(self._affine(value, param_target, work), acc)
            return path + ops.stop_gradient(affine - path)
        y = self._affine(y_hat, param_target, work)
        if value is y_hat:
            return y
        # The rounded value forward; the exact function's gradient backward.
        return y + ops.stop_gradient(self._affine(value, param_target, work) - y)

    def _normalized(
        self,
        x: Any,
        source: Any,
        axes: tuple[int, ...],
        target: list[int],
        work: str,
        finish: Callable[[Any, Any], Any],
        affine: tuple[Any, Any] | None,
        output_dtype: str,
    ) -> Any:
        """``finish(x, y_hat)`` for a normalization kind, with exact gradients.

        The plain program (`_plain.plain_output`, with the affine step ``affine = (g, b)`` when
        ``finish`` is only that step and the cast to ``output_dtype``) stands unless a row's own
        ``s`` or ``r`` shows it inaccurate; then the guarded program (`_careful.guarded`)
        recomputes the input, in a branch the common case skips. Rows whose statistic reads one
        element (or LayerNorm's two) always take the guarded program.
        """
        rows = self._rows(x, axes, target, work)
        guarded = _guarded_program(rows, finish, affine, output_dtype)
        params = [] if affine is None else [p for p in affine if p is not None]
        if _careful.one_element(rows):
            return guarded(source, *params)
        stats, known = _plain.statistics(rows, x, eagerly(x), source)
        row_stats = [u for u in stats if u is not None]
        # Autodiff of Keras' RMSNorm reaches x through r as well: both paths must meet in the
        # work dtype, before the input's cast rounds their sum once. Traced, the value is cast
        # from the source inside the branch and only its gradient goes to x.
        meets_at_x = rows.keras_order and source is not x
        plain = _plain_program(rows, stats, known is None, meets_at_x, finish, affine,
                               output_dtype)
        inputs = (source, x) if meets_at_x else (source,)
        if known is None:
            # The whole output inside the branches: XLA then writes y once, in the fused pass.
            # With the affine step both branches recompute their values in the backward pass:
            # a traced cond outputs every intermediate either branch's gradient reads (the plain
            # branch's x r for the scale's gradient, whole tensors), where XLA would fuse their
            # recomputation into the backward's passes.
            # Keras' order is not recomputed: a recomputed plain branch differentiates x
            # through the statistics passed in, another order of the same sums.
            recompute = (lambda f: f) if affine is None else recomputed
            guarded_branch = recompute(guarded)
            plain_branch = plain if rows.keras_order else recompute(plain)
            return ops.cond(
                ops.any(stats[-1]),
                lambda: guarded_branch(source, *params),
                lambda: plain_branch(*inputs, *row_stats, *params),
            )
        # Eagerly x is already in the work dtype: the branches' own casts would be passes more.
        if known:
            return guarded(x, *params)
        return plain(*(x for _ in inputs), *row_stats, *params)

    def _rows(self, x: Any, axes: tuple[int, ...], target: list[int], work: str) -> Rows:
        """The rows of ``x``: ``n`` normalized elements, of which the statistic reads the first
        ``k`` (marked, where k < n, by a boolean mask in row-major order)."""
        n = int(np.prod(self._param_shape))
        k = self._spec.stat_size(n)
        head = None if k == n else (np.arange(n) < k).reshape(target)
        # Keras' autodiff order makes training bit-identical to Keras' RMSNormalization, in
        # eager calls and graphs. Not where XLA compiles: its fusions decide the bits there,
        # and a branch differentiated in place outputs its intermediates for the backward.
        return Rows(self._spec, axes, target, n, k, head, work, keras_order=not traced_for_xla(x))

    def _param(self, v: Any, dtype: str, target: list[int] | None) -> Any:
        v = ops.cast(v, dtype)
        return v if target is None else ops.reshape(v, target)

    def _effective_scale(self, dtype: str, target: list[int] | None) -> Any:
        """``scale_offset + w`` in ``dtype``: added there (``offset_dtype="float32"``), or in
        ``w``'s own dtype and rounded there (``"param"``)."""
        offset = self._spec.scale_offset
        if offset and self._spec.offset_dtype == "param":
            # The sum formed in float32 (float64 for float64 weights), rounded once to w's dtype.
            wide = _promoted("float32", self.param_dtype)
            return self._param(rounded(ops.cast(self.gamma, wide) + offset, self.param_dtype),
                               dtype, target)
        g = self._param(self.gamma, dtype, target)
        return g + offset if offset else g

    def _affine(self, y: Any, target: list[int] | None, work: str) -> Any:
        """``y * (scale_offset + w) + b`` in the ``work`` dtype; the weights reshaped to
        ``target`` unless it is None."""
        if self.gamma is not None:
            y = y * self._effective_scale(work, target)
        if self.beta is not None:
            y = y + self._param(self.beta, work, target)
        return y

    def _affine_dtype(self, dtype: str) -> str:
        """The dtype of the eager program's affine step (`normkit.reference`): the input's
        promoted with the effective scale's (``w``'s, or at least float32 when the offset is
        added there) and the bias's."""
        kinds = []
        if self.gamma is not None:
            own = self._spec.offset_dtype == "param" or not self._spec.scale_offset
            kinds.append(self.param_dtype if own else _promoted("float32", self.param_dtype))
        if self.beta is not None:
            kinds.append(self.param_dtype)
        return _promoted(dtype, *kinds)

    def _eager_affine(
        self, y_hat: Any, dtype: str, target: list[int] | None, work: str
    ) -> tuple[Any, str]:
        """``backward="autograd"``: the affine step with the gradient of the eager program, and
        the dtype ``acc`` it is computed in (``work``, or float64 for a float64 affine step).

        The eager program rounds ``z = y_hat`` to ``dtype`` and computes ``z * g + b`` in the
        affine dtype ``a``, so autodiff rounds the products ``dy * g`` (then to ``dtype`` at
        the cast) and ``dy * z`` to ``a``. Here every product is formed in ``acc`` and rounded
        with `rounded`, whose gradient rounds the cotangent the same way: XLA may keep
        half-precision arithmetic in float32, but it keeps that rounding.
        The parameters' gradients are summed in ``acc`` and rounded once to their dtype.
        """
        a = self._affine_dtype(dtype)
        acc = "float64" if a == "float64" else work
        y_hat = ops.cast(y_hat, acc)
        ones = ops.ones_like(y_hat)
        y = rounded(rounded(y_hat, dtype), a)
        if self.gamma is not None:
            y = y * rounded(ones * self._effective_scale(acc, target), a)
        if self.beta is not None:
            y = y + rounded(ones * self._param(self.beta, acc, target), a)
        # The incoming cotangent is rounded to a, as the cast from a to the output dtype does.
        return rounded(y, a), acc

    def compute_output_spec(self, inputs: Any, residual: Any = None, gate: Any = None) -> Any:
        dtype = self._input_dtype(inputs.dtype)
        self._spec.check_eps(dtype)
        shape = tuple(inputs.shape)
        if self.built:
            self._broadcast_shape(shape)
        else:
            self._axes(shape)
        y = keras.KerasTensor(shape, dtype=self._output_dtype(dtype))
        if self._residual_dtype(shape, residual, dtype) is None:
            return y
        return y, keras.KerasTensor(shape, dtype=self._h_dtype(dtype))

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> Any:
        """The input's shape (for ``y``, and for ``h`` with a residual); ValueError naming the
        axis when one is out of range for the input's rank."""
        shape = tuple(input_shape)
        self._axes(shape)
        return shape if self._spec.residual is None else (shape, shape)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        """The input's mask, passed through (to ``y`` and ``h`` with a residual)."""
        return mask if self._spec.residual is None else (mask, mask)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            **_spec_kwargs(self._spec),
            "param_dtype": self._param_dtype,
            "autocast": self._autocast_inputs,
        }


def _guarded_program(
    rows: Rows,
    finish: Callable[[Any, Any], Any],
    affine: tuple[Any, Any] | None,
    output_dtype: str,
) -> Callable[..., Any]:
    """The guarded program's ``y`` from the input and the parameters present:
    ``finish(x, y_hat)``, or with ``affine`` its step and the cast to ``output_dtype``."""

    def guarded(source: Any, *params: Any) -> Any:
        x = ops.cast(source, rows.work)
        y_hat = _careful.guarded(rows, x)
        if affine is None:
            return finish(x, y_hat)
        return ops.cast(affine_step(y_hat, affine, params), output_dtype)

    return guarded


def _plain_program(
    rows: Rows,
    stats: tuple[Any, ...],
    traced: bool,
    meets_at_x: bool,
    finish: Callable[[Any, Any], Any],
    affine: tuple[Any, Any] | None,
    output_dtype: str,
) -> Callable[..., Any]:
    """The plain program's ``y`` from the input (and ``x`` where the gradient meets there,
    ``meets_at_x``), `_plain.statistics`' row statistics present in ``stats`` and the
    parameters present, all as arguments so that it may be recomputed: ``finish(x, y_hat)``, or
    with ``affine`` its step and the cast to ``output_dtype`` inside `_plain.plain_output`."""

    def plain(source: Any, *args: Any) -> Any:
        given = iter(args)
        x_work = ops.cast(source, rows.work)
        if meets_at_x:
            x = next(given)
            x_work = gradient_to(x_work, x) if traced else x
        row = tuple(None if u is None else next(given) for u in stats)
        if affine is None:
            return finish(x_work, _plain.plain_output(rows, x_work, row, traced))
        step = tuple(None if p is None else next(given) for p in affine)
        # The plain rows cast the source themselves (unless the gradient meets at x).
        plain_source = x_work if meets_at_x else source
        return _plain.plain_output(
            rows, plain_source, row, traced, step[0], step[1], output_dtype
        )

    return plain


def _cast_to(u: Any, dtype: str, work: str) -> Any:
    """``u`` cast to ``dtype`` (the policy's cast), then to ``work``; where that rounds, the
    rounding is kept under XLA (`rounded`)."""
    cast = ops.cast(ops.cast(u, dtype), work)
    return cast if keras.backend.standardize_dtype(u.dtype) == dtype else rounded(cast, dtype)


def _float_dtype(dtype: Any) -> str:
    """``dtype`` standardized by Keras, or TypeError unless it is a float normkit supports."""
    name = keras.backend.standardize_dtype(dtype)
    if name not in dtypes.DTYPE_NAMES:
        raise TypeError(
            f"param_dtype={name!r} is invalid: expected one of {sorted(dtypes.DTYPE_NAMES)}"
        )
    return name


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# The type each NormSpec field takes from a layer's constructor (None where the spec resolves a
# default), and its description; a value of the right type is checked by NormSpec.
_FIELD_TYPES: dict[str, tuple[Any, str]] = {
    "axis": (
        lambda v: _is_int(v) or (isinstance(v, (list, tuple)) and all(map(_is_int, v))),
        "an int or a list/tuple of ints",
    ),
    "eps": (lambda v: v is None or _is_real(v), "a float"),
    "p": (_is_real, "a float"),
    "scale_offset": (_is_real, "a float"),
    "alpha_init": (_is_real, "a float"),
    "scale": (lambda v: isinstance(v, bool), "True or False"),
    "bias": (lambda v: v is None or isinstance(v, bool), "True or False"),
    "residual": (lambda v: v is None or isinstance(v, str), "None or a string"),
    **{
        name: (lambda v: isinstance(v, str), "a string")
        for name in ("eps_placement", "cast", "variance", "offset_dtype", "output_dtype",
                     "backward")
    },
}


def _layer_spec(layer: str, **fields: Any) -> NormSpec:
    """``NormSpec(**fields)`` for the constructor of ``layer``: TypeError naming the argument
    whose value has the wrong type, as Keras' layers raise (``epsilon`` for ``eps``, and
    ``center`` for LayerNorm's ``bias``); NormSpec's ValueError for a wrong value."""
    arguments = {"eps": "epsilon", "bias": "center" if fields["kind"] == "layer" else "bias"}
    for field, value in fields.items():
        if field in _FIELD_TYPES and not _FIELD_TYPES[field][0](value):
            raise TypeError(
                f"{layer}: expected {_FIELD_TYPES[field][1]} for the argument "
                f"'{arguments.get(field, field)}', but received {value!r} of type "
                f"{type(value).__name__}"
            )
    return NormSpec(**fields)


def _spec_kwargs(spec: NormSpec) -> dict[str, Any]:
    """The constructor arguments (JSON-compatible) of the layer that computes ``spec``."""
    kwargs: dict[str, Any] = {"axis": spec.axis[0] if len(spec.axis) == 1 else list(spec.axis)}
    if spec.kind == "dyt":
        kwargs["alpha_init"] = spec.alpha_init
    else:
        kwargs["epsilon"] = spec.eps
        kwargs["eps_placement"] = spec.eps_placement
    # LayerNorm names b's switch as Keras' LayerNormalization does: center.
    kwargs["center" if spec.kind == "layer" else "bias"] = spec.bias
    kwargs.update(
        scale=spec.scale,
        scale_offset=spec.scale_offset,
        cast=spec.cast,
        residual=spec.residual,
        offset_dtype=spec.offset_dtype,
        output_dtype=spec.output_dtype,
        backward=spec.backward,
    )
    if spec.kind == "partial_rms":
        kwargs["p"] = spec.p
    if spec.kind == "layer":
        kwargs["variance"] = spec.variance
    for name in ("gate", "gate_activation", "group_size"):
        if getattr(spec, name) is not None:
            kwargs[name] = getattr(spec, name)
    return kwargs


class RMSOptions(TypedDict, total=False):
    """The keyword arguments of `PartialRMSNorm`: `RMSNorm`'s keyword-only ones, and
    `keras.layers.Layer`'s."""

    eps_placement: EpsPlacement
    scale: bool
    scale_offset: float
    bias: bool
    cast: Cast
    residual: Residual | None
    offset_dtype: OffsetDtype
    output_dtype: OutputDtype
    backward: Backward
    gate: Gate | None
    gate_activation: GateActivation | None
    group_size: int | None
    param_dtype: str | None
    name: str | None
    dtype: Any
    trainable: bool
    autocast: bool


# The spec fields among `RMSOptions`; the others go to `keras.layers.Layer`.
_RMS_FIELDS = (
    "eps_placement", "scale", "scale_offset", "bias", "cast", "residual", "offset_dtype",
    "output_dtype", "backward", "gate", "gate_activation", "group_size",
)


class _ScaleBias(_Norm):
    """The weights under the names of the constructor's switches: ``scale`` (``w``, as
    ``keras.layers.RMSNormalization``'s) and ``bias`` (``b``)."""

    @property
    def scale(self) -> Any:
        """``w``, the weight ``"scale"`` (None before `build` or with ``scale=False``)."""
        return self.gamma

    @property
    def bias(self) -> Any:
        """``b``, the weight ``"bias"`` (None before `build` or with ``bias=False``)."""
        return self.beta


@keras.saving.register_keras_serializable(package="normkit")
class RMSNorm(_ScaleBias):
    """RMSNorm over ``axis``: ``y = x * r(mean(x**2)) * (scale_offset + w) + b``.

    A drop-in for ``keras.layers.RMSNormalization``: the same arguments (``axis=-1,
    epsilon=1e-6``), the attributes ``axis`` and ``epsilon``, and the weight ``scale`` (``w``;
    also ``gamma``, the name every normkit.tf layer gives it; ``b`` is ``bias`` and ``beta``).

    Statistics in float32; the output dtype follows the policy and ``output_dtype`` (see
    docs/tf.md).

    Args:
      axis: the normalized axes, an int or a list of ints (negative count from the end).
        Default ``-1``. Their sizes are fixed by the first call.
      epsilon: ``eps``, positive. Default ``1e-6``, as ``keras.layers.RMSNormalization``.
      eps_placement: ``"inside"``: ``r(s) = 1 / sqrt(s + eps)`` (default); ``"outside"``:
        ``r(s) = 1 / (sqrt(s) + eps)``.
      bias: whether there is a weight ``b`` ("bias", zeros). Default ``False``.
      scale: whether there is a weight ``w`` ("scale", the input's shape over ``axis``,
        initialized to ``1 - scale_offset``). Default ``True``.
      scale_offset: the constant added to ``w``; ``1.0`` is Gemma's ``(1 + w)``. Default ``0.0``.
      cast: for float16/bfloat16 inputs, ``"after_scale"`` rounds once at the end (default);
        ``"before_scale"`` rounds ``y_hat`` to the input dtype before the affine step (Llama).
      residual: None (default), or how ``h = x + residual`` is rounded (``"rounded"``,
        ``"float32"``, ``"float32_normalized"``); the layer is then called as
        ``layer(x, residual)`` and returns ``(y, h)``.
      offset_dtype: where ``scale_offset + w`` is computed: ``"float32"`` (default) or
        ``"param"`` (in ``w``'s dtype, then upcast).
      output_dtype: ``"input"`` (default) or ``"promote"``, the promoted dtype of the input
        (after the policy's cast) and the variables.
      backward: ``"exact"`` (default): the gradient of the exact function, rounded once;
        ``"autograd"``: that of the eager program in half precision (Hugging Face Llama).
      gate, gate_activation, group_size: the `NormSpec` fields of the gated and grouped norms
        (default None: no gate, the whole row); a gated layer is called as ``layer(x, gate=z)``.
      param_dtype: the variables' dtype; None (default) takes the policy's variable dtype.
      **kwargs: `keras.layers.Layer` arguments: ``name``, ``dtype`` (policy), ``trainable``,
        ``autocast`` (``False`` keeps a floating input's dtype instead of casting it to the
        policy's compute dtype).

    Examples:
      >>> import numpy as np
      >>> layer = RMSNorm()
      >>> y = layer(np.array([[3.0, 4.0]], dtype="float32"))  # [3, 4] / sqrt(12.5)
      >>> [round(float(v), 4) for v in keras.ops.convert_to_numpy(y)[0]]
      [0.8485, 1.1314]
      >>> [tuple(w.shape) for w in layer.get_weights()]
      [(2,)]
    """

    def __init__(
        self,
        axis: int | list[int] | tuple[int, ...] = -1,
        epsilon: float = RMS_NORM_EPSILON,
        *,
        eps_placement: EpsPlacement = "inside",
        scale: bool = True,
        scale_offset: float = 0.0,
        bias: bool = False,
        cast: Cast = "after_scale",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        gate: Gate | None = None,
        gate_activation: GateActivation | None = None,
        group_size: int | None = None,
        param_dtype: str | None = None,
        **kwargs: Any,
    ) -> None:
        spec = _layer_spec(
            type(self).__name__,
            kind="rms", eps=epsilon, eps_placement=eps_placement, axis=axis, scale=scale,
            scale_offset=scale_offset, bias=bias, cast=cast, residual=residual,
            offset_dtype=offset_dtype, output_dtype=output_dtype, backward=backward, gate=gate,
            gate_activation=gate_activation, group_size=group_size,
        )
        super().__init__(spec, param_dtype, **kwargs)


@keras.saving.register_keras_serializable(package="normkit")
class PartialRMSNorm(_ScaleBias):
    """Partial RMSNorm over ``axis``: ``y = x * r(mean(x[:k]**2)) * (scale_offset + w) + b``.

    ``x[:k]`` are the first ``k = max(1, floor(n * p))`` of a row's ``n`` normalized elements, in
    row-major order over ``axis``; ``y`` normalizes and scales all ``n``.

    Statistics in float32; the output dtype follows the policy and ``output_dtype`` (see
    docs/tf.md).

    Args:
      p: the fraction read by the statistic, ``0 < p <= 1``.
      axis, epsilon: as in `RMSNorm`.
      **options: `RMSNorm`'s keyword-only arguments (``eps_placement``, ``bias``, ``scale``,
        ``scale_offset``, ``cast``, ``residual``, ``offset_dtype``, ``output_dtype``,
        ``backward``, ``gate``, ``gate_activation``, ``group_size``, ``param_dtype``) and
        `keras.layers.Layer`'s (`RMSOptions`), with `RMSNorm`'s defaults.
    """

    def __init__(
        self,
        p: float,
        axis: int | list[int] | tuple[int, ...] = -1,
        epsilon: float = DEFAULT_EPS,
        **options: Unpack[RMSOptions],
    ) -> None:
        layer_kwargs: dict[str, Any] = dict(options)
        fields = {name: layer_kwargs.pop(name) for name in _RMS_FIELDS if name in layer_kwargs}
        spec = _layer_spec(
            type(self).__name__, kind="partial_rms", eps=epsilon, p=p, axis=axis, **fields
        )
        super().__init__(spec, layer_kwargs.pop("param_dtype", None), **layer_kwargs)


@keras.saving.register_keras_serializable(package="normkit")
class LayerNorm(_Norm):
    """LayerNorm over ``axis``: ``y = c * r(mean(c**2)) * (scale_offset + w) + b``.

    ``c = x - mean(x)``. A drop-in for ``keras.layers.LayerNormalization``: the same arguments,
    in the same order, with the same defaults (``epsilon=1e-3``), and Keras' attributes
    ``axis``, ``epsilon``, ``center`` and ``scale`` (bools), ``gamma`` (``w``) and ``beta``
    (``b``). ``w`` and ``b`` are stored as the weights ``"scale"`` and ``"bias"``.

    Statistics in float32; the output dtype follows the policy and ``output_dtype`` (see
    docs/tf.md).

    Args:
      axis: the normalized axes, an int or a list of ints (negative count from the end).
        Default ``-1``. Their sizes are fixed by the first call.
      epsilon: ``eps``, positive. Default ``1e-3``, as Keras'.
      center: whether there is a weight ``b`` (Keras' ``beta``). Default ``True``.
      scale: whether there is a weight ``w`` (Keras' ``gamma``). Default ``True``.
      beta_initializer, gamma_initializer: the initializers of ``b`` and ``w``; default
        ``"zeros"`` and ``"ones"``. With a nonzero ``scale_offset`` only ``"ones"`` is
        accepted, and it starts ``w`` at ``1 - scale_offset`` (the effective scale at one).
      beta_regularizer, gamma_regularizer, beta_constraint, gamma_constraint: Keras
        regularizers and constraints of ``b`` and ``w`` (default None).
      rms_scaling: only ``False``; Keras' ``rms_scaling=True`` is refused (it divides by the
        variance, not by the mean square: use `RMSNorm`).
      variance: ``"two_pass"`` (default: ``mean(c**2)``, ``c`` computed first, as Keras'
        LayerNormalization does on TensorFlow and JAX) or ``"fast"`` (``max(0, mean(x**2) -
        mean(x)**2)`` in float32, Flax's default); the gradient is the exact function's either
        way.
      eps_placement, scale_offset, cast, residual, offset_dtype, output_dtype, backward, gate,
        gate_activation, group_size, param_dtype, **kwargs: as in `RMSNorm`.

    Examples:
      >>> import numpy as np
      >>> layer = LayerNorm()
      >>> y = layer(np.array([[1.0, 3.0]], dtype="float32"))  # [-1, 1] / sqrt(1 + 1e-3)
      >>> [round(float(v), 4) for v in keras.ops.convert_to_numpy(y)[0]]
      [-0.9995, 0.9995]
      >>> [tuple(w.shape) for w in (layer.gamma, layer.beta)]
      [(2,), (2,)]
    """

    def __init__(
        self,
        axis: int | list[int] | tuple[int, ...] = -1,
        epsilon: float = LAYER_NORM_EPSILON,
        center: bool = True,
        scale: bool = True,
        beta_initializer: Any = "zeros",
        gamma_initializer: Any = "ones",
        beta_regularizer: Any = None,
        gamma_regularizer: Any = None,
        beta_constraint: Any = None,
        gamma_constraint: Any = None,
        *,
        # The keyword-only options repeat RMSNorm's: each Keras drop-in states its signature.
        rms_scaling: bool = False,
        eps_placement: EpsPlacement = "inside",
        scale_offset: float = 0.0,
        cast: Cast = "after_scale",
        variance: Variance = "two_pass",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        gate: Gate | None = None,
        gate_activation: GateActivation | None = None,
        group_size: int | None = None,
        param_dtype: str | None = None,
        **kwargs: Any,
    ) -> None:
        if rms_scaling:
            raise ValueError(
                "LayerNorm(rms_scaling=True) is refused: Keras' rms_scaling divides x by "
                "sqrt(variance + eps), the variance of x about its mean, not by the root mean "
                "square of x, so it is neither LayerNorm nor RMSNorm (Keras 3.15 deprecates "
                "it); use normkit.tf.RMSNorm, which is keras.layers.RMSNormalization's drop-in"
            )
        spec = _layer_spec(
            type(self).__name__,
            kind="layer", eps=epsilon, eps_placement=eps_placement, axis=axis, scale=scale,
            scale_offset=scale_offset, bias=center, cast=cast, variance=variance,
            residual=residual, offset_dtype=offset_dtype, output_dtype=output_dtype,
            backward=backward, gate=gate, gate_activation=gate_activation,
            group_size=group_size,
        )
        gamma_init = keras.initializers.get(gamma_initializer)
        if scale_offset and not isinstance(gamma_init, keras.initializers.Ones):
            raise ValueError(
                f"LayerNorm: gamma_initializer={gamma_initializer!r} with "
                f"scale_offset={scale_offset}: with an offset only 'ones' is accepted (w then "
                f"starts at 1 - scale_offset, so that scale_offset + w starts at one)"
            )
        super().__init__(spec, param_dtype, **kwargs)
        self.gamma_initializer = gamma_init
        self.beta_initializer = keras.initializers.get(beta_initializer)
        self.gamma_regularizer = keras.regularizers.get(gamma_regularizer)
        self.beta_regularizer = keras.regularizers.get(beta_regularizer)
        self.gamma_constraint = keras.constraints.get(gamma_constraint)
        self.beta_constraint = keras.constraints.get(beta_constraint)

    @property
    def center(self) -> bool:
        """Whether there is a weight ``b`` (``beta``), as Keras' ``center``."""
        return bool(self._spec.bias)

    @property
    def scale(self) -> bool:
        """Whether there is a weight ``w`` (``gamma``), as Keras' ``scale``."""
        return self._spec.scale

    def _weight_options(self, name: str) -> dict[str, Any]:
        if name == "scale":
            initializer = self.gamma_initializer
            if isinstance(initializer, keras.initializers.Ones):
                initializer = keras.initializers.Constant(self._spec.scale_init)
            return {
                "initializer": initializer,
                "regularizer": self.gamma_regularizer,
                "constraint": self.gamma_constraint,
            }
        return {
            "initializer": self.beta_initializer,
            "regularizer": self.beta_regularizer,
            "constraint": self.beta_constraint,
        }

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "rms_scaling": False,
            "beta_initializer": keras.initializers.serialize(self.beta_initializer),
            "gamma_initializer": keras.initializers.serialize(self.gamma_initializer),
            "beta_regularizer": keras.regularizers.serialize(self.beta_regularizer),
            "gamma_regularizer": keras.regularizers.serialize(self.gamma_regularizer),
            "beta_constraint": keras.constraints.serialize(self.beta_constraint),
            "gamma_constraint": keras.constraints.serialize(self.gamma_constraint),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LayerNorm:
        """The layer of ``config``; configs saved before ``center`` name it ``bias``."""
        config = dict(config)
        if "bias" in config:
            config["center"] = config.pop("bias")
        return super().from_config(config)  # type: ignore[no-any-return]


@keras.saving.register_keras_serializable(package="normkit")
class DyT(_ScaleBias):
    """Dynamic Tanh over ``axis``: ``y = tanh(alpha * x) * (scale_offset + w) + b``.

    ``alpha`` is a learned scalar (the weight "alpha", shape ``(1,)``, initialized to
    ``alpha_init``); there is no statistic, so no eps. ``tanh`` is computed in float32 (float64
    for a float64 input); the output dtype follows the policy and ``output_dtype``.

    Args:
      alpha_init: the initial ``alpha``, positive. Default ``0.5`` (the DyT paper's; 1.0 in
        x-transformers).
      axis: the axes ``w`` and ``b`` span, an int or a list of ints. Default ``-1``.
      bias: whether there is a weight ``b`` ("bias", zeros). Default ``True``.
      scale, scale_offset, cast, residual, offset_dtype, output_dtype, backward, param_dtype,
        **kwargs: as in `RMSNorm`.

    Examples:
      >>> import numpy as np
      >>> layer = DyT(alpha_init=1.0, bias=False)
      >>> y = layer(np.array([[0.0, 1.0]], dtype="float32"))  # tanh([0, 1])
      >>> [round(float(v), 4) for v in keras.ops.convert_to_numpy(y)[0]]
      [0.0, 0.7616]
      >>> [w.name for w in layer.weights]
      ['alpha', 'scale']
    """

    def __init__(
        self,
        alpha_init: float = DEFAULT_ALPHA_INIT,
        axis: int | list[int] | tuple[int, ...] = -1,
        *,
        scale: bool = True,
        scale_offset: float = 0.0,
        bias: bool = True,
        cast: Cast = "after_scale",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        param_dtype: str | None = None,
        **kwargs: Any,
    ) -> None:
        spec = _layer_spec(
            type(self).__name__,
            kind="dyt", alpha_init=alpha_init, axis=axis, scale=scale, scale_offset=scale_offset,
            bias=bias, cast=cast, residual=residual, offset_dtype=offset_dtype,
            output_dtype=output_dtype, backward=backward,
        )
        super().__init__(spec, param_dtype, **kwargs)


_LAYERS: dict[str, type[_Norm]] = {
    "rms": RMSNorm,
    "partial_rms": PartialRMSNorm,
    "layer": LayerNorm,
    "dyt": DyT,
}


def from_spec(spec: NormSpec, **kwargs: Any) -> RMSNorm | PartialRMSNorm | LayerNorm | DyT:
    """The layer that computes ``spec``; ``kwargs`` go to the layer (``param_dtype``) and to
    `keras.layers.Layer` (``name``, ``dtype``)."""
    if not isinstance(spec, NormSpec):
        raise TypeError(f"from_spec needs a normkit.NormSpec, got {type(spec).__name__}")
    return _LAYERS[spec.kind](**_spec_kwargs(spec), **kwargs)  # type: ignore[return-value]
