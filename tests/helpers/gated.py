"""The gated and grouped specs every adapter's gated test runs, and their test ids."""

import itertools

from normkit import NormSpec


def specs() -> list[NormSpec]:
    """Every gate position and activation with and without groups of 4, and groups alone, for
    each normalization kind (not partial RMS with groups) and cast order; LayerNorm with a
    bias."""
    found = []
    for kind, gate, activation, group, cast in itertools.product(
        ["rms", "layer", "partial_rms"], [None, "before", "after"], ["silu", "sigmoid"],
        [None, 4], ["after_scale", "before_scale"],
    ):
        if (gate is None and activation == "sigmoid") or (kind == "partial_rms" and group):
            continue
        if gate is None and group is None:
            continue  # the plain norms have their own tests
        found.append(NormSpec(
            kind, p=0.5 if kind == "partial_rms" else None, gate=gate,
            gate_activation=activation if gate else None, group_size=group, cast=cast,
            bias=kind == "layer",
        ))
    return found


def spec_id(spec: NormSpec) -> str:
    return f"{spec.kind}-{spec.gate}-{spec.gate_activation}-g{spec.group_size}-{spec.cast}"
