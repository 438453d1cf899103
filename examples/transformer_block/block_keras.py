"""The block in Keras 3, with the torch block's attribute names (so the norms' paths match)."""

from __future__ import annotations

import math

import keras
from keras import ops

import normkit.tf as nk

from block_config import Config


class Attention(keras.layers.Layer):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.heads = c.heads
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, keras.layers.Dense(c.dim, use_bias=False))

    def call(self, x):
        b, t, d = ops.shape(x)
        q, k, v = (ops.transpose(ops.reshape(p(x), (b, t, self.heads, -1)), (0, 2, 1, 3))
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) / math.sqrt(d // self.heads)
        causal = ops.tril(ops.ones((t, t), "bool"))
        weights = ops.softmax(ops.where(causal, scores, float("-inf")), axis=-1)
        out = ops.reshape(ops.transpose(ops.matmul(weights, v), (0, 2, 1, 3)), (b, t, d))
        return self.o_proj(out)


class MLP(keras.layers.Layer):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.gate_proj = keras.layers.Dense(c.hidden, use_bias=False)
        self.up_proj = keras.layers.Dense(c.hidden, use_bias=False)
        self.down_proj = keras.layers.Dense(c.dim, use_bias=False)

    def call(self, x):
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(keras.layers.Layer):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.input_layernorm = nk.from_spec(c.rms)
        self.attn = Attention(c)
        self.post_attention_layernorm = nk.from_spec(c.rms)
        self.mlp = MLP(c)
        self.norm = nk.from_spec(c.final)

    def call(self, x):
        x = x + self.attn(self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.norm(x)
