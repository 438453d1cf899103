"""The block in Flax NNX, with the torch block's attribute names (so the norms' paths match)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import normkit.jax.nnx as nk

from block_config import Config


class Attention(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs) -> None:
        self.heads = c.heads
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nnx.Linear(c.dim, c.dim, use_bias=False, rngs=rngs))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = (p(x).reshape(b, t, self.heads, -1).transpose(0, 2, 1, 3)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        return self.o_proj((weights @ v).transpose(0, 2, 1, 3).reshape(b, t, d))


class MLP(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs) -> None:
        self.gate_proj = nnx.Linear(c.dim, c.hidden, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(c.dim, c.hidden, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(c.hidden, c.dim, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs) -> None:
        self.input_layernorm = nk.from_spec(c.rms, c.dim)
        self.attn = Attention(c, rngs)
        self.post_attention_layernorm = nk.from_spec(c.rms, c.dim)
        self.mlp = MLP(c, rngs)
        self.norm = nk.from_spec(c.final, c.dim)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.norm(x)
