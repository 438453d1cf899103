"""Where normkit.jax's time goes against Flax's on a device: per layer, dtype and pass, the
jitted median and what XLA compiled for it there (fusions, conditionals, the entry
computation), the cost of one ``lax.cond`` on its own, what each piece of normkit's guard
costs (`variants`), and candidate RMSNorm forwards that guard without a conditional
(`without_cond`).

python3 scripts/jax_probe.py [--out FILE] [--rows R --hidden N]   (JAX's default device; one
JSON line per figure)

The passes are the bench's (forward; forward+backward as a ``vjp`` given dy) and the training
form, the gradient of a loss inside the same program, where dy never reaches memory unless
something makes XLA write it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import normkit.jax as nkjax
from normkit import NormSpec, reference
from normkit.bench.timing import interleaved
from normkit.jax import functional

WARMUP = 2
ROUNDS = 20
EPS = 1e-6
ENTRY_LINES = 60


class Log:
    def __init__(self, path: str) -> None:
        self.file = open(path, "w")

    def __call__(self, **record: Any) -> None:
        line = json.dumps(record)
        print(line if len(line) < 400 else line[:400] + " ...", flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def medians_ms(candidates: Mapping[str, Callable[[], Any]]) -> dict[str, float]:
    """Each candidate's median in ms, timed side by side (`normkit.bench.timing`)."""
    blocking = {name: partial(_finished, fn) for name, fn in candidates.items()}
    timings = interleaved(blocking, warmup=WARMUP, repeats=ROUNDS)
    return {name: t.median_s * 1e3 for name, t in timings.items()}


def _finished(fn: Callable[[], Any]) -> Any:
    return jax.block_until_ready(fn())


def entry(text: str) -> list[str]:
    """The entry computation's instructions, without metadata."""
    lines = text[text.index("\nENTRY ") :].splitlines()[1:]
    body = [re.sub(r", metadata=\{[^}]*\}|, backend_config=.*$", "", line.strip())
            for line in lines[: lines.index("}")]]
    return body


def programs(module: nn.Module, x: jax.Array) -> dict[str, tuple[Callable[..., Any], tuple]]:
    params = module.init(jax.random.key(0), x[:1])
    dy = jnp.ones_like(x)

    def vjp(p: Any, v: jax.Array, dy: jax.Array) -> Any:
        y, pullback = jax.vjp(module.apply, p, v)
        return y, pullback(dy)

    def loss(p: Any, v: jax.Array) -> jax.Array:
        y: jax.Array = module.apply(p, v)  # type: ignore[assignment]
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return {
        "forward": (module.apply, (params, x)),
        "forward+backward": (vjp, (params, x, dy)),
        "training (grad of a loss)": (jax.grad(loss, argnums=(0, 1)), (params, x)),
    }


def layers(log: Log, rows: int, hidden: int) -> None:
    """The bench's pairs: y in x's dtype, eps 1e-6, normkit's LayerNorm with its two-pass
    variance."""
    for dtype in ("float32", "bfloat16"):
        pairs = {
            "RMSNorm": (nkjax.RMSNorm(epsilon=EPS, output_dtype="input"),
                        nn.RMSNorm(epsilon=EPS, dtype=dtype)),
            "LayerNorm": (nkjax.LayerNorm(epsilon=EPS, output_dtype="input", variance="two_pass"),
                          nn.LayerNorm(epsilon=EPS, dtype=dtype)),
        }
        x = jax.random.normal(jax.random.key(1), (rows, hidden), jnp.float32).astype(dtype)
        for layer, (ours, theirs) in pairs.items():
            mine, flax_own = programs(ours, x), programs(theirs, x)
            for form in mine:
                record: dict[str, Any] = {"dtype": dtype, "layer": layer, "pass": form}
                runs = {}
                for who, (fn, args) in (("normkit", mine[form]), ("flax", flax_own[form])):
                    runs[who], record[who] = compiled_record(fn, args)
                for who, ms in medians_ms(runs).items():
                    record[who]["ms"] = ms
                record["ratio"] = record["flax"]["ms"] / record["normkit"]["ms"]
                log(**record)


def compiled_record(fn: Callable[..., Any], args: tuple) -> tuple[Callable[[], Any], dict]:
    """``fn`` compiled for ``args``, ready to time, and its fusions, conditionals and entry."""
    compiled = jax.jit(fn).lower(*args).compile()
    text = compiled.as_text()
    assert text is not None
    body = entry(text)
    return partial(compiled, *args), {
        "fusions": sum(" fusion(" in line for line in body),
        "conditionals": sum(" conditional(" in line for line in body),
        "entry": body[:ENTRY_LINES],
    }


