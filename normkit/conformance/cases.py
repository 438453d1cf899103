"""The conformance cases: specs x dtypes x shapes, with inputs drawn deterministically from a seed.

A case is small and JSON-serializable, so a worker process can rebuild exactly the same inputs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass

import numpy as np

from normkit import dtypes
from normkit.conformance import rows as row_kinds
from normkit.conformance.compare import Inputs
from normkit.spec import ALL_KINDS, EXTENDED_DEFAULTS, KINDS, RESIDUALS, NormSpec

CASE_DTYPES = ("float32", "float16", "bfloat16")
"""The dtypes of the peers' cases, and of the matrix but float64."""
MATRIX_DTYPES = (*CASE_DTYPES, "float64")
"""Every input dtype of the matrix."""
PARTIAL_P = 0.25
FEATURES = (*EXTENDED_DEFAULTS, "dyt", "float64")
"""What a case may exercise beyond the original matrix (`Case.features`)."""
# The NormSpec fields that came after the case ids (all None by default).
_NEWER_FIELDS = ("gate", "gate_activation", "group_size")
ROW_LABELS = {"eps": "rows near eps", "large_mean": "rows of a large mean",
              "ties": "rows near rounding ties"}
"""How a case's label names its rows beside the standard ones."""


@dataclass(frozen=True)
class Case:
    """One check: ``spec`` applied to an input of ``shape`` and ``dtype``, params in
    ``param_dtype``, on rows of the kind ``rows`` (`normkit.conformance.rows`)."""

    spec: NormSpec
    shape: tuple[int, ...]
    dtype: str
    param_dtype: str = "float32"
    rows: str = "standard"
    initial: bool = False
    """The parameters left out: the layer's own initial values (its initialization checked)."""

    def __post_init__(self) -> None:
        n = math.prod(self.shape[a] for a in self.spec.resolve_axes(len(self.shape)))
        if not row_kinds.applies(self.rows, self.spec, self.dtype, self.spec.group_size or n):
            raise ValueError(
                f"rows={self.rows!r} do not apply to {self.spec!r} on {self.dtype} inputs "
                f"of shape {self.shape}"
            )

    @property
    def id(self) -> str:
        """A stable identifier, also the seed of the inputs. Spec fields added since the ids
        were first drawn are left out while at their defaults, and so are standard rows, so a
        case keeps its inputs when the spec grows."""
        fields = {
            name: value for name, value in self.spec.to_dict().items()
            if not (name in _NEWER_FIELDS and value is None)
        }
        key: list[object] = [fields, list(self.shape), self.dtype, self.param_dtype]
        if self.rows != "standard":
            key.append(self.rows)
        if self.initial:
            key.append("initial")
        text = json.dumps(key, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def label(self) -> str:
        """The case in words: the kind and every option that is not its default, the dtype and
        shape, and the parameter dtype when not float32."""
        s = self.spec
        if s.kind == "dyt":
            parts = [s.kind, f"alpha_init={s.alpha_init:g}"]
        else:
            parts = [s.kind, f"eps={s.eps:g}", str(s.eps_placement)]
        if s.p is not None:
            parts.append(f"p={s.p:g}")
        if s.scale_offset:
            parts.append(f"offset={s.scale_offset:g}")
        if not s.scale:
            parts.append("no scale")
        if s.bias:
            parts.append("bias")
        if dtypes.is_half(dtypes.DTYPE_NAMES[self.dtype]):
            parts.append(s.cast)
        if s.axis != (-1,):
            parts.append(f"axis={s.axis}")
        parts += [
            f"{name}={getattr(s, name)}"
            for name, default in EXTENDED_DEFAULTS.items()
            if getattr(s, name) not in (default, None)  # None: DyT has no variance
        ]
        params = "" if self.param_dtype == "float32" else f" params {self.param_dtype}"
        rows = "" if self.rows == "standard" else f" {ROW_LABELS[self.rows]}"
        initial = " initial parameters" if self.initial else ""
        return f"{' '.join(parts)} {self.dtype}{list(self.shape)}{params}{rows}{initial}"

    @property
    def features(self) -> tuple[str, ...]:
        """What of `FEATURES` the case exercises: the extended fields off their default, DyT,
        float64 inputs."""
        s = self.spec
        found = [name for name, default in EXTENDED_DEFAULTS.items()
                 if getattr(s, name) not in (default, None)]
        if s.kind == "dyt":
            found.append("dyt")
        if self.dtype == "float64":
            found.append("float64")
        return tuple(f for f in FEATURES if f in found)

    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """``(x, dy, scale, bias)``, the first four of `arrays`."""
        x, dy, scale, bias, *_ = self.arrays()
        return x, dy, scale, bias

    def arrays(self) -> Inputs:
        """Every input of the case, drawn from its seed (`compare.Inputs`), for its kind of rows
        (`normkit.conformance.rows`: standard rows below, the others in that module's doc).

        ``x`` and ``dy`` (standard normal) in the case dtype;
        the scale around its effective value 1 (``w = scale_init + 0.1 N(0, 1)``), the bias
        around 0, so every option changes the output measurably, both in the parameter dtype.
        Then, drawn after those (so a spec without them keeps its inputs), with a residual:
        ``residual`` (standard normal, x's dtype) and ``dh`` (standard normal, in ``h``'s dtype:
        float32 for ``residual="float32"`` with a half x); for DyT: ``alpha = alpha_init (1 +
        0.1 N(0, 1))``, shape ``(1,)``, in the parameter dtype; for a gated spec: ``gate``
        (``1.5 N(0, 1)``, x's dtype).
        """
        rng = np.random.default_rng(int(self.id, 16))
        dtype = dtypes.DTYPE_NAMES[self.dtype]
        spec = self.spec
        axes = spec.resolve_axes(len(self.shape))
        raw_x, raw_dy = rng.standard_normal(self.shape), rng.standard_normal(self.shape)
        pshape = spec.param_shape(self.shape)
        param_dtype = dtypes.DTYPE_NAMES[self.param_dtype]
        scale = bias = residual = dh = alpha = None
        if spec.scale:
            drawn_scale = spec.scale_init + 0.1 * rng.standard_normal(pshape)
            scale = dtypes.round_to(drawn_scale, param_dtype)
        if spec.bias:
            bias = dtypes.round_to(0.1 * rng.standard_normal(pshape), param_dtype)
        raw_residual = None
        if spec.residual is not None:
            raw_residual = rng.standard_normal(self.shape)
            kept = spec.residual == "float32" and dtypes.is_half(dtype)
            dh = dtypes.round_to(rng.standard_normal(self.shape), dtypes.float32 if kept else dtype)
        if spec.kind == "dyt":
            assert spec.alpha_init is not None
            drawn = spec.alpha_init * (1.0 + 0.1 * rng.standard_normal(1))
            alpha = dtypes.round_to(drawn, param_dtype)
        raw_gate = None
        if spec.gate is not None:
            raw_gate = 1.5 * rng.standard_normal(self.shape)
        if self.rows == "eps":
            sizes = row_kinds.row_sizes(spec, self.dtype, row_kinds.row_count(self.shape, axes))
            raw_x = raw_x * row_kinds.per_row(sizes, self.shape, axes)
            raw_dy = raw_dy * row_kinds.per_row(
                row_kinds.r_inverse(spec, sizes), self.shape, axes
            )
            if raw_residual is not None:
                raw_residual = raw_residual * row_kinds.per_row(sizes, self.shape, axes)
        elif self.rows == "large_mean":
            raw_x = row_kinds.large_mean(rng, self.shape, axes, self.dtype)
            if raw_gate is not None:
                raw_gate = np.full(self.shape, 4.0)  # a constant gate keeps the mean large
        elif self.rows == "ties":
            raw_x = row_kinds.ties(rng, self.shape, self.dtype)
            scale, bias = row_kinds.ties_params(rng, spec, pshape)
            scale, bias = (None if p is None else p.astype(param_dtype) for p in (scale, bias))
        x, dy = dtypes.round_to(raw_x, dtype), dtypes.round_to(raw_dy, dtype)
        if raw_residual is not None:
            residual = dtypes.round_to(raw_residual, dtype)
        gate = None if raw_gate is None else dtypes.round_to(raw_gate, dtype)
        if self.initial:
            scale = bias = alpha = None
        return Inputs(x, dy, scale, bias, residual, dh, alpha, gate)

    def to_dict(self) -> dict[str, object]:
        return {
            "spec": self.spec.to_dict(),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
            "rows": self.rows,
            "initial": self.initial,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Case:
        spec = NormSpec.from_dict(data["spec"])  # type: ignore[arg-type]
        shape = data["shape"]
        assert isinstance(shape, list | tuple)
        return cls(
            spec, tuple(shape), str(data["dtype"]), str(data.get("param_dtype", "float32")),
            str(data.get("rows", "standard")), bool(data.get("initial", False)),
        )


FULL_SHAPES: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    # (shape, normalized axes)
    ((3, 1), (-1,)),  # n = 1: the RMS gradient is of the order of eps
    ((6, 2), (-1,)),  # n = 2: so is LayerNorm's
    ((5, 7), (-1,)),  # odd
    ((4, 3, 5), (-2, -1)),  # multi-axis, n = 15
    ((16, 256), (-1,)),
    ((2, 16384), (-1,)),  # n = 16384
)
QUICK_SHAPES: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((5, 7), (-1,)),
    ((4, 2, 512), (-2, -1)),  # multi-axis, n = 1024
)


