"""The model in Flax NNX: an ``nnx.Module`` trained with ``optax.adamw`` through
``nnx.Optimizer``, the whole step (forward, backward, update) op by op (eager) or under
``nnx.jit`` (compiled).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import normkit.jax.nnx as nk
from normkit import port
from normkit.bench.model.config import EPS, NORMKIT_NORMS, OWN_NORMS, PARTIAL_P, ModelConfig
from normkit.bench.model.data import Batches
from normkit.bench.model.weights import norms_file, read_matrices, read_norms, rope
from normkit.bridges import JaxBridge

COMPILER = "nnx.jit"
_BRIDGE = JaxBridge()
devices = _BRIDGE.devices


class Identity(nnx.Module):
    """No norm."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


class Constant(nnx.Variable[jax.Array]):
    """A value the model reads and nothing trains (the rotary tables)."""


Factory = Callable[[int, nnx.Rngs], nnx.Module]
# normkit's layers return the input's dtype (``output_dtype="input"``), the rule the norms file
# records (torch's and Keras'); Flax's rule, the promoted dtype, is the same in float32.
LAYERS: dict[str, tuple[str, Factory]] = {
    "own-layer": ("flax.nnx.LayerNorm", lambda d, rngs: nnx.LayerNorm(
        d, epsilon=EPS, use_fast_variance=False, rngs=rngs)),
    "own-rms": ("flax.nnx.RMSNorm", lambda d, rngs: nnx.RMSNorm(d, epsilon=EPS, rngs=rngs)),
    "layer": ("normkit.jax.nnx.LayerNorm", lambda d, rngs: nk.LayerNorm(
        d, epsilon=EPS, use_fast_variance=False, output_dtype="input", rngs=rngs)),
    "rms": ("normkit.jax.nnx.RMSNorm", lambda d, rngs: nk.RMSNorm(
        d, epsilon=EPS, output_dtype="input", rngs=rngs)),
    "partial-rms": ("normkit.jax.nnx.PartialRMSNorm", lambda d, rngs: nk.PartialRMSNorm(
        d, p=PARTIAL_P, epsilon=EPS, output_dtype="input", rngs=rngs)),
    "dyt": ("normkit.jax.nnx.DyT", lambda d, rngs: nk.DyT(d, output_dtype="input", rngs=rngs)),
    "identity": ("identity", lambda d, rngs: Identity()),
}


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding, rotate-half layout; ``x`` ``(batch, seq, heads, head_dim)``."""
    first, second = jnp.split(x, 2, axis=-1)
    return x * cos[:, None] + jnp.concatenate([-second, first], axis=-1) * sin[:, None]


class Attention(nnx.Module):
    """Causal multi-head self-attention with rotary embeddings, no biases."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        d = config.d_model
        self.heads = config.heads
        self.query, self.key, self.value, self.out = (
            nnx.Linear(d, d, use_bias=False, rngs=rngs) for _ in range(4)
        )

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        batch, seq, d = x.shape
        q, k, v = (
            layer(x).reshape(batch, seq, self.heads, d // self.heads)
            for layer in (self.query, self.key, self.value)
        )
        y = jax.nn.dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                         is_causal=True)
        out: jax.Array = self.out(y.reshape(batch, seq, d))
        return out


class MLP(nnx.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        d, ff = config.d_model, config.d_ff
        self.gate = nnx.Linear(d, ff, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, ff, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(ff, d, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        out: jax.Array = self.down(nnx.silu(self.gate(x)) * self.up(x))
        return out


class Block(nnx.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, config: ModelConfig, norm: Factory, rngs: nnx.Rngs) -> None:
        self.attention_norm = norm(config.d_model, rngs)
        self.attention = Attention(config, rngs)
        self.mlp_norm = norm(config.d_model, rngs)
        self.mlp = MLP(config, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LanguageModel(nnx.Module):
    """Embedding, blocks, final norm, untied head: token ids to next-token logits."""

    def __init__(self, config: ModelConfig, norm: Factory, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(config.vocab, config.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(config, norm, rngs) for _ in range(config.layers)])
        self.norm = norm(config.d_model, rngs)
        self.head = nnx.Linear(config.d_model, config.vocab, use_bias=False, rngs=rngs)
        cos, sin = rope(config)
        self.cos, self.sin = Constant(jnp.asarray(cos)), Constant(jnp.asarray(sin))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos.get_value(), self.sin.get_value())
        logits: jax.Array = self.head(self.norm(x))
        return logits


def implementation(norm: str) -> str:
    """The name of the norm layer the model uses for ``norm``."""
    return LAYERS[norm][0]


def _at(model: nnx.Module, path: str) -> Any:
    node: Any = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def build(config: ModelConfig, norm: str, folder: Path) -> LanguageModel:
    """The model with norm ``norm``, its weights those written in ``folder``: the matrices by
    path (``nnx.Linear``'s ``kernel``, ``nnx.Embed``'s ``embedding``), the norms with
    `normkit.port`."""
    model = LanguageModel(config, LAYERS[norm][1], nnx.Rngs(config.seed))
    for path, value in read_matrices(folder).items():
        layer = _at(model, path)
        (layer.embedding if path == "embed" else layer.kernel).set_value(jnp.asarray(value))
    if norm in OWN_NORMS:
        for path, params in read_norms(folder, norm, "flax").items():
            for name, value in params.items():
                getattr(_at(model, path), name).set_value(jnp.asarray(value))
    if norm in NORMKIT_NORMS:
        port.import_norms(model, norms_file(folder, norm))
    return model


def _train_step(model: LanguageModel, optimizer: nnx.Optimizer, inputs: jax.Array,
                targets: jax.Array, weights: jax.Array) -> jax.Array:
    def loss_fn(model: LanguageModel) -> jax.Array:
        losses = optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets)
        return jnp.sum(losses * weights) / jnp.sum(weights)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


class Trainer:
    """Trains one model on the batches, one step per call, with AdamW (weight decay on the
    matrices only) and the config's schedule."""

    def __init__(self, config: ModelConfig, norm: str, compiled: bool, folder: Path,
                 data: Batches, device: str) -> None:
        where = _BRIDGE.device(device)
        with jax.default_device(where):
            self.model = build(config, norm, folder)
            schedule = lambda count: config.learning_rate_at(count.astype(jnp.float32), jnp)  # noqa: E731
            tx = optax.adamw(
                schedule, b1=config.betas[0], b2=config.betas[1], eps=config.adam_eps,
                weight_decay=config.weight_decay,
                mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
            )
            self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)
        # Committed to the device, as the step's outputs will be: else the second step compiles
        # the step again.
        state = nnx.state((self.model, self.optimizer))
        nnx.update((self.model, self.optimizer), jax.device_put(state, where))
        self.train_step = nnx.jit(_train_step) if compiled else _train_step
        self.inputs = list(jax.device_put(data.inputs, where))
        self.targets = list(jax.device_put(data.targets, where))
        self.weights = jax.device_put(jnp.broadcast_to(data.weights, data.inputs.shape[1:]), where)

    def step(self, index: int) -> float:
        """One training step on batch ``index``; the loss before the update."""
        loss = self.train_step(
            self.model, self.optimizer, self.inputs[index], self.targets[index], self.weights
        )
        return float(loss)


def versions() -> dict[str, str]:
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__}


def device_kind(device: str) -> str:
    """What ``device`` is: JAX's device kind (the GPU's name), or ``cpu``."""
    return "cpu" if device == "cpu" else str(_BRIDGE.device(device).device_kind)
