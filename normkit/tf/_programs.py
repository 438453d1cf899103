"""How the layers' programs are shaped for the compilers and for autodiff: passes that read
copies of their own under XLA's CPU backend, a ``cond`` compiled once on JAX, branches whose
backward pass recomputes their values, and a gradient redirected to an equal tensor.

None of these changes a value; each changes what a compiler writes out or fuses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
from keras import ops

__all__ = ["cond", "gradient_to", "recomputed", "separately", "separating"]


def separating(traced: bool) -> bool:
    """Whether passes over the same tensors should each read copies of their own (`separately`):
    in a program traced for XLA's CPU backend on Keras' JAX backend, which runs a reduction as a
    YNNPACK fusion that takes what another fusion reads too (the float32 conversion of a half
    input, parameters and row statistics broadcast to its shape) as an array written out."""
    if not traced or keras.backend.backend() != "jax":
        return False
    import jax

    return bool(jax.default_backend() == "cpu")


def separately(f: Any, values: tuple[Any, ...], count: int, traced: bool) -> list[Any]:
    """``count`` results of ``f(*values)`` (tensors, None allowed), one for each pass that reads
    them: where `separating`, each formed from copies of its own of ``values``, through one
    optimization barrier, so that each pass converts and broadcasts inside; elsewhere one result
    serves all."""
    if separating(traced):
        import jax

        return [f(*copy) for copy in jax.lax.optimization_barrier((values,) * count)]
    return [f(*values)] * count


def cond(pred: Any, true_fn: Any, false_fn: Any, *operands: Any) -> Any:
    """``true_fn(*operands)`` where the traced ``pred`` holds, else ``false_fn(*operands)``. On
    JAX the operands go to `jax.lax.cond` as its arguments: the same functions then give the
    same program, compiled once even outside ``jit`` (where ``jax.vjp`` traces a backward on
    every call, and a cond of fresh closures is compiled anew each time)."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.lax.cond(pred, true_fn, false_fn, *operands)
    return ops.cond(pred, lambda: true_fn(*operands), lambda: false_fn(*operands))


def recomputed(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` (of tensors) whose backward pass recomputes its values instead of keeping them:
    `keras.remat`, or on TensorFlow a custom gradient that differentiates ``f`` again under a
    tape (``tf.recompute_grad`` fails inside a traced ``cond``)."""
    if keras.backend.backend() != "tensorflow":
        return keras.remat(f)
    import tensorflow as tf

    @tf.custom_gradient
    def recomputed(*args: Any) -> Any:
        def grad(*upstream: Any) -> Any:
            # Only the floating arguments are watched: a tape warns of any other (the rows'
            # boolean marks), and they have no gradient.
            floating = [a for a in args if a.dtype.is_floating]
            with tf.GradientTape() as tape:
                tape.watch(floating)
                y = f(*args)
            grads = iter(tape.gradient(y, floating, output_gradients=upstream))
            return [next(grads) if a.dtype.is_floating else None for a in args]

        return f(*args), grad

    return recomputed


def gradient_to(value: Any, target: Any) -> Any:
    """``value``, whose gradient goes to ``target`` (a tensor equal to it) instead: under XLA
    a branch then reads ``value``'s inputs (a half input, cast inside the fused pass) rather
    than a float32 copy, while the gradient meets the others at ``target``. ``target`` itself
    on backends other than TensorFlow."""
    if keras.backend.backend() != "tensorflow":
        return target
    import tensorflow as tf

    @tf.custom_gradient
    def through(value: Any, target: Any) -> Any:
        def grad(upstream: Any) -> tuple[Any, Any]:
            return None, upstream

        return tf.identity(value), grad

    return through(value, target)
