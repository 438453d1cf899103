"""The conformance cases: specs x dtypes x shapes, with inputs drawn deterministically from a seed.

A case is small and JSON-serializable, so a worker process can rebuild exactly the same inputs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass

import numpy as np

from normkit import dtypes
from normkit.conformance.compare import Inputs
from normkit.spec import EXTENDED_DEFAULTS, KINDS, NormSpec

CASE_DTYPES = ("float32", "float16", "bfloat16")
PARTIAL_P = 0.25


@dataclass(frozen=True)
class Case:
    """One check: ``spec`` applied to an input of ``shape`` and ``dtype``, params in
    ``param_dtype``."""

    spec: NormSpec
    shape: tuple[int, ...]
    dtype: str
    param_dtype: str = "float32"
    x_mean: float = 0.0

    @property
    def id(self) -> str:
        """A stable identifier, also the seed of the inputs."""
        fields: list[object] = [
            self.spec.to_dict(), list(self.shape), self.dtype, self.param_dtype
        ]
        if self.x_mean:
            fields.append(self.x_mean)
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def label(self) -> str:
        """The case in words: the kind and every option that is not its default, the dtype and
        shape, the parameter dtype when not float32, the input's mean when not 0."""
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
        mean = f" mean {self.x_mean:g}" if self.x_mean else ""
        return f"{' '.join(parts)} {self.dtype}{list(self.shape)}{params}{mean}"

    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """``(x, dy, scale, bias)``, the first four of `arrays`."""
        x, dy, scale, bias, *_ = self.arrays()
        return x, dy, scale, bias

    def arrays(self) -> Inputs:
        """Every input of the case, drawn from its seed (`compare.Inputs`).

        ``x`` (standard normal, plus ``x_mean``) and ``dy`` (standard normal) in the case dtype;
        the scale around its effective value 1 (``w = scale_init + 0.1 N(0, 1)``), the bias
        around 0, so every option changes the output measurably, both in the parameter dtype.
        Then, drawn after those (so a spec without them keeps its inputs), with a residual:
        ``residual`` (standard normal, x's dtype) and ``dh`` (standard normal, in ``h``'s dtype:
        float32 for ``residual="float32"`` with a half x); for DyT: ``alpha = alpha_init (1 +
        0.1 N(0, 1))``, shape ``(1,)``, in the parameter dtype.
        """
        rng = np.random.default_rng(int(self.id, 16))
        dtype = dtypes.DTYPE_NAMES[self.dtype]
        x = dtypes.round_to(rng.standard_normal(self.shape) + self.x_mean, dtype)
        dy = dtypes.round_to(rng.standard_normal(self.shape), dtype)
        spec = self.spec
        pshape = spec.param_shape(self.shape)
        param_dtype = dtypes.DTYPE_NAMES[self.param_dtype]
        scale = bias = residual = dh = alpha = None
        if spec.scale:
            drawn_scale = spec.scale_init + 0.1 * rng.standard_normal(pshape)
            scale = dtypes.round_to(drawn_scale, param_dtype)
        if spec.bias:
            bias = dtypes.round_to(0.1 * rng.standard_normal(pshape), param_dtype)
        if spec.residual is not None:
            residual = dtypes.round_to(rng.standard_normal(self.shape), dtype)
            kept = spec.residual == "float32" and dtypes.is_half(dtype)
            dh = dtypes.round_to(rng.standard_normal(self.shape), dtypes.float32 if kept else dtype)
        if spec.kind == "dyt":
            assert spec.alpha_init is not None
            drawn = spec.alpha_init * (1.0 + 0.1 * rng.standard_normal(1))
            alpha = dtypes.round_to(drawn, param_dtype)
        return Inputs(x, dy, scale, bias, residual, dh, alpha)

    def to_dict(self) -> dict[str, object]:
        return {
            "spec": self.spec.to_dict(),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
            "x_mean": self.x_mean,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Case:
        spec = NormSpec.from_dict(data["spec"])  # type: ignore[arg-type]
        shape = data["shape"]
        assert isinstance(shape, list | tuple)
        mean = data.get("x_mean", 0.0)
        assert isinstance(mean, int | float)
        return cls(
            spec,
            tuple(shape),
            str(data["dtype"]),
            str(data.get("param_dtype", "float32")),
            float(mean),
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


def matrix(
    *,
    quick: bool = False,
    kinds: tuple[str, ...] = KINDS,
    case_dtypes: tuple[str, ...] = CASE_DTYPES,
) -> list[Case]:
    """The case matrix: `specs` x dtypes (both cast orders for half dtypes) x shapes."""
    unknown = sorted(set(case_dtypes) - set(CASE_DTYPES))
    if unknown:
        raise ValueError(f"unknown dtypes {unknown}; conformance covers {list(CASE_DTYPES)}")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; allowed: {list(KINDS)}")
    cases = []
    for spec in specs(kinds, quick=quick):
        for dtype in case_dtypes:
            casts = ("after_scale", "before_scale") if dtype != "float32" else ("after_scale",)
            shapes = QUICK_SHAPES if quick else FULL_SHAPES
            for cast, (shape, axis) in itertools.product(casts, shapes):
                cases.append(Case(spec.replace(cast=cast, axis=axis), shape, dtype))
    return cases
