"""The block's sizes and norms, shared by the three implementations."""

from __future__ import annotations

from dataclasses import dataclass, field

from normkit import NormSpec


@dataclass(frozen=True)
class Config:
    dim: int = 32
    heads: int = 4
    hidden: int = 64
    #: Llama's RMSNorm: eps 1e-5, the normalized value cast before the scale.
    rms: NormSpec = field(default_factory=lambda: NormSpec("rms", eps=1e-5, cast="before_scale"))
    #: torch's LayerNorm default eps, stated: normkit's default is 1e-6.
    final: NormSpec = field(default_factory=lambda: NormSpec("layer", eps=1e-5))