def specs(kinds: tuple[str, ...] = KINDS, *, quick: bool = False) -> list[NormSpec]:
    """Every combination of kind, eps placement, offset and bias.

    ``quick`` keeps two per kind that still exercise every option: (inside, offset 0, no bias)
    and (outside, offset 1, bias).
    """
    found = []
    options = itertools.product(kinds, ("inside", "outside"), (0.0, 1.0), (False, True))
    for kind, placement, offset, bias in options:
        if quick and not ((placement == "outside") == (offset == 1.0) == bias):
            continue
        eps = 1e-6 if placement == "inside" else 1e-5
        found.append(
            NormSpec(
                kind,  # type: ignore[arg-type]
                eps=eps,
                eps_placement=placement,  # type: ignore[arg-type]
                p=PARTIAL_P if kind == "partial_rms" else None,
                scale_offset=offset,
                bias=bias,
            )
        )
    return found


Shapes = tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]

EXTENDED_SHAPES: Shapes = (((5, 7), (-1,)), ((4, 2, 64), (-2, -1)))
"""The shapes of the families of the extended fields: odd, and multi-axis with n = 128."""
QUICK_EXTENDED_SHAPES: Shapes = (((5, 7), (-1,)),)
PROBE_SHAPE: tuple[tuple[int, ...], tuple[int, ...]] = ((5, 7), (-1,))
"""The shape of the base specs' rows near eps and rows of a large mean: five rows of 7."""
GROUPED_SHAPES: Shapes = (((5, 8), (-1,)), ((4, 2, 64), (-2, -1)))
"""The shapes of the grouped family (n divisible by its group size 4); the first one quick."""