def variants(log: Log, rows: int, hidden: int) -> None:
    """normkit's float32 forward and forward+backward as shipped, with the flags reading
    statistics of their own (`functional._fused_apart`, on the CPU only as shipped), and with
    the guard's branch removed (`functional._patched` passing the plain result through: wrong
    for rows that need the careful program, none here), against Flax: what the conditional and
    the statistics' second reader each cost on this device."""
    x = jax.random.normal(jax.random.key(1), (rows, hidden), jnp.float32)
    shipped = (functional._fused_apart, functional._patched)
    pieces = {
        "as shipped": shipped,
        "flags apart": (lambda v, plan: True, shipped[1]),
        "no branch": (shipped[0], lambda bad, value, fix: value),
        "flags apart, no branch": (lambda v, plan: True, lambda bad, value, fix: value),
    }
    for layer, ours, theirs in (
        ("RMSNorm", nkjax.RMSNorm(epsilon=EPS, output_dtype="input"), nn.RMSNorm(epsilon=EPS)),
        ("LayerNorm", nkjax.LayerNorm(epsilon=EPS, output_dtype="input", variance="two_pass"),
         nn.LayerNorm(epsilon=EPS)),
    ):
        for form in ("forward", "forward+backward"):
            runs, record = {}, {}
            for name, (fused_apart, patched) in pieces.items():
                functional._fused_apart, functional._patched = fused_apart, patched
                try:
                    runs[name], record[name] = compiled_record(*programs(ours, x)[form])
                finally:
                    functional._fused_apart, functional._patched = shipped
            runs["flax"], record["flax"] = compiled_record(*programs(theirs, x)[form])
            for name, ms in medians_ms(runs).items():
                record[name]["ms"] = ms
                del record[name]["entry"]
            log(dtype="float32", layer=layer, variants=form, **record)


def rms_without_cond(x: jax.Array, g: jax.Array, eps: float) -> jax.Array:
    """A candidate RMSNorm forward (eps inside) that serves rows whose squares overflow or
    underflow float32 without a conditional: each row scaled by the power of two ``2^-e`` that
    brings its largest magnitude into [1/2, 1) (exact), its mean square taken there, and
    ``y = x 2^-e / sqrt(mean((x 2^-e)^2) + eps 4^-e)``, the same value; where ``eps 4^-e``
    overflows (tiny rows), eps dwarfs the mean square, taken back unscaled. Two dependent row
    reductions and the output, nothing read back to the host: a softmax's pattern, which XLA
    on a GPU may compile into one fusion."""
    v = x.astype(jnp.float32)
    largest = jnp.max(jnp.abs(v), axis=-1, keepdims=True)
    e = jnp.where(jnp.isfinite(largest) & (largest > 0), jnp.frexp(largest)[1], 0)
    scaled = v * jnp.ldexp(jnp.float32(1), -e)
    square = jnp.mean(scaled * scaled, axis=-1, keepdims=True)
    eps_scaled = jnp.ldexp(jnp.float32(eps), -2 * e)
    y_hat = jnp.where(jnp.isinf(eps_scaled), v * lax.rsqrt(jnp.ldexp(square, 2 * e) + eps),
                      scaled * lax.rsqrt(square + eps_scaled))
    return (y_hat * g).astype(x.dtype)


#: The powers of two of `rms_sibling_sums`: x 2^-80 squares below float32's maximum for any
#: finite x (the mean square of 2^-80 FLT_MAX is 8e28), and x 2^80 squares to normal float32
#: numbers down to |x| near 1e-30.
DOWN, UP = 2.0**-80, 2.0**80
FLT_MAX = float(np.finfo(np.float32).max)


