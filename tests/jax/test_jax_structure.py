"""A structural guard on normkit.jax's speed that times nothing: the compiled program of the
jitted forward and forward+backward makes no more passes over x-sized arrays than Flax's own
layer's. A pass is an instruction of the entry computation that reads or writes an array of x's
size; a conditional counts its cheapest branch (the common case's, which must not recompute or
copy what the branch skips)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import normkit.jax as nkjax
from tests.helpers.hlo import float32_copies, passes, writes


def _compiled_passes(module: nn.Module, x: jax.Array, run: Callable[[Any, jax.Array], Any]
                     ) -> int:
    """Passes over x of ``run(params, x)`` compiled by jit, with ``module``'s parameters."""
    params = module.init(jax.random.key(0), x[:1])
    return passes(jax.jit(run).lower(params, x).compile().as_text(), x.size)


def _program_passes(module: nn.Module, x: jax.Array, backward: bool) -> int:
    if backward:

        def run(params, x):
            y, vjp = jax.vjp(module.apply, params, x)
            return y, vjp(jnp.ones_like(y))

    else:

        def run(params, x):
            return module.apply(params, x)

    return _compiled_passes(module, x, run)


PAIRS = {
    "rms": (nkjax.RMSNorm, nn.RMSNorm, {}),
    "layer_fast": (nkjax.LayerNorm, nn.LayerNorm, {}),
    "layer_two_pass": (nkjax.LayerNorm, nn.LayerNorm, {"use_fast_variance": False}),
}


