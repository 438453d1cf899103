"""What one model benchmark trains: the model's size, the task, the optimizer, the norms compared.

Framework-free: the workers (`normkit.bench.model.worker`) get a `ModelConfig` as JSON and build
the same model from it in torch, Keras and Flax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from normkit.spec import NormSpec

EPS = 1e-5
"""eps of every norm with a statistic (Llama 2's), whatever the framework's default."""
PARTIAL_P = 0.0625
"""pRMSNorm's fraction, the RMSNorm paper's 6.25 %."""

OWN_NORMS = ("own-layer", "own-rms")
"""The framework's own LayerNorm and RMSNorm (torch.nn, keras.layers, flax.nnx)."""
NORMKIT_NORMS = ("layer", "rms", "partial-rms", "dyt")
"""normkit's LayerNorm, RMSNorm, PartialRMSNorm (p = `PARTIAL_P`) and DyT."""
NORMS = (*OWN_NORMS, *NORMKIT_NORMS)
IDENTITY = "identity"
"""No norm: every norm replaced by the identity, timed to see what the norms cost (the norm's
share of a step is ``1 - t(identity) / t(norm)``); trained beside them, left out of the loss
figure."""
VARIANTS = (*NORMS, IDENTITY)
MODES = ("eager", "compiled")
SPECS: dict[str, NormSpec] = {
    "own-layer": NormSpec("layer", eps=EPS),
    "own-rms": NormSpec("rms", eps=EPS),
    "layer": NormSpec("layer", eps=EPS),
    "rms": NormSpec("rms", eps=EPS),
    "partial-rms": NormSpec("partial_rms", eps=EPS, p=PARTIAL_P),
    "dyt": NormSpec("dyt"),
}
"""What each norm computes: the framework's own layers compute the same as normkit's of their
kind (eps set explicitly, LayerNorm's variance in two passes)."""


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only, Llama-like language model and the sorting task it learns.

    The model: token embedding, ``layers`` blocks of (pre-norm, causal multi-head attention with
    rotary embeddings, residual; pre-norm, gated SiLU MLP, residual), a final norm and an untied
    linear head; no biases outside the norms. The task (`normkit.bench.model.data`): ``items``
    random symbols of ``symbols``, a separator, then the same symbols sorted; the loss is the
    cross-entropy of the sorted half. The optimizer: AdamW (``betas``, ``adam_eps``,
    ``weight_decay`` on the matrices only), the learning rate warming up linearly over
    ``warmup_steps`` to ``learning_rate``, then a cosine decay to a tenth of it at ``steps``.

    ``steps`` compiled training steps per norm (the loss curves), ``eager_steps`` eager ones
    (``timing_warmup`` of each mode's timed steps left out of the medians).
    """

    symbols: int = 32
    items: int = 16
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    d_ff: int = 352
    batch: int = 32
    steps: int = 200
    eager_steps: int = 10
    timing_warmup: int = 2
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    weight_decay: float = 0.1
    init_std: float = 0.02
    norm_jitter: float = 0.05
    rope_base: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ValueError(
                f"d_model={self.d_model} must split into {self.heads} heads of an even size"
            )
        for name in ("symbols", "items", "layers", "d_ff", "batch", "steps", "eager_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.timing_warmup < 0 or self.timing_warmup >= min(self.steps, self.eager_steps):
            raise ValueError(
                f"timing_warmup={self.timing_warmup} must leave timed steps of the "
                f"{min(self.steps, self.eager_steps)} of each mode"
            )

    @property
    def vocab(self) -> int:
        """The symbols and the separator."""
        return self.symbols + 1

    @property
    def seq_len(self) -> int:
        """The model's input length: the symbols, the separator, all but the last sorted one."""
        return 2 * self.items

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    def norm_paths(self) -> list[str]:
        """The norms' paths in the model, the same in every framework (see docs/porting.md)."""
        blocks = [
            f"blocks.{i}.{name}" for i in range(self.layers)
            for name in ("attention_norm", "mlp_norm")
        ]
        return [*blocks, "norm"]

    def learning_rate_at(self, step: Any, ops: Any = np) -> Any:
        """The learning rate of step ``step`` (0-based, a float), with ``ops`` the array module
        that computes it (``numpy``, ``jax.numpy`` or ``keras.ops``): written once for every
        framework's scheduler."""
        warm = (step + 1) / self.warmup_steps
        progress = (step + 1 - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        progress = ops.minimum(ops.maximum(progress, 0.0), 1.0)
        cosine = 0.1 + 0.9 * 0.5 * (1.0 + ops.cos(math.pi * progress))
        return self.learning_rate * ops.minimum(warm, cosine)

    def step0_tolerance(self) -> float:
        """The largest difference two correct float32 implementations of this model may show
        in the loss of the same weights and batch (step 0), by the standard bound on rounding.

        A dot product of ``K`` terms rounded in any order errs by at most ``K u`` relative to
        the sum of its terms' magnitudes (``u = 2**-24``); an elementwise op (exp, tanh, rsqrt,
        SiLU) by a few ``u``, taken as 8 per op along a layer. Along the path to a logit the
        errors add (each block adds to the residual stream; the norms' and softmax's Jacobians
        are bounded by 1 on the normalized scale), so the logits err by at most ``u`` times
        ``E = layers * (3 d + head_dim + seq_len + d + 2 d + d_ff + 8 * 8) + d`` in units of
        their terms' magnitude (taken as 1: unit-scale normalized activations times weights of
        standard deviation ``init_std * sqrt(K)`` at most 1 here). Cross-entropy is 2-Lipschitz
        in the logits' max-norm, and the mean over ``batch * items`` targets adds
        ``batch * items * u`` times the loss (at most ``log(vocab)`` at the start, taken as 2
        of it). So ``tol = u * (2 E + 2 log(vocab) batch items)``.
        """
        u = 2.0**-24
        d = self.d_model
        path = self.layers * (3 * d + self.head_dim + self.seq_len + d + 2 * d + self.d_ff + 64)
        path += d
        return u * (2 * path + 2 * math.log(self.vocab) * self.batch * self.items)


SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        symbols=12, items=6, d_model=32, layers=2, heads=2, d_ff=64, batch=8, steps=6,
        eager_steps=6, timing_warmup=1, learning_rate=1e-2, warmup_steps=2,
    ),
    "cpu": ModelConfig(),
    "gpu": ModelConfig(
        symbols=256, items=256, d_model=1024, layers=2, heads=16, d_ff=2816, batch=16, steps=10,
        eager_steps=6, timing_warmup=2, learning_rate=1e-3, warmup_steps=5,
    ),
}
"""``tiny``: the tests' (seconds); ``cpu``: the default, a few minutes on 2 cores; ``gpu``:
large enough that a step on a GPU is bound by its kernels, not by the host."""


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """``config`` as JSON-ready data."""
    return dataclasses.asdict(config)


def config_from_dict(data: Mapping[str, Any]) -> ModelConfig:
    """The inverse of `config_to_dict`."""
    values = dict(data)
    values["betas"] = tuple(values["betas"])
    return ModelConfig(**values)
