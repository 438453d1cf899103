"""The model in Keras 3: a ``keras.Model`` of ``keras.ops``, compiled with ``AdamW`` and trained
with ``train_on_batch``, the whole step (forward, backward, update) eagerly (``run_eagerly``)
or compiled by XLA (``jit_compile``), on the Keras backend of the environment (TensorFlow, its
default; JAX where TensorFlow is not installed).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
from keras import ops

import normkit.tf as nk
from normkit import port
from normkit.bench.model.config import EPS, NORMKIT_NORMS, OWN_NORMS, PARTIAL_P, ModelConfig
from normkit.bench.model.data import Batches
from normkit.bench.model.weights import norms_file, read_matrices, read_norms, rope

COMPILER = "jit_compile"

Factory = Callable[[], keras.layers.Layer]
LAYERS: dict[str, tuple[str, Factory]] = {
    "own-layer": ("keras.layers.LayerNormalization",
                  lambda: keras.layers.LayerNormalization(epsilon=EPS)),
    "own-rms": ("keras.layers.RMSNormalization",
                lambda: keras.layers.RMSNormalization(epsilon=EPS)),
    "layer": ("normkit.tf.LayerNorm", lambda: nk.LayerNorm(epsilon=EPS)),
    "rms": ("normkit.tf.RMSNorm", lambda: nk.RMSNorm(epsilon=EPS)),
    "partial-rms": ("normkit.tf.PartialRMSNorm",
                    lambda: nk.PartialRMSNorm(p=PARTIAL_P, epsilon=EPS)),
    "dyt": ("normkit.tf.DyT", lambda: nk.DyT()),
    "identity": ("keras.layers.Identity", lambda: keras.layers.Identity()),
}
# The Keras names of the norms file's parameters (its "keras" convention names them as
# normkit's layers do).
OWN_WEIGHTS = {"scale": ("gamma", "scale"), "bias": ("beta",)}


def rotate(x: Any, cos: Any, sin: Any) -> Any:
    """Rotary embedding, rotate-half layout; ``x`` ``(batch, seq, heads, head_dim)``."""
    first, second = ops.split(x, 2, axis=-1)
    return x * cos[:, None] + ops.concatenate([-second, first], axis=-1) * sin[:, None]


class Attention(keras.layers.Layer):
    """Causal multi-head self-attention with rotary embeddings, no biases."""

    def __init__(self, config: ModelConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.heads, self.head_dim = config.heads, config.head_dim
        self.query, self.key, self.value, self.out = (
            keras.layers.Dense(config.d_model, use_bias=False) for _ in range(4)
        )

    def call(self, x: Any, cos: Any, sin: Any) -> Any:
        batch, seq, d = ops.shape(x)
        q, k, v = (
            ops.reshape(layer(x), (batch, seq, self.heads, self.head_dim))
            for layer in (self.query, self.key, self.value)
        )
        y = ops.dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.out(ops.reshape(y, (batch, seq, d)))


class MLP(keras.layers.Layer):
    """The gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = keras.layers.Dense(config.d_ff, use_bias=False)
        self.up = keras.layers.Dense(config.d_ff, use_bias=False)
        self.down = keras.layers.Dense(config.d_model, use_bias=False)

    def call(self, x: Any) -> Any:
        return self.down(ops.silu(self.gate(x)) * self.up(x))