# A family member: a spec, and the (input dtype, cast, parameter dtype) it runs on.
Setting = tuple[str, str, str]
Member = tuple[NormSpec, tuple[Setting, ...]]

_F32, _F16, _BF16, _F64 = "float32", "float16", "bfloat16", "float64"
_AFTER, _BEFORE = "after_scale", "before_scale"


@dataclass(frozen=True)
class Family:
    """An extended field's own small family of cases: its members, and the few of a quick run."""

    full: tuple[Member, ...]
    quick: tuple[Member, ...]

    def members(self, quick: bool) -> tuple[Member, ...]:
        return self.quick if quick else self.full


_AUTOGRAD = NormSpec(backward="autograd")
_GROUPED = NormSpec(group_size=4)
_MAMBA2 = NormSpec(gate="before", cast="before_scale", output_dtype="promote")
_QWEN3_NEXT = NormSpec(gate="after", cast="before_scale")
_KIMI = NormSpec(gate="after", gate_activation="sigmoid")
_RESIDUAL_SETTINGS = ((_F32, _AFTER, _F32), (_BF16, _AFTER, _F32), (_F16, _BEFORE, _F32))
_DYT_SETTINGS = ((_F32, _AFTER, _F32), (_F16, _AFTER, _F32), (_BF16, _AFTER, _F32),
                 (_BF16, _BEFORE, _F32), (_F64, _AFTER, _F32))

