"""`NormSpec`: the single description of a normalization layer.

Every adapter (torch, Keras, Flax) and every conformance check reads its semantics from a
`NormSpec`; `normkit.reference` computes what it means.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, TypeAlias

Kind: TypeAlias = Literal["rms", "partial_rms", "layer", "dyt"]
EpsPlacement: TypeAlias = Literal["inside", "outside"]
Cast: TypeAlias = Literal["after_scale", "before_scale"]
Residual: TypeAlias = Literal["rounded", "float32", "float32_normalized"]
Variance: TypeAlias = Literal["two_pass", "fast"]
OffsetDtype: TypeAlias = Literal["float32", "param"]
OutputDtype: TypeAlias = Literal["input", "promote"]
Backward: TypeAlias = Literal["exact", "autograd"]
Gate: TypeAlias = Literal["before", "after"]
GateActivation: TypeAlias = Literal["silu", "sigmoid"]

# The normalization kinds (a statistic, eps, an eps placement); every adapter implements them.
KINDS: tuple[Kind, ...] = ("rms", "partial_rms", "layer")
# Every kind a spec may name: the normalization kinds and DyT, which has no statistic.
ALL_KINDS: tuple[Kind, ...] = (*KINDS, "dyt")
EPS_PLACEMENTS: tuple[EpsPlacement, ...] = ("inside", "outside")
CASTS: tuple[Cast, ...] = ("after_scale", "before_scale")
RESIDUALS: tuple[Residual, ...] = ("rounded", "float32", "float32_normalized")
VARIANCES: tuple[Variance, ...] = ("two_pass", "fast")
OFFSET_DTYPES: tuple[OffsetDtype, ...] = ("float32", "param")
OUTPUT_DTYPES: tuple[OutputDtype, ...] = ("input", "promote")
BACKWARDS: tuple[Backward, ...] = ("exact", "autograd")
GATES: tuple[Gate, ...] = ("before", "after")
GATE_ACTIVATIONS: tuple[GateActivation, ...] = ("silu", "sigmoid")
# The kinds whose statistic may be taken per group of features (`NormSpec.group_size`).
GROUPABLE_KINDS: tuple[Kind, ...] = ("rms", "layer")

DEFAULT_EPS = 1e-6
DEFAULT_ALPHA_INIT = 0.5

# The fields that extend the original spec, with the value that leaves a spec as it was before
# them; with kind="dyt", what `NormSpec.require_defaults` lets an implementation refuse.
EXTENDED_DEFAULTS: dict[str, object] = {
    "residual": None,
    "variance": "two_pass",
    "offset_dtype": "float32",
    "output_dtype": "input",
    "backward": "exact",
    "gate": None,
    "gate_activation": None,
    "group_size": None,
}

# The eps each compute dtype carries without loss: from its smallest normal number (a smaller
# eps is rounded, or flushed to zero, and 1/eps can overflow) to its largest finite one.
EPS_RANGE: dict[str, tuple[float, float]] = {
    "float32": (2.0**-126, 3.4028234663852886e38),
    "float64": (2.0**-1022, 1.7976931348623157e308),
}


def _invalid(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"NormSpec.{field}={value!r} is invalid: {allowed}")


def _real(field: str, value: object, allowed: str) -> float:
    """``value`` (a Python or numpy real number, not a bool) as a float, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _invalid(field, value, allowed)
    try:
        return float(value)
    except OverflowError:
        raise _invalid(field, value, f"{allowed} (it is beyond the float range)") from None


