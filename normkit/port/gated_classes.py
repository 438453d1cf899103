"""The gated RMSNorm classes of Hugging Face transformers and the `NormSpec` each computes.

Plain data, importing neither torch nor transformers: the tests, identify and port read the
same table. Every class here is called as ``module(x, gate)``; the spec is the one
`normkit.reference.gated_normalize` computes for it, on the trailing dim (``hidden_size``
features, the class's first constructor argument).

The classes fall into four conventions (the order of the ops in their ``forward``):

- Mamba2 family, ``norm(x * silu(z))``: ``x`` and ``z`` upcast to float32, the product in
  float32, the statistic per group of ``group_size`` features, ``y_hat`` rounded to the input
  dtype, then ``weight * y_hat`` in the promoted dtype (float32 with a float32 weight):
  ``gate="before"``, ``cast="before_scale"``, ``output_dtype="promote"``.
- Qwen3-Next family, ``(weight * y_hat) * act(z)``: ``y_hat`` rounded to the input dtype, times
  the weight (rounded to the input dtype when the weight is too), times ``act(z)`` in float32,
  rounded to the input dtype: ``gate="after"``, ``cast="before_scale"``.
- Kimi Linear family ("strict FP32 norm"): the weight upcast, ``(weight * y_hat) * act(z)`` in
  float32, rounded once: ``gate="after"``, ``cast="after_scale"``.
- Falcon-H1: groups (``n_groups``), affine in float32 and one rounding; the gate after the norm
  with ``norm_before_gate=True`` (its default), before it with ``False``.

Every class upcasts to float32, float64 inputs included: a ``module.double()`` computes the
statistic in float32, where the spec computes float64 inputs in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

from normkit.spec import NormSpec

__all__ = ["GATED_CLASSES", "NOT_A_GATED_NORM", "GatedClass", "gated_class"]


@dataclass(frozen=True)
class GatedClass:
    """One Hugging Face gated norm class (with ``options``, one setting of its constructor).

    ``spec`` is the class with its default eps and no groups. ``groups`` names the constructor
    argument that groups the statistic: ``"group_size"`` (its value is the group size),
    ``"n_groups"`` (the group size is ``hidden_size / n_groups``) or None. ``gate_optional``:
    ``forward(x)`` without a gate is the same spec with ``gate=None``. ``options``: the
    constructor keywords this entry is for (Falcon-H1's ``norm_before_gate``).
    """

    module: str
    name: str
    spec: NormSpec
    groups: str | None = None
    gate_optional: bool = False
    options: tuple[tuple[str, object], ...] = ()

    def spec_for(self, hidden_size: int, eps: float, groups: int | None = None) -> NormSpec:
        """The spec of an instance built with ``hidden_size``, ``eps`` and ``groups`` (the
        value of the `groups` argument); a single group covering the row is ``group_size=None``.
        """
        if (groups is None) != (self.groups is None):
            raise ValueError(
                f"{self.name} takes {self.groups or 'no grouping argument'}; got groups={groups!r}"
            )
        size = None
        if groups is not None:
            if groups < 1 or hidden_size % groups:
                raise ValueError(
                    f"{self.name}: {self.groups}={groups} does not split hidden_size="
                    f"{hidden_size} into whole groups"
                )
            size = groups if self.groups == "group_size" else hidden_size // groups
        return self.spec.replace(eps=eps, group_size=None if size == hidden_size else size)


_MAMBA2 = NormSpec(
    eps=1e-6, cast="before_scale", output_dtype="promote", gate="before", gate_activation="silu"
)
_QWEN3_NEXT = NormSpec(eps=1e-6, cast="before_scale", gate="after", gate_activation="silu")
_KIMI = NormSpec(eps=1e-6, cast="after_scale", gate="after", gate_activation="sigmoid")
_FALCON_H1 = NormSpec(eps=1e-6, cast="after_scale", gate="after", gate_activation="silu")


def _entry(path: str, name: str, spec: NormSpec, **fields: object) -> GatedClass:
    return GatedClass(f"transformers.models.{path}", name, spec, **fields)  # type: ignore[arg-type]


GATED_CLASSES: tuple[GatedClass, ...] = (
    *(
        _entry(path, name, _MAMBA2, groups="group_size", gate_optional=True)
        for path, name in (
            ("mamba2.modeling_mamba2", "MambaRMSNormGated"),
            ("bamba.modeling_bamba", "BambaRMSNormGated"),
            ("zamba2.modeling_zamba2", "Zamba2RMSNormGated"),
            ("nemotron_h.modeling_nemotron_h", "NemotronHRMSNormGated"),
            ("granitemoehybrid.modeling_granitemoehybrid", "GraniteMoeHybridRMSNormGated"),
        )
    ),
    *(
        _entry(path, name, _QWEN3_NEXT)
        for path, name in (
            ("qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNormGated"),
            ("qwen3_5.modeling_qwen3_5", "Qwen3_5RMSNormGated"),
            ("qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeRMSNormGated"),
            ("olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridRMSNormGated"),
        )
    ),
    # The activation is a constructor argument (the config's output_gate_type or hidden_act):
    # "silu" and "sigmoid" are expressible, any other activation is not.
    _entry(
        "qwen4_exp.modeling_qwen4_exp",
        "Qwen4ExpTextRMSNormGated",
        _QWEN3_NEXT,
        options=(("activation", "silu"),),
    ),
    _entry(
        "qwen4_exp.modeling_qwen4_exp",
        "Qwen4ExpTextRMSNormGated",
        _QWEN3_NEXT.replace(gate_activation="sigmoid"),
        options=(("activation", "sigmoid"),),
    ),
    *(
        _entry(path, name, _KIMI)
        for path, name in (
            ("kimi_linear.modeling_kimi_linear", "KimiLinearRMSNormGated"),
            ("glm5_next.modeling_glm5_next", "Glm5NextTextRMSNormGated"),
            ("bailing_hybrid.modeling_bailing_hybrid", "BailingHybridRMSNormGated"),
        )
    ),
    _entry(
        "lara_mini.modeling_lara_mini",
        "LaraMiniRMSNormGated",
        _KIMI.replace(gate_activation="silu"),
    ),
    _entry(
        "falcon_h1.modeling_falcon_h1",
        "FalconH1RMSNormGated",
        _FALCON_H1,
        groups="n_groups",
        gate_optional=True,
        options=(("norm_before_gate", True),),
    ),
    _entry(
        "falcon_h1.modeling_falcon_h1",
        "FalconH1RMSNormGated",
        _FALCON_H1.replace(gate="before"),
        groups="n_groups",
        gate_optional=True,
        options=(("norm_before_gate", False),),
    ),
)
"""Every gated norm class of transformers 5.24 that a `NormSpec` expresses."""

NOT_A_GATED_NORM: dict[str, str] = {
    "AXK2GatedRMSNorm": (
        "its gate is not an input: y = RMSNorm(x) * sigmoid(mlp(RMSNorm(x))), a learned low-rank "
        "MLP of the norm's own output; its inner AXK2RMSNorm is an ordinary RMSNorm "
        "(NormSpec('rms', cast='before_scale'))"
    ),
}
"""Classes named like gated norms that no `NormSpec` expresses, with the reason."""


def gated_class(name: str, **options: object) -> GatedClass:
    """The entry of class ``name`` (with ``options``, the constructor keywords that select one,
    for a class with several entries). KeyError naming the known classes otherwise."""
    found = [
        c
        for c in GATED_CLASSES
        if c.name == name and all(dict(c.options).get(k) == v for k, v in options.items())
    ]
    if len(found) != 1:
        known = sorted({c.name for c in GATED_CLASSES})
        detail = f"options {options} select {len(found)} entries" if found else f"known: {known}"
        raise KeyError(f"no single gated class {name!r}: {detail}")
    return found[0]