FAMILIES: dict[str, Family] = {
    # Each rounding of the sum, on half inputs (where they differ) and float32.
    "residual": Family(
        full=(
            *((NormSpec(residual=mode), _RESIDUAL_SETTINGS) for mode in RESIDUALS),
            (NormSpec("layer", residual="float32_normalized"), ((_BF16, _BEFORE, _F32),)),
            (NormSpec(residual="rounded"), ((_F64, _AFTER, _F32),)),
        ),
        quick=(
            (NormSpec(residual="rounded"), ((_BF16, _BEFORE, _F32),)),
            (NormSpec(residual="float32"), ((_F16, _AFTER, _F32),)),
        ),
    ),
    # LayerNorm with the fast variance (zero-mean rows: on rows of a large mean a float32
    # implementation's summation order moves the cancelling difference beyond the tolerance).
    "variance": Family(
        full=((NormSpec("layer", variance="fast"),
               ((_F32, _AFTER, _F32), (_BF16, _AFTER, _F32), (_F16, _BEFORE, _F32),
                (_F64, _AFTER, _F32))),),
        quick=((NormSpec("layer", variance="fast"), ((_F32, _AFTER, _F32),)),),
    ),
    # scale_offset + w in the half parameter's own dtype.
    "offset_dtype": Family(
        full=((NormSpec(scale_offset=1.0, offset_dtype="param"),
               ((_BF16, _AFTER, _BF16), (_BF16, _BEFORE, _BF16), (_F16, _AFTER, _F16),
                (_F32, _AFTER, _BF16))),),
        quick=((NormSpec(scale_offset=1.0, offset_dtype="param"), ((_BF16, _AFTER, _BF16),)),),
    ),
    # The output in the promoted dtype: float32 params with half inputs, half params with
    # float32 inputs.
    "output_dtype": Family(
        full=(
            (NormSpec(output_dtype="promote"),
             ((_BF16, _BEFORE, _F32), (_F16, _AFTER, _F32), (_F32, _AFTER, _BF16),
              (_F32, _AFTER, _F16))),
            (NormSpec("layer", output_dtype="promote"), ((_BF16, _AFTER, _F32),)),
        ),
        quick=((NormSpec(output_dtype="promote"), ((_BF16, _BEFORE, _F32),)),),
    ),
    # DyT: both initial alphas, with and without bias, on every dtype.
    "dyt": Family(
        full=(
            *((NormSpec("dyt", alpha_init=alpha, bias=bias), _DYT_SETTINGS)
              for alpha, bias in itertools.product((0.5, 1.0), (True, False))),
            (NormSpec("dyt", residual="rounded"), ((_BF16, _AFTER, _F32),)),
        ),
        quick=(  # every dtype, so that any --kind dyt --dtype D selects a case
            (NormSpec("dyt", alpha_init=0.5), ((_BF16, _AFTER, _F32), (_F16, _AFTER, _F32))),
            (NormSpec("dyt", alpha_init=1.0, bias=False),
             ((_F32, _AFTER, _F32), (_F64, _AFTER, _F32))),
        ),
    ),
    # The gradients of autograd through the eager forward: half inputs, both casts, params in
    # the input dtype (as `module.to(dtype)`), and Llama's float32 weights.
    "backward": Family(
        full=(
            (_AUTOGRAD, ((_BF16, _AFTER, _BF16), (_BF16, _BEFORE, _BF16), (_F16, _AFTER, _F16),
                         (_F16, _BEFORE, _F16))),
            (NormSpec("layer", backward="autograd"), ((_BF16, _BEFORE, _BF16),)),
            (_AUTOGRAD.replace(output_dtype="promote"), ((_BF16, _BEFORE, _F32),)),
            (_AUTOGRAD.replace(residual="rounded"), ((_BF16, _BEFORE, _BF16),)),
        ),
        quick=((_AUTOGRAD, ((_BF16, _BEFORE, _BF16),)),),
    ),
    # The gate before and after the norm, SiLU and sigmoid, each cast order: the Mamba2,
    # Qwen3-Next and Kimi Linear conventions among them.
    "gate": Family(
        full=(
            (_MAMBA2, ((_BF16, _BEFORE, _F32), (_F32, _BEFORE, _F32))),
            (_QWEN3_NEXT, ((_BF16, _BEFORE, _BF16), (_F16, _BEFORE, _F32))),
            (_KIMI, ((_BF16, _AFTER, _F32), (_F64, _AFTER, _F32))),
            (NormSpec("layer", gate="before", gate_activation="sigmoid"),
             ((_F32, _AFTER, _F32),)),
            (NormSpec("partial_rms", p=0.5, gate="after"), ((_BF16, _AFTER, _F32),)),
        ),
        quick=((_QWEN3_NEXT, ((_BF16, _BEFORE, _F32),)), (_KIMI, ((_F32, _AFTER, _F32),))),
    ),
    # The statistic per group of 4 (`GROUPED_SHAPES`), RMS and LayerNorm, gated (Mamba2's
    # n_groups) and not.
    "group_size": Family(
        full=(
            (_GROUPED, ((_F32, _AFTER, _F32), (_BF16, _BEFORE, _F32), (_F64, _AFTER, _F32))),
            (NormSpec("layer", group_size=4), ((_F16, _AFTER, _F32),)),
            (NormSpec(gate="before", group_size=4, cast="before_scale"),
             ((_BF16, _BEFORE, _F32),)),
        ),
        quick=((_GROUPED, ((_BF16, _BEFORE, _F32),)),),
    ),
}
"""The extended fields' own small families of cases, by field."""