@dataclass(frozen=True)
class NormSpec:
    r"""What a normalization layer computes, independent of any framework.

    For each row ``x`` (the ``n`` elements of the input over ``axis``, in row-major order)::

        rms:          s = mean(x ** 2)                 y_hat = x * r(s)
        partial_rms:  s = mean(x[:k] ** 2)             y_hat = x * r(s)    k = max(1, floor(n * p))
        layer:        s = mean((x - mean(x)) ** 2)     y_hat = (x - mean(x)) * r(s)
        dyt:          (no statistic)                   y_hat = tanh(alpha * x)

        r(s) = 1 / sqrt(s + eps)        eps_placement="inside"
        r(s) = 1 / (sqrt(s) + eps)      eps_placement="outside"

        y = y_hat * (scale_offset + w) + b

    With ``group_size`` the row is cut into groups of ``group_size`` consecutive elements and
    each group is normalized with its own statistic (LayerNorm: its own mean); ``w`` and ``b``
    still span the whole row. A gated spec has a second input ``z`` of ``x``'s shape
    (`normkit.reference.gated_normalize`) and its activation ``a(z)``, ``silu(z) = z
    sigmoid(z)`` or ``sigmoid(z)``::

        gate="before":  y = norm(x * a(z))        the statistic reads the gated values
        gate="after":   y = norm(x) * a(z)        norm(x) the affine result above

    ``w`` (present when ``scale``) and ``b`` (present when ``bias``) have the shape of the input
    over ``axis``, taken in increasing axis order. The initial ``w`` is ``1 - scale_offset`` (ones,
    or zeros with the Gemma offset 1), so a fresh layer has an effective scale of 1; ``b`` starts
    at zero. DyT's ``alpha`` is a learned scalar starting at ``alpha_init``.

    Dtype policy: for float16 and bfloat16 inputs the statistic and ``y_hat`` (DyT: ``tanh``) are
    computed in float32. With ``cast="after_scale"`` the scale and bias are applied in float32 and
    the result is rounded to the output dtype once; with ``cast="before_scale"`` (the Llama order)
    ``y_hat`` is rounded to the input dtype first, and the affine result is rounded again. The
    output dtype is the input dtype (``output_dtype="input"``) or the promoted dtype of the input
    and the parameters (``"promote"``). A gate's ``a(z)`` and its product are computed in
    float32 for half inputs (not rounded to the input dtype). With ``gate="after"``,
    ``"after_scale"`` rounds ``(y_hat w + b) a(z)`` once; ``"before_scale"`` rounds ``y_hat`` to
    the input dtype, the affine result to the dtype of the affine step (the input dtype
    promoted with the parameters'), then multiplies by ``a(z)`` and rounds to the output dtype.

    Args:
      kind: ``"rms"`` (RMSNorm), ``"partial_rms"`` (pRMSNorm), ``"layer"`` (LayerNorm) or
        ``"dyt"`` (Dynamic Tanh, no statistic). Default ``"rms"``.
      eps: the positive constant that keeps ``r`` finite. Default None, which resolves to
        ``1e-6`` for every normalization kind and backend (torch's own LayerNorm uses 1e-5,
        Keras' LayerNormalization 1e-3: pass them explicitly to match). DyT has no eps: it must
        stay None.
      eps_placement: ``"inside"`` the square root (torch, Keras, Flax, Hugging Face) or
        ``"outside"`` it, added to the RMS or standard deviation (the original RMSNorm code).
        Default None, which resolves to ``"inside"``; must stay None for DyT.
      p: the partial fraction of ``partial_rms``, ``0 < p <= 1``; required for that kind and
        invalid for the others. Default ``None``.
      axis: the normalized axes, an int or a tuple of ints; negative values count from the end.
        Default ``-1``. Stored as a tuple. For DyT, the axes the parameters ``w`` and ``b`` span.
      scale: whether the layer has the learned scale ``w``. Default ``True``.
      scale_offset: the constant added to ``w`` before multiplying; ``1.0`` is the Gemma
        (zero-centered) convention. Default ``0.0``. Requires ``scale=True`` when non-zero.
      bias: whether the layer has the learned bias ``b``. Default ``None``, which resolves to
        ``False`` for the RMS kinds and ``True`` for ``"layer"`` and ``"dyt"``.
      cast: the cast order for half-precision inputs, ``"after_scale"`` (default) or
        ``"before_scale"``. It has no effect on float32 or float64 inputs.
      residual: a residual added before the norm (``h = x + residual; y = norm(h)``, returning
        ``(y, h)``; `normkit.reference.add_normalize`), or None (default, no residual). How the
        sum is rounded: ``"rounded"`` (``h`` rounded to the input dtype and that ``h``
        normalized: eager model code), ``"float32"`` (``h`` kept, normalized and returned in
        float32, float64 for float64 inputs: Quack, TransformerEngine) or
        ``"float32_normalized"`` (the float32 sum normalized, ``h`` returned rounded to the input
        dtype: FlashInfer). For float32 and float64 inputs the three coincide.
      variance: how LayerNorm computes its variance: ``"two_pass"`` (``mean((x - mean(x))^2)``)
        or ``"fast"`` (``max(0, mean(x^2) - mean(x)^2)`` with each step rounded to the compute
        dtype, float32 for half and float32 inputs: Flax's default). Default None, which resolves
        to ``"two_pass"`` for the normalization kinds (the only value for the RMS kinds, whose
        statistic has no mean) and stays None for DyT.
      offset_dtype: where ``scale_offset + w`` is computed: ``"float32"`` (default; at least
        float32, exact in the reference) or ``"param"`` (in ``w``'s own dtype, rounded there,
        then upcast). ``"param"`` needs a non-zero ``scale_offset``.
      output_dtype: ``"input"`` (default: the input dtype, whatever the parameters') or
        ``"promote"`` (the promoted dtype of the input and the parameters given, as Flax's
        ``result_type(x, params)``; the final rounding goes to it).
      alpha_init: DyT's initial ``alpha``, a positive finite float. Default None, which resolves
        to ``0.5`` (the paper's and Liger's value; x-transformers uses 1.0) for ``"dyt"``; must
        stay None for the other kinds.
      backward: the rounding model of the gradients: ``"exact"`` (default: the exact VJP, rounded
        once to each gradient's dtype) or ``"autograd"`` (what autograd through the eager
        forward computes in half precision: with ``cast="before_scale"`` the gradient of
        ``y_hat`` rounded to the input dtype at the cast, and the scale's gradient summed from
        products rounded to their dtype; Hugging Face Llama's RMSNorm). ``"autograd"`` is not
        defined with a gate.
      gate: a gate ``z``, a second input: ``"before"`` the norm (Mamba2: ``norm(x * a(z))``),
        ``"after"`` it (Qwen3-Next: ``norm(x) * a(z)``) or None (default, no gate). For the
        normalization kinds; not for DyT, and not with a ``residual``.
      gate_activation: ``a``, ``"silu"`` or ``"sigmoid"`` (Kimi Linear). Default None, which
        resolves to ``"silu"`` with a gate; must stay None without one.
      group_size: the statistic per group of ``group_size`` consecutive elements of the row (a
        positive int that divides ``n``: `group_count`), or None (default, the whole row).
        For ``"rms"`` and ``"layer"``.

    Examples:
      >>> llama = NormSpec("rms", eps=1e-5, cast="before_scale")
      >>> llama.bias, llama.axis, llama.scale_init
      (False, (-1,), 1.0)
      >>> NormSpec("partial_rms", p=0.0625).stat_size(4096)
      256
      >>> NormSpec("layer").bias
      True
    """

    kind: Kind = "rms"
    eps: float | None = None
    eps_placement: EpsPlacement | None = None
    p: float | None = None
    axis: int | tuple[int, ...] = -1
    scale: bool = True
    scale_offset: float = 0.0
    bias: bool | None = None
    cast: Cast = "after_scale"
    residual: Residual | None = None
    variance: Variance | None = None
    offset_dtype: OffsetDtype = "float32"
    output_dtype: OutputDtype = "input"
    alpha_init: float | None = None
    backward: Backward = "exact"
    gate: Gate | None = None
    gate_activation: GateActivation | None = None
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ALL_KINDS:
            raise _invalid("kind", self.kind, f"expected one of {ALL_KINDS}")
        if self.kind == "dyt":
            self._check_dyt_fields()
        else:
            self._check_norm_fields()
        object.__setattr__(self, "axis", _normalize_axis(self.axis))
        if not isinstance(self.scale, bool):
            raise _invalid("scale", self.scale, "expected True or False")
        scale_offset = _real("scale_offset", self.scale_offset, "expected a finite float")
        if not math.isfinite(scale_offset):
            raise _invalid("scale_offset", self.scale_offset, "expected a finite float")
        if self.scale_offset != 0 and not self.scale:
            raise _invalid("scale_offset", self.scale_offset, "a non-zero offset needs scale=True")
        if self.bias is None:
            object.__setattr__(self, "bias", self.kind in ("layer", "dyt"))
        elif not isinstance(self.bias, bool):
            raise _invalid("bias", self.bias, "expected True, False or None")
        if self.cast not in CASTS:
            raise _invalid("cast", self.cast, f"expected one of {CASTS}")
        object.__setattr__(self, "scale_offset", scale_offset)
        self._check_extensions()

    def _check_norm_fields(self) -> None:
        """eps, eps_placement, p and variance of a normalization kind, defaults resolved."""
        if self.eps is None:
            object.__setattr__(self, "eps", DEFAULT_EPS)
        if self.eps_placement is None:
            object.__setattr__(self, "eps_placement", "inside")
        if self.variance is None:
            object.__setattr__(self, "variance", "two_pass")
        eps = _real("eps", self.eps, "expected a positive finite float")
        if not (math.isfinite(eps) and eps > 0):
            raise _invalid("eps", self.eps, "expected a positive finite float")
        if self.eps_placement not in EPS_PLACEMENTS:
            raise _invalid("eps_placement", self.eps_placement, f"expected one of {EPS_PLACEMENTS}")
        if self.kind == "partial_rms":
            if self.p is None:
                raise _invalid("p", self.p, "kind='partial_rms' needs a fraction 0 < p <= 1")
            p = _real("p", self.p, "expected a float with 0 < p <= 1")
            if not (0 < p <= 1):
                raise _invalid("p", self.p, "expected 0 < p <= 1")
        elif self.p is not None:
            raise _invalid("p", self.p, f"p applies only to kind='partial_rms', not {self.kind!r}")
        if self.variance not in VARIANCES:
            raise _invalid("variance", self.variance, f"expected one of {VARIANCES}")
        if self.variance == "fast" and self.kind != "layer":
            raise _invalid(
                "variance", self.variance, f"applies only to kind='layer', not {self.kind!r}"
            )
        if self.alpha_init is not None:
            raise _invalid(
                "alpha_init", self.alpha_init, f"applies only to kind='dyt', not {self.kind!r}"
            )
        object.__setattr__(self, "eps", eps)
        if self.p is not None:
            object.__setattr__(self, "p", p)

    def _check_dyt_fields(self) -> None:
        """DyT has no statistic: eps, eps_placement, p and variance must stay None."""
        for name in ("eps", "eps_placement", "p", "variance"):
            value = getattr(self, name)
            if value is not None:
                raise _invalid(name, value, "kind='dyt' has no statistic; leave it None")
        if self.alpha_init is None:
            object.__setattr__(self, "alpha_init", DEFAULT_ALPHA_INIT)
        alpha = _real("alpha_init", self.alpha_init, "expected a positive finite float")
        if not (math.isfinite(alpha) and alpha > 0):
            raise _invalid("alpha_init", self.alpha_init, "expected a positive finite float")
        object.__setattr__(self, "alpha_init", alpha)

    def _check_extensions(self) -> None:
        """residual, offset_dtype, output_dtype and backward (every kind)."""
        if self.residual is not None and self.residual not in RESIDUALS:
            raise _invalid("residual", self.residual, f"expected None or one of {RESIDUALS}")
        if self.offset_dtype not in OFFSET_DTYPES:
            raise _invalid("offset_dtype", self.offset_dtype, f"expected one of {OFFSET_DTYPES}")
        if self.offset_dtype == "param" and self.scale_offset == 0:
            raise _invalid(
                "offset_dtype", self.offset_dtype, "'param' needs a non-zero scale_offset"
            )
        if self.output_dtype not in OUTPUT_DTYPES:
            raise _invalid("output_dtype", self.output_dtype, f"expected one of {OUTPUT_DTYPES}")
        if self.backward not in BACKWARDS:
            raise _invalid("backward", self.backward, f"expected one of {BACKWARDS}")
        self._check_gate()
        self._check_group_size()

    def _check_gate(self) -> None:
        """gate and gate_activation, the activation resolved."""
        if self.gate is None:
            if self.gate_activation is not None:
                raise _invalid(
                    "gate_activation",
                    self.gate_activation,
                    "applies only with a gate ('before' or 'after'), not gate=None",
                )
            return
        if self.gate not in GATES:
            raise _invalid("gate", self.gate, f"expected None or one of {GATES}")
        if self.kind == "dyt":
            raise _invalid(
                "gate",
                self.gate,
                f"applies to the normalization kinds {KINDS}, not 'dyt' (no "
                "model or peer gates DyT)",
            )
        if self.residual is not None:
            raise _invalid(
                "gate",
                self.gate,
                f"is not defined with residual={self.residual!r} (no model "
                "adds a residual into a gated norm); leave one of them None",
            )
        if self.backward == "autograd":
            raise _invalid(
                "backward",
                self.backward,
                "the autograd rounding model is defined for ungated "
                "specs only; use 'exact' with a gate",
            )
        if self.gate_activation is None:
            object.__setattr__(self, "gate_activation", "silu")
        if self.gate_activation not in GATE_ACTIVATIONS:
            raise _invalid(
                "gate_activation", self.gate_activation, f"expected one of {GATE_ACTIVATIONS}"
            )

    def _check_group_size(self) -> None:
        """group_size: None, or a positive int for a kind whose statistic can be grouped."""
        size = self.group_size
        if size is None:
            return
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise _invalid("group_size", size, "expected None or a positive int")
        if self.kind not in GROUPABLE_KINDS:
            reason = (
                "its statistic reads the first k = floor(n p) elements of the row, and no "
                "implementation defines a partial statistic per group"
                if self.kind == "partial_rms"
                else "it has no statistic"
            )
            allowed = f"applies to kind='rms' and 'layer', not {self.kind!r}: {reason}"
            raise _invalid("group_size", size, allowed)
        object.__setattr__(self, "group_size", int(size))

    def require_defaults(self, who: str) -> None:
        """ValueError unless ``who`` can compute this spec: not DyT, and every field of
        `EXTENDED_DEFAULTS` at its default. The error names the first field that is not."""
        if self.kind == "dyt":
            raise ValueError(f"{who} does not support NormSpec.kind='dyt' (only {KINDS})")
        for name, default in EXTENDED_DEFAULTS.items():
            value = getattr(self, name)
            if value != default:
                raise ValueError(
                    f"{who} does not support NormSpec.{name}={value!r} (only {default!r})"
                )

    @property
    def scale_init(self) -> float:
        """The initial value of ``w``: ``1 - scale_offset``, so that the effective scale is 1."""
        return 1.0 - self.scale_offset

    def check_eps(self, dtype: str) -> None:
        """ValueError unless ``eps`` is within the range of the dtype an input of ``dtype`` (a
        dtype name) is computed in: float32 for float16, bfloat16 and float32, float64 for
        float64 (`EPS_RANGE`)."""
        if self.eps is None:  # DyT: no eps
            return
        compute = "float64" if dtype == "float64" else "float32"
        low, high = EPS_RANGE[compute]
        if not low <= self.eps <= high:
            raise ValueError(
                f"NormSpec.eps={self.eps!r} is out of range for a {dtype} input, which is "
                f"computed in {compute}: eps must lie in [{low:.6g}, {high:.6g}] (below, {compute} "
                "rounds it or flushes it to zero and 1/eps can overflow; above, it is not "
                f"representable in {compute})"
            )

    def check_maskable(self) -> None:
        """ValueError unless a ``mask`` (Flax's) can restrict this spec's statistic: kinds
        "rms" and "layer" only, without a gate or groups."""
        if self.kind not in ("rms", "layer"):
            raise ValueError(
                f"mask applies to kind='rms' and 'layer' (Flax's RMSNorm and LayerNorm), not "
                f"{self.kind!r}: partial RMS already fixes the elements its statistic reads, and "
                "DyT has no statistic"
            )
        if self.gate is not None or self.group_size is not None:
            raise ValueError(
                f"mask is not defined with gate={self.gate!r} or group_size={self.group_size!r}: "
                "Flax's norms, whose argument it is, have neither; leave them None to use a mask"
            )

    def group_count(self, n: int) -> int:
        """How many groups a row of ``n`` elements is cut into: ``n / group_size``, or 1 without
        ``group_size``. ValueError unless ``group_size`` divides ``n``."""
        if n < 1:
            raise ValueError(f"a normalized row must have at least one element, got n={n}")
        if self.group_size is None:
            return 1
        if n % self.group_size:
            raise ValueError(
                f"NormSpec.group_size={self.group_size} does not divide the normalized size n={n}"
                ": a row must split into whole groups"
            )
        return n // self.group_size

    def resolve_axes(self, ndim: int) -> tuple[int, ...]:
        """The normalized axes of an input of rank ``ndim``: non-negative, increasing."""
        resolved = []
        for a in self.axis:
            if not -ndim <= a < ndim:
                raise ValueError(
                    f"NormSpec.axis={self.axis!r}: axis {a} is out of range for an input of "
                    f"rank {ndim} (allowed: {-ndim} .. {ndim - 1})"
                )
            resolved.append(a % ndim)
        if len(set(resolved)) != len(resolved):
            raise ValueError(
                f"NormSpec.axis={self.axis!r} names the same axis twice for an input of rank {ndim}"
            )
        return tuple(sorted(resolved))

    def param_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of ``w`` and ``b`` for an input of ``input_shape``."""
        return tuple(input_shape[a] for a in self.resolve_axes(len(input_shape)))

    def stat_size(self, n: int) -> int:
        """How many leading elements of a row of ``n`` the statistic reads.

        ``n`` for ``"rms"`` and ``"layer"``; ``max(1, floor(n * p))`` for ``"partial_rms"``, with
        ``n * p`` evaluated in float64 as the original pRMSNorm code's ``int(d * p)`` does (so
        ``p=0.29, n=100`` gives 28, not 29).
        """
        if n < 1:
            raise ValueError(f"a normalized row must have at least one element, got n={n}")
        if self.kind != "partial_rms":
            return n
        assert self.p is not None
        return max(1, math.floor(n * self.p))

    def __repr__(self) -> str:
        """The kind and the fields that differ from that kind's defaults, evaluable:
        ``NormSpec('rms', eps=1e-05, cast='before_scale')``."""
        defaults = NormSpec(self.kind, p=self.p, gate=self.gate)  # the gate's own activation
        shown = [
            f.name for f in dataclasses.fields(self)
            if f.name == "gate" and self.gate is not None
            or f.name not in ("kind", "p") and getattr(self, f.name) != getattr(defaults, f.name)
        ]
        changed = [f", {name}={getattr(self, name)!r}" for name in shown]
        p = "" if self.p is None else f", p={self.p!r}"
        return f"NormSpec({self.kind!r}{p}{''.join(changed)})"

    def replace(self, **changes: object) -> NormSpec:
        """A copy with ``changes`` applied and validated (``bias=None`` re-resolves the default)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        """A JSON-compatible dict; ``NormSpec.from_dict`` inverts it."""
        d = dataclasses.asdict(self)
        d["axis"] = list(self.axis)  # type: ignore[arg-type]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> NormSpec:
        """Build a spec from ``to_dict``'s output; unknown keys raise ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"a NormSpec dict must be a dict, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown NormSpec fields {unknown}; allowed: {sorted(names)}")
        fields = dict(data)
        if isinstance(fields.get("axis"), list):
            fields["axis"] = tuple(fields["axis"])  # type: ignore[arg-type]
        return cls(**fields)  # type: ignore[arg-type]


def _normalize_axis(axis: object) -> tuple[int, ...]:
    if isinstance(axis, bool):
        raise _invalid("axis", axis, "expected an int or a non-empty tuple of ints")
    if isinstance(axis, numbers.Integral):
        return (int(axis),)
    if not isinstance(axis, Iterable) or isinstance(axis, (str, bytes)):
        raise _invalid("axis", axis, "expected an int or a non-empty tuple of ints")
    axes = tuple(axis)
    if not axes:
        raise _invalid("axis", axis, "expected at least one axis")
    if not all(isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in axes):
        raise _invalid("axis", axis, "expected ints")
    axes = tuple(int(a) for a in axes)
    if len(set(axes)) != len(axes):
        raise _invalid("axis", axis, "expected distinct axes")
    return axes
