"""`KernelOptions`: a `NormSpec` as the kernels of `normkit.torch.kernels` read it, for rows of
``n`` elements, built once per (spec, n) by `kernel_options`."""

from __future__ import annotations

import dataclasses
import functools

from normkit.spec import NormSpec

__all__ = ["KernelOptions", "kernel_options"]


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """What a kernel's ``norm_rows`` and ``add_norm_rows`` compute on rows (rows, n).

    Attributes:
      kind: ``"rms"``, ``"partial_rms"`` or ``"layer"``.
      k: the statistic reads the first ``k`` elements of each group (the group's size except
        for ``partial_rms``).
      eps: added to the statistic; ``outside``: to its square root instead.
      scale_offset: the effective scale is ``scale_offset + float32(weight)``.
      cast: ``"after_scale"`` or ``"before_scale"`` (y_hat rounded to x's half dtype first).
      group: the statistic per group of that many contiguous elements; None: the whole row.
      gate_position: None, or where the gate ``a(z)`` applies: ``"before"`` (the norm of
        ``x a(z)``) or ``"after"`` (the norm's result times ``a(z)``).
      activation: ``a``, ``"silu"`` or ``"sigmoid"``.
      round_affine: ``u = y_hat g + b`` rounded to x's dtype before a gate after the norm.
      residual_rounding: ``add_norm_rows``' `NormSpec.residual`; None for ``norm_rows``.
    """

    kind: str
    k: int
    eps: float
    outside: bool = False
    scale_offset: float = 0.0
    cast: str = "after_scale"
    group: int | None = None
    gate_position: str | None = None
    activation: str = "silu"
    round_affine: bool = False
    residual_rounding: str | None = None

    def group_of(self, n: int) -> int:
        """The size of a statistic's group on rows of ``n`` elements."""
        return n if self.group is None else self.group


@functools.lru_cache(maxsize=256)
def kernel_options(spec: NormSpec, n: int, round_affine: bool = False) -> KernelOptions:
    """``spec`` for rows of ``n`` elements (a spec the kernels compute: not DyT, its eps set).

    ``round_affine`` depends on the parameters' dtypes, which the spec does not hold: the
    caller's, true where the affine step of a gate after the norm is in x's half dtype."""
    assert spec.eps is not None and spec.kind != "dyt", spec
    group = None if spec.group_size is None else n // spec.group_count(n)
    return KernelOptions(
        kind=spec.kind, k=min(spec.stat_size(n), n if group is None else group), eps=spec.eps,
        outside=spec.eps_placement == "outside", scale_offset=spec.scale_offset, cast=spec.cast,
        group=group, gate_position=spec.gate, activation=spec.gate_activation or "silu",
        round_affine=round_affine, residual_rounding=spec.residual,
    )