class Block(keras.layers.Layer):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, config: ModelConfig, norm: Factory, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attention_norm, self.attention = norm(), Attention(config)
        self.mlp_norm, self.mlp = norm(), MLP(config)

    def call(self, x: Any, cos: Any, sin: Any) -> Any:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LanguageModel(keras.Model):
    """Embedding, blocks, final norm, untied head: token ids to next-token logits."""

    def __init__(self, config: ModelConfig, norm: Factory, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(config.vocab, config.d_model)
        self.blocks = [Block(config, norm) for _ in range(config.layers)]
        self.norm = norm()
        self.head = keras.layers.Dense(config.vocab, use_bias=False)
        self.cos, self.sin = rope(config)

    def call(self, tokens: Any) -> Any:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


class Schedule(keras.optimizers.schedules.LearningRateSchedule):
    """The config's learning rate schedule (`ModelConfig.learning_rate_at`) in ``keras.ops``."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def __call__(self, step: Any) -> Any:
        return self.config.learning_rate_at(ops.cast(step, "float32"), ops)

    def get_config(self) -> dict[str, Any]:
        return {}


class AdamW(keras.optimizers.AdamW):
    """Keras' AdamW, taking the steps torch's and optax's take. Two differences are removed:

    - epsilon: Keras adds it to ``sqrt(v)`` before the bias correction (Kingma and Ba's
      "epsilon hat"), torch and optax to ``sqrt(v / (1 - beta_2**t))``; here Keras gets
      ``epsilon * sqrt(1 - beta_2**t)``, the same. The difference is not small: at the start,
      attention's query and key gradients are near epsilon.
    - sparse gradients: on TensorFlow an ``Embedding``'s gradient is a ``tf.IndexedSlices``,
      one slice per occurrence of a token, and Keras' Adam squares the slices before summing
      those of one row, so the second moment of a token seen k times is a sum of k squares, not
      the square of the sum. Made dense first, every row is updated as torch and optax do.
    """

    @property
    def epsilon(self) -> Any:
        step = ops.cast(self.iterations + 1, "float32")
        return self._epsilon * ops.sqrt(1.0 - ops.power(self.beta_2, step))

    @epsilon.setter
    def epsilon(self, value: float) -> None:
        self._epsilon = value

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        if backend() == "tensorflow":
            import tensorflow as tf

            grads = [tf.convert_to_tensor(g) for g in grads]
        return super().apply(grads, trainable_variables)


def implementation(norm: str) -> str:
    """The name of the norm layer the model uses for ``norm``."""
    return LAYERS[norm][0]


def _at(model: keras.layers.Layer, path: str) -> Any:
    node: Any = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def build(config: ModelConfig, norm: str, folder: Path) -> LanguageModel:
    """The model with norm ``norm``, built, its weights those written in ``folder``: the
    matrices by path (``Dense``'s ``kernel``, ``Embedding``'s ``embeddings``), the norms with
    `normkit.port`."""
    model = LanguageModel(config, LAYERS[norm][1])
    model(np.zeros((1, config.seq_len), np.int32))
    for path, value in read_matrices(folder).items():
        layer = _at(model, path)
        (layer.embeddings if path == "embed" else layer.kernel).assign(value)
    if norm in OWN_NORMS:
        for path, params in read_norms(folder, norm, "keras").items():
            layer = _at(model, path)
            for name, value in params.items():
                attribute = next(a for a in OWN_WEIGHTS[name] if hasattr(layer, a))
                getattr(layer, attribute).assign(value)
    if norm in NORMKIT_NORMS:
        port.import_norms(model, norms_file(folder, norm))
    return model


class Trainer:
    """Trains one model on the batches, one step per call (``train_on_batch``), with AdamW
    (weight decay on the matrices only) and the config's schedule."""

    def __init__(self, config: ModelConfig, norm: str, compiled: bool, folder: Path,
                 data: Batches, device: str) -> None:
        self.device = _device(device)
        with keras.device(self.device):
            self.model = build(config, norm, folder)
            optimizer = AdamW(
                learning_rate=Schedule(config), weight_decay=config.weight_decay,
                beta_1=config.betas[0], beta_2=config.betas[1], epsilon=config.adam_eps,
            )
            optimizer.exclude_from_weight_decay(
                var_list=[v for v in self.model.trainable_variables if len(v.shape) < 2]
            )
            loss = keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"
            )
            self.model.compile(optimizer=optimizer, loss=loss, jit_compile=compiled,
                               run_eagerly=not compiled)
        self.inputs, self.targets = data.inputs, data.targets
        self.weights = np.broadcast_to(data.weights, data.inputs.shape[1:]).copy()

    def step(self, index: int) -> float:
        """One training step on batch ``index``; the loss before the update."""
        with keras.device(self.device):
            loss = self.model.train_on_batch(
                self.inputs[index], self.targets[index], sample_weight=self.weights
            )
        return float(loss)


def backend() -> str:
    """The Keras backend in use."""
    return str(keras.backend.backend())


def devices() -> list[str]:
    from normkit.bridges import JaxBridge, TensorFlowBridge

    bridge = TensorFlowBridge() if backend() == "tensorflow" else JaxBridge()
    return bridge.devices()


def _device(device: str) -> str:
    """Keras' name for ``device``: ``cpu:0``, ``gpu:N``."""
    return "cpu:0" if device == "cpu" else device.replace("cuda", "gpu")


def versions() -> dict[str, str]:
    found = {"keras": keras.__version__, "keras backend": backend()}
    if backend() == "tensorflow":
        import tensorflow as tf

        return {**found, "tensorflow": tf.__version__}
    import jax

    return {**found, "jax": jax.__version__, "KERAS_BACKEND": os.environ.get("KERAS_BACKEND", "")}


def device_kind(device: str) -> str:
    """What ``device`` is: the GPU's name, or ``cpu``."""
    if device == "cpu":
        return "cpu"
    if backend() == "tensorflow":
        import tensorflow as tf

        gpu = tf.config.list_physical_devices("GPU")[int(device.split(":")[1])]
        return str(tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name))
    from normkit.bridges import JaxBridge

    return str(JaxBridge().device(device).device_kind)
