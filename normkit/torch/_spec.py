"""`RowSpec`: a `NormSpec` as normkit.torch computes it on rows of ``n`` elements, the one torch
encoding of the spec that every path reads (the composite Functions, the eager op sequence,
the CPU and Triton kernels, the sharded rows), built once per spec and row size by `row_spec`.

Custom ops cannot take it as such: they take `encode`'s string, which `decode` turns back.
This module has no postponed annotations: TorchScript compiles `RowSpec`
(`normkit.torch._scripted`).
"""

import ast
import functools
from typing import NamedTuple

from normkit.spec import NormSpec
from normkit.torch._cached import cached

__all__ = ["RowSpec", "decode", "encode", "row_spec"]


class RowSpec(NamedTuple):
    """What is computed on rows of ``n`` elements.

    Attributes:
      kind: ``"rms"``, ``"partial_rms"``, ``"layer"`` or ``"dyt"``.
      n: the row's size.
      k: how many leading elements of each group the statistic reads (the group's size except
        for ``partial_rms``).
      group: the statistic's group size (``n`` without `NormSpec.group_size`).
      eps: added to the statistic (0.0 for DyT); ``outside``: to its square root instead.
      scale_offset: the effective scale is ``scale_offset + w``.
      before_scale: ``cast="before_scale"``: ``y_hat`` rounded to a half input's dtype before the
        affine step.
      fast_variance: LayerNorm's ``variance="fast"``.
      offset_in_param: ``offset_dtype="param"``: ``scale_offset + w`` computed in w's dtype.
      gate: ``""`` (no gate), ``"before"`` or ``"after"`` the norm.
      activation: the gate's ``"silu"`` or ``"sigmoid"``.
      residual: ``""`` (no residual add), ``"rounded"``, ``"float32"`` or
        ``"float32_normalized"``.
    """

    kind: str
    n: int
    k: int
    group: int
    eps: float
    outside: bool
    scale_offset: float
    before_scale: bool
    fast_variance: bool
    offset_in_param: bool
    gate: str
    activation: str
    residual: str


@cached(512)
def row_spec(spec: NormSpec, n: int) -> RowSpec:
    """``spec`` on rows of ``n`` elements (ValueError where ``group_size`` does not divide n)."""
    group = n // spec.group_count(n)
    return RowSpec(
        kind=spec.kind, n=n, k=min(spec.stat_size(n), group), group=group,
        eps=0.0 if spec.eps is None else spec.eps, outside=spec.eps_placement == "outside",
        scale_offset=spec.scale_offset, before_scale=spec.cast == "before_scale",
        fast_variance=spec.variance == "fast", offset_in_param=spec.offset_dtype == "param",
        gate=spec.gate or "", activation=spec.gate_activation or "silu",
        residual=spec.residual or "",
    )


def encode(rows: RowSpec) -> str:
    """``rows`` as a custom op's string argument (`decode` inverts it)."""
    return repr(tuple(rows))


@functools.lru_cache(maxsize=512)
def decode(key: str) -> RowSpec:
    """The `RowSpec` `encode` wrote (a literal: nothing is evaluated)."""
    return RowSpec(*ast.literal_eval(key))