CASES = [
    pytest.param(pair, backward, id=f"{pair}-{'fwd+bwd' if backward else 'fwd'}")
    for pair in PAIRS
    for backward in (False, True)
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pair, backward", CASES)
def test_no_more_passes_over_x_than_flax(pair: str, backward: bool, dtype: str) -> None:
    ours, theirs, kwargs = PAIRS[pair]
    x = jnp.ones((64, 512), dtype)
    mine = _program_passes(ours(**kwargs), x, backward)
    flax_own = _program_passes(theirs(**kwargs), x, backward)
    assert mine <= flax_own, f"normkit {mine} passes over x, Flax {flax_own}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_option_makes_as_many_passes_as_the_default(dtype: str) -> None:
    """Llama's cast order, Gemma's offset, eps outside, a bias and partial RMS (eps inside and
    outside; its statistic reads the first k elements, not a masked copy of the row) compile to
    the default's passes (their costs are per element, not per pass)."""
    x = jnp.ones((64, 512), dtype)
    default = [_program_passes(nkjax.RMSNorm(), x, b) for b in (False, True)]
    for module in (
        nkjax.RMSNorm(cast="before_scale"),
        nkjax.RMSNorm(scale_offset=1.0),
        nkjax.RMSNorm(eps_placement="outside"),
        nkjax.RMSNorm(use_bias=True),
        nkjax.PartialRMSNorm(p=0.25),
        nkjax.PartialRMSNorm(p=0.25, eps_placement="outside"),
    ):
        passes = [_program_passes(module, x, b) for b in (False, True)]
        allowed = [d + (1 if module.use_bias else 0) for d in default]
        assert all(p <= a for p, a in zip(passes, allowed, strict=True)), (module, passes, allowed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_two_pass_variance_makes_no_more_passes_than_flaxs_fast_variance(
    dtype: str, backward: bool
) -> None:
    """The two-pass variance reads x once more than ``mean(x^2) - mean^2``, no more: the mean
    reaches the variance's reduction as a row scalar, not as a broadcast array XLA writes out
    (4 passes against Flax's 3 in the forward, before)."""
    x = jnp.ones((64, 512), dtype)
    mine = _program_passes(nkjax.LayerNorm(variance="two_pass"), x, backward)
    flax_fast = _program_passes(nn.LayerNorm(use_fast_variance=True), x, backward)
    assert mine <= flax_fast, f"normkit {mine} passes over x, Flax's fast variance {flax_fast}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pair", PAIRS)
def test_many_rows_forward_fuses_y_as_flax_does(pair: str, dtype: str) -> None:
    """From 4096 rows on XLA's CPU backend computes Flax's forward in one pass over x (the
    statistics and y fused). normkit's y is fused the same way where that pays (a bfloat16 x,
    a float32 LayerNorm); its row flags read x in reductions of their own (one; LayerNorm's
    mean and mean of squares two), and no float32 copy of x is written (sharing the
    statistics with the flags made 3-5 passes). A float32 RMS statistic is shared: one
    reduction, then y."""
    if jax.default_backend() != "cpu":
        pytest.skip("the fusion of a row reduction with its use is XLA's CPU backend's")
    ours, theirs, kwargs = PAIRS[pair]
    x = jnp.ones((4096, 128), dtype)
    mine = _program_passes(ours(**kwargs), x, backward=False)
    flax_own = _program_passes(theirs(**kwargs), x, backward=False)
    flags = 1 if pair == "rms" else 2
    assert mine <= flax_own + flags, f"normkit {mine} passes over x, Flax {flax_own}"


def _training_passes(module: nn.Module, x: jax.Array) -> int:
    def loss(params, x):
        return jnp.sum(module.apply(params, x).astype(jnp.float32) ** 2)

    return _compiled_passes(module, x, jax.grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pair", PAIRS)
def test_the_training_form_makes_at_most_one_pass_more_than_flax(pair: str, dtype: str) -> None:
    """The gradient of a loss in the same program, as a training step takes it: dy never reaches
    memory in Flax's program. normkit's RMS forward passes y through its branch, and XLA's CPU
    reduction fusions then read the cotangent materialized: one pass more than Flax (8 against 7
    in float32); a branch carrying per-row factors only was tried and kept the count. LayerNorm
    makes fewer than Flax."""
    ours, theirs, kwargs = PAIRS[pair]
    x = jnp.ones((64, 512), dtype)
    mine = _training_passes(ours(**kwargs), x)
    flax_own = _training_passes(theirs(**kwargs), x)
    allowed = flax_own + (1 if pair == "rms" else 0)
    assert mine <= allowed, f"normkit {mine} passes over x, Flax {flax_own}"


def _compiled(module: nn.Module, x: jax.Array, backward: bool) -> str:
    """The compiled program of the jitted forward, or forward+backward for a cotangent given as
    an argument (a constant one XLA might fold)."""
    params = module.init(jax.random.key(0), x[:1])

    def forward_backward(params, x, dy):
        y, vjp = jax.vjp(module.apply, params, x)
        return y, vjp(dy)

    if backward:
        lowered = jax.jit(forward_backward).lower(params, x, x)
    else:
        lowered = jax.jit(module.apply).lower(params, x)
    return lowered.compile().as_text()


@pytest.mark.parametrize(
    "module, rows, backward",
    [
        pytest.param(nkjax.RMSNorm(output_dtype="input"), 64, False, id="rms-fwd"),
        pytest.param(nkjax.LayerNorm(output_dtype="input", variance="two_pass"), 64, False,
                     id="layer_two_pass-fwd"),
        pytest.param(nkjax.LayerNorm(output_dtype="input"), 64, False, id="layer_fast-fwd"),
        pytest.param(nkjax.RMSNorm(output_dtype="input"), 64, True, id="rms-fwd+bwd"),
        pytest.param(nkjax.RMSNorm(output_dtype="input"), 4096, True,
                     id="rms-fwd+bwd-4096-rows"),
        pytest.param(nkjax.PartialRMSNorm(p=0.25, output_dtype="input"), 64, True,
                     id="partial-fwd+bwd"),
    ],
)
def test_a_bfloat16_x_is_not_written_out_as_float32(
    module: nn.Module, rows: int, backward: bool
) -> None:
    """Each reduction reads its own copy of a bfloat16 x (and dy), converted inside it: with a
    bfloat16 output, no float32 array of x's size is made from x or dy (XLA shares one
    conversion otherwise, and writes it out: 128 MiB more to write and read at 8192 x 4096)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the copies are for XLA's CPU backend, which would write the conversion out")
    x = jnp.ones((rows, 128), jnp.bfloat16)
    assert float32_copies(_compiled(module, x, backward), x.size) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [64, 4096])
@pytest.mark.parametrize(
    "module",
    [
        nkjax.RMSNorm(output_dtype="input"),
        nkjax.RMSNorm(output_dtype="input", use_bias=True),
        nkjax.PartialRMSNorm(p=0.25, output_dtype="input"),
        nkjax.LayerNorm(output_dtype="input", variance="two_pass"),
        nkjax.LayerNorm(output_dtype="input"),
        nkjax.RMSNorm(output_dtype="input", eps_placement="outside"),
        nkjax.LayerNorm(output_dtype="input", eps_placement="outside"),
        nkjax.RMSNorm(output_dtype="input", scale_offset=1.0),
        nkjax.RMSNorm(output_dtype="input", cast="before_scale"),
    ],
    ids=["rms", "rms-bias", "partial", "layer_two_pass", "layer_fast", "rms-eps-outside",
         "layer-eps-outside", "rms-gemma-offset", "rms-llama-cast"],
)
def test_forward_backward_writes_no_array_of_xs_size_but_y_and_dx(
    module: nn.Module, rows: int, dtype: str
) -> None:
    """Each of the backward pass's sums, and its input gradient, reads copies of its own of x,
    dy, the scale and the row statistics: XLA's CPU backend writes no x-sized array but ``y``
    and ``dx`` (shared, LayerNorm's program wrote three to six more, RMSNorm's two: a bfloat16
    x's float32 conversion, the scale and the row statistics broadcast to x's shape, the
    centered x, ``y_hat``; each 128 MiB more to write and read at 8192 x 4096)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the copies are for XLA's CPU backend, which writes out what fusions share")
    x = jnp.ones((rows, 128), dtype)
    assert writes(_compiled(module, x, backward=True), x.size) == 2