@dataclass(frozen=True)
class Probe:
    """Cases of one spec whose rows are of another kind than the standard ones
    (`normkit.conformance.rows`), or that leave the parameters to the layer (``initial``), on
    one shape; ``quick``: in the default matrix too."""

    spec: NormSpec
    settings: tuple[Setting, ...]
    rows: str = "standard"
    initial: bool = False
    shape: tuple[tuple[int, ...], tuple[int, ...]] = ((5, 7), (-1,))
    quick: bool = True


_TIES_SHAPE = ((4, 2, 64), (-2, -1))  # 512 elements: hundreds where two roundings differ
_FAST = NormSpec("layer", variance="fast")

PROBES: tuple[Probe, ...] = (
    # the fast variance on float16 rows of a large mean, where its own steps are exact
    Probe(_FAST, ((_F16, _AFTER, _F32),), "large_mean"),
    # roundings an ulp apart, told apart by counting: 1 + w rounded in the half parameter's
    # dtype, the half sum rounded before or after the norm
    Probe(NormSpec(scale_offset=1.0, offset_dtype="param"), ((_BF16, _AFTER, _BF16),), "ties",
          shape=_TIES_SHAPE),
    Probe(NormSpec(scale_offset=1.0, offset_dtype="param"), ((_F16, _BEFORE, _F16),), "ties",
          shape=_TIES_SHAPE, quick=False),
    Probe(NormSpec(scale_offset=1.0), ((_BF16, _AFTER, _BF16),), "ties", shape=_TIES_SHAPE),
    *(Probe(NormSpec(residual=mode), ((_BF16, _AFTER, _F32),), "ties", shape=_TIES_SHAPE)
      for mode in ("rounded", "float32_normalized")),
    # the layer's own initial parameters: DyT's alpha_init, the Gemma scale's zeros
    Probe(NormSpec("dyt", alpha_init=1.0), ((_F32, _AFTER, _F32),), initial=True),
    Probe(NormSpec("dyt", alpha_init=0.5, bias=False), ((_BF16, _AFTER, _F32),), initial=True,
          quick=False),
    Probe(NormSpec(scale_offset=1.0, bias=True), ((_F32, _AFTER, _F32),), initial=True),
)
"""Cases of rows of their own beyond the base specs' (each base spec has rows near eps on
every dtype, and LayerNorm's rows of a large mean: `matrix`)."""


def check_filters(kinds: tuple[str, ...], case_dtypes: tuple[str, ...]) -> None:
    unknown = sorted(set(case_dtypes) - set(MATRIX_DTYPES))
    if unknown:
        raise ValueError(f"unknown dtypes {unknown}; conformance covers {list(MATRIX_DTYPES)}")
    unknown = sorted(set(kinds) - set(ALL_KINDS))
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; allowed: {list(ALL_KINDS)}")