def rms_sibling_sums(x: jax.Array, g: jax.Array, eps: float) -> jax.Array:
    """A candidate RMSNorm forward (eps inside) with neither a conditional nor a second,
    dependent reduction: the mean square of each row taken at scales 1, 2^-80 and 2^80 in one
    pass over x (sibling reductions, which XLA on a GPU can fuse into one), and each row
    normalized as ``y = x c / sqrt(mean((x c)^2) + eps c^2)`` (the same value for every c) with
    the one in float32's range: 2^-80 where the squares overflow, 2^80 where they underflow (a
    mean square below 2^-100) and ``eps 2^160`` is finite, else 1. Where ``eps 2^160``
    overflows, eps dwarfs such a row's mean square, and scale 1 serves it."""
    v = x.astype(jnp.float32)

    def normalized(c: float) -> tuple[jax.Array, jax.Array]:
        scaled = v * jnp.float32(c)
        square = jnp.mean(scaled * scaled, axis=-1, keepdims=True)
        return square, scaled * lax.rsqrt(square + jnp.float32(eps * c * c))

    square, y_hat = normalized(1.0)
    square_down, y_down = normalized(DOWN)
    y_hat = jnp.where(jnp.isinf(square) & jnp.isfinite(square_down), y_down, y_hat)
    if eps * UP * UP <= FLT_MAX:
        _, y_up = normalized(UP)
        y_hat = jnp.where(square < 2.0**-100, y_up, y_hat)
    return (y_hat * g).astype(x.dtype)


#: Rows of the candidates' accuracy check: ordinary, squares overflowing, squares underflowing.
FAR_SCALES = (1.0, 1e30, 1e-30, 1e-20, 1e37)
#: float32's smallest normal eps: with it tiny rows are not eps's (`rms_sibling_sums`' 2^80).
TINY_EPS = 2.0**-126
#: The conditional-free candidates, as the records name them.
CANDIDATES = {"without cond": rms_without_cond, "sibling sums": rms_sibling_sums}


def without_cond(log: Log, rows: int, hidden: int) -> None:
    """The `CANDIDATES` against normkit's RMSNorm as shipped and Flax's (forward, float32 and
    bfloat16): their times and what XLA compiled, and each one's worst error against the
    reference on rows at `FAR_SCALES` (a fraction of the row's largest reference value)."""
    rng = np.random.default_rng(0)
    far = (rng.standard_normal((len(FAR_SCALES), 64))
           * np.array(FAR_SCALES)[:, None]).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    wants = {eps: reference.normalize(far.astype(np.float64), NormSpec(eps=eps),
                                      g.astype(np.float64)) for eps in (EPS, TINY_EPS)}
    for candidate, (eps, want) in itertools.product(CANDIDATES.values(), wants.items()):
        got = np.asarray(jax.jit(candidate, static_argnums=2)(far, g, eps), np.float64)
        errors = np.max(np.abs(got - want), axis=1) / np.max(np.abs(want), axis=1)
        log(what=f"{candidate.__name__} error", eps=eps, scales=list(FAR_SCALES),
            errors=errors.tolist())
    for dtype in ("float32", "bfloat16"):
        x = jax.random.normal(jax.random.key(1), (rows, hidden), jnp.float32).astype(dtype)
        scale = jnp.ones((hidden,), jnp.float32)
        runs, record = {}, {}
        for name, module in (("normkit", nkjax.RMSNorm(epsilon=EPS, output_dtype="input")),
                             ("flax", nn.RMSNorm(epsilon=EPS, dtype=dtype))):
            runs[name], record[name] = compiled_record(*programs(module, x)["forward"])
        for name, candidate in CANDIDATES.items():
            runs[name], record[name] = compiled_record(partial(candidate, eps=EPS), (x, scale))
        for name, ms in medians_ms(runs).items():
            record[name]["ms"] = ms
            del record[name]["entry"]
        log(dtype=dtype, layer="RMSNorm", candidate="forward", **record)


def cond_cost(log: Log, rows: int, hidden: int) -> None:
    """One ``lax.cond`` on a flag computed on the device, against the same work without it."""
    x = jnp.ones((rows, hidden), jnp.float32)

    def plain(v: jax.Array) -> jax.Array:
        return v * 2

    def branched(v: jax.Array) -> jax.Array:
        y = v * 2
        return lax.cond(jnp.any(v[:, 0] > 1e30), lambda y: y + 1, lambda y: y, y)

    runs = {name: partial(jax.jit(fn), x) for name, fn in (("without cond", plain),
                                                          ("with cond", branched))}
    for name, ms in medians_ms(runs).items():
        log(what=f"x * 2 {name}", ms=ms)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="jax-probe.jsonl")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    log = Log(args.out)
    log(device=str(jax.devices()[0]), jax=jax.__version__)
    started = time.perf_counter()
    cond_cost(log, args.rows, args.hidden)
    without_cond(log, args.rows, args.hidden)  # before the variants: the newest question
    variants(log, args.rows, args.hidden)
    layers(log, args.rows, args.hidden)
    log(seconds=round(time.perf_counter() - started, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