def matrix(
    *,
    quick: bool = False,
    kinds: tuple[str, ...] = ALL_KINDS,
    case_dtypes: tuple[str, ...] = MATRIX_DTYPES,
) -> list[Case]:
    """The case matrix, restricted to ``kinds`` and input dtypes ``case_dtypes``.

    `specs` x dtypes (both cast orders for half dtypes) x shapes (`FULL_SHAPES`, or
    `QUICK_SHAPES` with ``quick``); each of those specs on rows near eps, and LayerNorm's on
    rows of a large mean, on `PROBE_SHAPE` in every dtype; then the `FAMILIES` of the extended
    fields, each member on its own dtypes and `EXTENDED_SHAPES` (`QUICK_EXTENDED_SHAPES`), and
    the `PROBES`.
    """
    check_filters(kinds, case_dtypes)
    cases = []
    base_kinds = tuple(k for k in kinds if k in KINDS)
    for spec in specs(base_kinds, quick=quick):
        for dtype in case_dtypes:
            half = dtypes.is_half(dtypes.DTYPE_NAMES[dtype])
            casts = (_AFTER, _BEFORE) if half else (_AFTER,)
            shapes = QUICK_SHAPES if quick else FULL_SHAPES
            for cast, (shape, axis) in itertools.product(casts, shapes):
                cases.append(Case(spec.replace(cast=cast, axis=axis), shape, dtype))
    shapes = QUICK_EXTENDED_SHAPES if quick else EXTENDED_SHAPES
    for family in FAMILIES.values():
        for spec, settings in family.members(quick):
            if spec.kind not in kinds:
                continue
            family_shapes = shapes
            if spec.group_size is not None:
                family_shapes = GROUPED_SHAPES[:1] if quick else GROUPED_SHAPES
            for (dtype, cast, param_dtype), (shape, axis) in itertools.product(
                settings, family_shapes
            ):
                if dtype in case_dtypes:
                    changed = spec.replace(cast=cast, axis=axis)
                    cases.append(Case(changed, shape, dtype, param_dtype))
    (probe_shape, probe_axis) = PROBE_SHAPE
    for spec in specs(base_kinds, quick=quick):
        for dtype, rows in itertools.product(case_dtypes, ("eps", "large_mean")):
            if row_kinds.applies(rows, spec, dtype, probe_shape[-1]):
                cases.append(Case(spec.replace(axis=probe_axis), probe_shape, dtype, rows=rows))
    for probe in PROBES:
        if probe.spec.kind not in kinds or (quick and not probe.quick):
            continue
        shape, axis = probe.shape
        for dtype, cast, param_dtype in probe.settings:
            if dtype in case_dtypes:
                spec = probe.spec.replace(cast=cast, axis=axis)
                cases.append(Case(spec, shape, dtype, param_dtype, probe.rows, probe.initial))
    return cases


def _covers(case: Case) -> set[tuple[object, ...]]:
    """What a case shows of the matrix: its kind and dtype alone and together, each option of
    its spec off its kind's default (the cast order on half inputs only), its shape, its rows,
    its parameter dtype, initial parameters."""
    spec = case.spec
    defaults = NormSpec(spec.kind, p=spec.p, gate=spec.gate)
    found: set[tuple[object, ...]] = {
        ("kind", spec.kind), ("dtype", case.dtype), ("kind, dtype", spec.kind, case.dtype),
        ("shape", case.shape), ("rows", case.rows, spec.kind == "layer"),
        ("param_dtype", case.param_dtype), ("initial", case.initial),
    }
    for name, value in spec.to_dict().items():
        if name == "cast" and not dtypes.is_half(dtypes.DTYPE_NAMES[case.dtype]):
            continue
        if name not in ("kind", "p", "axis") and value != getattr(defaults, name):
            found.add((name, str(value)))
    return found


def lean(cases: list[Case]) -> list[Case]:
    """A subset of ``cases`` for the targets that compile every program (XLA, Triton's
    interpreter): greedily, the case that shows the most of what the chosen ones do not yet
    (`_covers`: every kind and dtype alone and together, every option, shape and kind of
    rows), until nothing is left; then every case that runs a program already chosen (the same
    spec, shape and dtypes on other rows), which costs no compilation."""
    left = {c: _covers(c) for c in cases}
    wanted = set().union(*left.values()) if left else set()
    chosen: list[Case] = []
    while wanted:
        best = max(left, key=lambda c: len(left[c] & wanted))
        chosen.append(best)
        wanted -= left.pop(best)
    programs = {_program(c) for c in chosen}
    chosen += [c for c in left if _program(c) in programs]
    return [c for c in cases if c in chosen]


def _program(case: Case) -> tuple[object, ...]:
    """What a compiled program is specific to: the spec, shape and dtypes (not the rows)."""
    return (case.spec, case.shape, case.dtype, case.param_dtype)
