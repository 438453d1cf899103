"""normkit.jax's Pallas kernels on a device: whether they compute the reference compiled there,
and their time against normkit.jax's XLA program, Flax's layers, Keras' layers on JAX and
normkit.tf on Keras' JAX backend, each jitted, against the copy floor.

python3 scripts/jax_probe.py [--out FILE] [--budget SECONDS] [--shapes 32768x1024,...]
                             [--dtypes float32,bfloat16] [--sections check,layers,...]
                             [--interpret]

One JSON line per record, written as it is measured; the sections run in this order, each
stopping where the budget (default 90 s, compiles included; the programs of a group compile in
parallel) runs out:

- ``check``: the kernels (`implementation="pallas"`) on edge rows (squares that overflow or
  underflow float32, a large mean, tiny statistics with eps outside, large cotangents, NaN and
  infinity), forward and backward, against `normkit.reference` under `normkit.tolerances`:
  the problems found (none: the compiled kernels are correct there).
- ``layers``: RMSNorm and LayerNorm at each shape, dtype and pass (forward; forward+backward as
  a ``vjp`` given dy): normkit.jax's linen module with the kernels and with the XLA program,
  ``flax.linen``'s layer, and a copy of the bytes the pass moves (the floor), each in
  throughput mode (`CALLS` calls between two syncs) and latency mode (a sync after each call).
- ``options``: every option of the spec through the kernels, its time over the default's (the
  target: at most 1.1), at the first shape in bfloat16, throughput mode.
- ``keras``: Keras' RMSNormalization and LayerNormalization on its JAX backend against
  normkit.tf's layers, with the kernels and without, stateless calls under ``jax.jit``.
- ``apis``: normkit.jax's nnx modules and functions with the kernels, beside the linen module
  (the same kernels: at the first shape).
- ``launch``: RMSNorm through the kernels at other launch configurations
  (`normkit._pallas.LAUNCH`: elements per warp forward and backward, the backward's programs),
  each against the default one: what tunes it.

``--interpret`` runs the kernels in Pallas' interpreter (without a GPU: slow, for small shapes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple

os.environ["KERAS_BACKEND"] = "jax"  # Keras' layers and normkit.tf below run on JAX

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import normkit.jax as nkjax  # noqa: E402
from normkit import NormSpec  # noqa: E402
from normkit.bench.timing import interleaved  # noqa: E402
from normkit.bridges import JaxBridge  # noqa: E402
from normkit.conformance import compare as conformance  # noqa: E402
from normkit.conformance import targets_jax  # noqa: E402
from normkit.conformance.compare import Inputs  # noqa: E402
from normkit.jax import functional, pallas  # noqa: E402

EPS = 1e-6
SHAPES = ((8192, 4096), (32768, 1024), (2048, 16384))
DTYPES = ("float32", "bfloat16")
SECTIONS = ("check", "layers", "options", "keras", "apis", "launch")
#: Calls between two syncs in throughput mode; rounds of each mode (after one warm-up round);
#: programs compiled at once.
CALLS = 10
ROUNDS = 7
COMPILERS = 8


class Log:
    def __init__(self, path: str, budget: float) -> None:
        self.file = open(path, "w")
        self.started = time.perf_counter()
        self.budget = budget

    def __call__(self, **record: Any) -> None:
        line = json.dumps(record)
        print(line if len(line) < 600 else line[:600] + " ...", flush=True)
        self.file.write(line + "\n")
        self.file.flush()

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)


class OutOfTime(Exception):
    """The budget ran out: the section stops where it is."""


def _spend(log: Log) -> None:
    if log.left() <= 0:
        raise OutOfTime


# --- timing ----------------------------------------------------------------------------------


def _modes(fn: Callable[[], Any]) -> dict[str, Callable[[], Any]]:
    """``fn`` (one call) in both modes: throughput (`CALLS` calls, then one sync) and latency
    (a sync after the call)."""

    def throughput() -> Any:
        out = None
        for _ in range(CALLS):
            out = fn()
        return jax.block_until_ready(out)

    return {"throughput": throughput, "latency": lambda: jax.block_until_ready(fn())}


class Pending(NamedTuple):
    """A jitted program lowered for its arguments, to compile (`compiled`) and call."""

    lowered: Any
    args: tuple[Any, ...]


def compiled(pending: Mapping[str, Pending]) -> dict[str, Callable[[], Any]]:
    """Each program compiled, `COMPILERS` at a time (XLA and Triton compile outside Python's
    lock), ready to call."""
    with ThreadPoolExecutor(COMPILERS) as pool:
        futures = {name: pool.submit(p.lowered.compile) for name, p in pending.items()}
        return {name: partial(f.result(), *pending[name].args) for name, f in futures.items()}


def timed(pending: Mapping[str, Pending]) -> dict[str, dict[str, float]]:
    """Each program's median ms per call in each mode, timed side by side
    (`normkit.bench.timing.interleaved`)."""
    candidates = compiled(pending)
    found: dict[str, dict[str, float]] = {}
    for mode in ("throughput", "latency"):
        runs = {name: _modes(fn)[mode] for name, fn in candidates.items()}
        per_call = CALLS if mode == "throughput" else 1
        timings = interleaved(runs, warmup=1, repeats=ROUNDS)
        found[mode] = {name: round(t.median_s * 1e3 / per_call, 4) for name, t in timings.items()}
    return found


def _program(apply: Callable[..., Any], params: Any, x: jax.Array, dy: Any, backward: bool
             ) -> Pending:
    """The jitted forward, or forward+backward given ``dy``, lowered (traced) now."""
    if backward:
        def run(params: Any, x: jax.Array, dy: Any) -> Any:
            y, vjp = jax.vjp(apply, params, x)
            return y, vjp(dy)

        return Pending(jax.jit(run).lower(params, x, dy), (params, x, dy))
    return Pending(jax.jit(apply).lower(params, x), (params, x))


def _copy(elements: int, dtype: str) -> Pending:
    """A jitted copy of ``elements`` (the bytes a pass moves)."""
    buffer = jnp.ones((elements,), dtype)
    return Pending(jax.jit(jnp.copy).lower(buffer), (buffer,))


def _moved(shape: tuple[int, int], backward: bool) -> int:
    """Elements a copy moves to match the pass: the forward reads x and writes y (a copy of x);
    the forward+backward adds reading x and dy and writing dx (2.5 copies of x)."""
    n = shape[0] * shape[1]
    return n * 5 // 2 if backward else n


def _linen(module: nn.Module, x: jax.Array) -> tuple[Callable[..., Any], Any]:
    return module.apply, module.init(jax.random.key(0), x[:1])


def _nnx(module: nnx.Module) -> tuple[Callable[..., Any], Any]:
    graph, state = nnx.split(module)
    return lambda state, x: nnx.merge(graph, state)(x), state


def _inputs(shape: tuple[int, int], dtype: str) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)
    dy = jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)
    return x, dy


# --- check -----------------------------------------------------------------------------------


def _edge_inputs(spec: NormSpec) -> Inputs:
    """Rows of scale 1 .. 3e38 and 1e-38, a large mean, a tiny statistic read beside ones,
    large cotangents, NaN and infinity; dy scaled so that the gradients stay normal numbers."""
    scales = np.array([1.0, 1e20, 3e38, 1e-30, 1e-38, 1.0, 1.0, 1.0, 1.0, 1.0])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((len(scales), 48)) * scales[:, None]
    x[2] = np.sign(x[2]) * 3e38
    x[5] += 1e6  # a large mean
    x[6, :4] = [1e-25, 0.0, -3e-26, 1e-26]  # a tiny statistic where partial RMS reads, ones after
    x[6, 4:] = 1.0
    x[8, 3], x[9, 5] = np.nan, np.inf
    dy = rng.standard_normal(x.shape) * np.minimum(scales, 1e30)[:, None]
    dy[7] *= 1e29  # large cotangents on an ordinary row
    inputs = Inputs(x.astype(np.float32), dy.astype(np.float32),
                    np.linspace(0.5, 1.5, 48).astype(np.float32))
    if spec.gate is not None:
        inputs = inputs._replace(gate=rng.standard_normal(x.shape).astype(np.float32))
    if spec.residual is not None:
        inputs = inputs._replace(residual=(x * 0.5).astype(np.float32),
                                 dh=rng.standard_normal(x.shape).astype(np.float32))
    if spec.bias:
        inputs = inputs._replace(bias=np.zeros(48, np.float32))
    return inputs


CHECKED = {
    "rms": NormSpec(),
    "rms-outside": NormSpec(eps_placement="outside", eps=1e-5),
    "partial-k1-outside": NormSpec("partial_rms", p=1 / 48, eps_placement="outside", eps=1e-5),
    "partial-k12": NormSpec("partial_rms", p=0.25),
    "layer": NormSpec("layer"),
    "layer-outside": NormSpec("layer", eps_placement="outside"),
    "layer-fast": NormSpec("layer", variance="fast"),
    "gate-after-groups": NormSpec(gate="after", group_size=12),
    "residual": NormSpec(residual="float32"),
    "dyt": NormSpec("dyt"),
}


def check(log: Log, device: str) -> None:
    """The kernels compiled on ``device`` against the reference on the edge rows."""
    for name, spec in CHECKED.items():
        _spend(log)
        inputs = _edge_inputs(spec)
        x, dy, scale, bias, residual, dh, alpha, gate = inputs
        outputs = targets_jax.evaluate(spec, x, dy, scale, bias, residual=residual, dh=dh,
                                       alpha=alpha, gate=gate, device=device,
                                       api="functional", implementation="pallas")
        problems, _ = conformance.compare(spec, inputs, outputs)
        log(check=name, spec=str(spec), problems=problems)


# --- layers ----------------------------------------------------------------------------------


def _pairs(dtype: str) -> dict[str, dict[str, nn.Module]]:
    """The bench's layers (y in x's dtype; normkit's LayerNorm with its two-pass variance)."""
    rms = dict(epsilon=EPS, output_dtype="input")
    layer = dict(epsilon=EPS, output_dtype="input", variance="two_pass")
    return {
        "RMSNorm": {"normkit[pallas]": nkjax.RMSNorm(**rms, implementation="pallas"),
                    "normkit[xla]": nkjax.RMSNorm(**rms, implementation="xla"),
                    "flax": nn.RMSNorm(epsilon=EPS, dtype=dtype)},
        "LayerNorm": {"normkit[pallas]": nkjax.LayerNorm(**layer, implementation="pallas"),
                      "normkit[xla]": nkjax.LayerNorm(**layer, implementation="xla"),
                      "flax": nn.LayerNorm(epsilon=EPS, dtype=dtype)},
    }


def _groups(shapes: tuple[tuple[int, int], ...], dtypes: tuple[str, ...]
            ) -> Iterator[tuple[tuple[int, int], str, bool]]:
    for shape in shapes:
        for dtype in dtypes:
            for backward in (False, True):
                yield shape, dtype, backward


def _record(log: Log, times: dict[str, dict[str, float]], ours: str, theirs: str | None,
            **fields: Any) -> None:
    """One group's times, with the kernels' speed over ``theirs`` (above 1: faster) and each
    one's fraction of the copy floor."""
    record: dict[str, Any] = dict(fields, ms=times)
    if theirs is not None:
        record["speedup"] = {mode: round(t[theirs] / t[ours], 3) for mode, t in times.items()}
    if all("copy" in t for t in times.values()):
        record["copy_fraction"] = {
            mode: {name: round(t["copy"] / ms, 3) for name, ms in t.items() if name != "copy"}
            for mode, t in times.items()
        }
    log(**record)


def layers(log: Log, shapes: tuple[tuple[int, int], ...], dtypes: tuple[str, ...]) -> None:
    for shape, dtype, backward in _groups(shapes, dtypes):
        x, dy = _inputs(shape, dtype)
        for kind, modules in _pairs(dtype).items():
            _spend(log)
            candidates = {name: _program(*_linen(module, x), x, dy, backward)
                          for name, module in modules.items()}
            candidates["copy"] = _copy(_moved(shape, backward), dtype)
            _record(log, timed(candidates), "normkit[pallas]", "flax", section="layers",
                    layer=kind, shape=shape, dtype=dtype,
                    **{"pass": "forward+backward" if backward else "forward"})


# --- options ---------------------------------------------------------------------------------

def _options(n: int) -> dict[str, NormSpec]:
    """Every option of the spec, by name; groups of n / 32 (128 at 4096)."""
    group = max(1, n // 32)
    return {
        "default": NormSpec(),
        "partial p=0.0625": NormSpec("partial_rms", p=0.0625),
        "eps outside": NormSpec(eps_placement="outside"),
        "gemma offset": NormSpec(scale_offset=1.0),
        "offset in bfloat16 weights": NormSpec(scale_offset=1.0, offset_dtype="param"),
        "llama cast": NormSpec(cast="before_scale"),
        "bias": NormSpec(bias=True),
        "promoted output": NormSpec(output_dtype="promote"),
        "layer two-pass": NormSpec("layer"),
        "layer fast": NormSpec("layer", variance="fast"),
        "dyt": NormSpec("dyt"),
        "groups of n/32": NormSpec(group_size=group),
        "gate after (reads z)": NormSpec(gate="after"),
        "gate before, groups of n/32 (reads z)": NormSpec(gate="before", group_size=group),
        "residual rounded (reads r, writes h)": NormSpec(residual="rounded"),
        "residual float32 (reads r, writes h)": NormSpec(residual="float32"),
        "residual float32_normalized (reads r, writes h)": NormSpec(residual="float32_normalized"),
    }


def _function(spec: NormSpec, x: jax.Array) -> tuple[Callable[..., Any], Any]:
    n = x.shape[-1]
    param = jnp.bfloat16 if spec.offset_dtype == "param" else jnp.float32
    scale = jnp.full((n,), spec.scale_init, param)
    bias = jnp.zeros((n,), jnp.float32) if spec.bias else None
    second = None if spec.gate is None and spec.residual is None else x

    def apply(params: Any, x: jax.Array) -> Any:
        scale, bias, second = params
        if spec.residual is not None:
            return functional.add_norm(x, second, spec, scale, bias, implementation="pallas")
        return functional.normalize(x, spec, scale, bias, gate=second, implementation="pallas")

    return apply, (scale, bias, second)


def options(log: Log, shape: tuple[int, int], dtype: str) -> None:
    """Each option's time through the kernels over the default's, timed side by side."""
    x, dy = _inputs(shape, dtype)
    for backward in (False, True):
        candidates = {}
        for name, spec in _options(shape[-1]).items():
            _spend(log)
            apply, params = _function(spec, x)
            outputs = jax.eval_shape(apply, params, x)
            cotangent = jax.tree.map(lambda o: jnp.ones(o.shape, o.dtype), outputs)
            candidates[name] = _program(apply, params, x, cotangent, backward)
        times = timed({n: c for n, c in candidates.items()})["throughput"]
        log(section="options", shape=shape, dtype=dtype,
            **{"pass": "forward+backward" if backward else "forward"}, ms=times,
            over_default={n: round(t / times["default"], 3) for n, t in times.items()})


# --- keras -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _switch(value: str) -> Iterator[None]:
    """The kernels' switch (`functional.KERNELS_VARIABLE`), read where a call is traced."""
    before = os.environ.get(functional.KERNELS_VARIABLE)
    os.environ[functional.KERNELS_VARIABLE] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[functional.KERNELS_VARIABLE]
        else:
            os.environ[functional.KERNELS_VARIABLE] = before


def _keras_program(layer: Any, x: jax.Array, dy: jax.Array, backward: bool) -> Pending:
    weights = [v.value for v in layer.trainable_variables]
    frozen = [v.value for v in layer.non_trainable_variables]

    def apply(weights: Any, x: jax.Array) -> Any:
        return layer.stateless_call(weights, frozen, x)[0]

    return _program(apply, weights, x, dy, backward)


def keras_layers(log: Log, shapes: tuple[tuple[int, int], ...], dtypes: tuple[str, ...]
                 ) -> None:
    try:
        import keras

        from normkit.tf.layers import LayerNorm, RMSNorm
    except ImportError as error:  # Keras comes with gpu-check's carried wheels
        log(section="keras", skipped=f"Keras is not importable: {error}")
        return

    policy = {"float32": "float32", "bfloat16": "mixed_bfloat16"}
    for shape, dtype, backward in _groups(shapes, dtypes):
        x, dy = _inputs(shape, dtype)
        pairs = {
            "RMSNorm": (RMSNorm, keras.layers.RMSNormalization, {}),
            "LayerNorm": (LayerNorm, keras.layers.LayerNormalization, {}),
        }
        for kind, (ours, theirs, kwargs) in pairs.items():
            _spend(log)
            candidates = {}
            for name, switch in (("normkit.tf[pallas]", "pallas"), ("normkit.tf[xla]", "xla")):
                layer = ours(epsilon=EPS, dtype=policy[dtype], **kwargs)
                layer.build(shape)
                with _switch(switch):
                    candidates[name] = _keras_program(layer, x, dy, backward)
            layer = theirs(epsilon=EPS, dtype=policy[dtype], **kwargs)
            layer.build(shape)
            candidates["keras"] = _keras_program(layer, x, dy, backward)
            candidates["copy"] = _copy(_moved(shape, backward), dtype)
            _record(log, timed(candidates), "normkit.tf[pallas]", "keras", section="keras",
                    layer=kind, shape=shape, dtype=dtype,
                    **{"pass": "forward+backward" if backward else "forward"})


# --- apis ------------------------------------------------------------------------------------


def apis(log: Log, shapes: tuple[tuple[int, int], ...], dtypes: tuple[str, ...]) -> None:
    """normkit.jax's three APIs through the kernels, side by side."""
    for shape, dtype, backward in _groups(shapes, dtypes):
        x, dy = _inputs(shape, dtype)
        n = shape[-1]
        for kind, spec in (("RMSNorm", NormSpec()), ("LayerNorm", NormSpec("layer"))):
            _spend(log)
            linen = nkjax.from_spec(spec, implementation="pallas")
            nnx_module = nkjax.nnx.from_spec(spec, n, implementation="pallas")
            params = (jnp.ones(n), jnp.zeros(n) if spec.bias else None)

            def function(params: Any, x: jax.Array, spec: NormSpec = spec) -> Any:
                return functional.normalize(x, spec, *params, implementation="pallas")

            candidates = {
                "linen": _program(*_linen(linen, x), x, dy, backward),
                "nnx": _program(*_nnx(nnx_module), x, dy, backward),
                "functional": _program(function, params, x, dy, backward),
            }
            log(section="apis", layer=kind, shape=shape, dtype=dtype,
                **{"pass": "forward+backward" if backward else "forward"}, ms=timed(candidates))


# --- launch ----------------------------------------------------------------------------------

#: Launch configurations tried beside the default, by what they change (`normkit._pallas.LAUNCH`).
LAUNCHES = {
    "forward": {"forward 512/warp": {"forward_per_warp": 512},
                "forward 2048/warp": {"forward_per_warp": 2048}},
    "forward+backward": {"backward 256/warp": {"backward_per_warp": 256},
                         "backward 1024/warp": {"backward_per_warp": 1024},
                         "132 programs": {"programs": 132},
                         "528 programs": {"programs": 528}},
}


#: Tried in the backward where rows have 4096 elements or more (`normkit._pallas.LAUNCH`):
#: rows whole however long, slices of 2048 from 4096 on, slices of 8192 past 8192.
LONG_ROWS = {"rows whole": {"fused": 32768}, "slices of 2048": {"fused": 2048, "slice": 2048},
             "slices of 8192": {"slice": 8192}}


@contextlib.contextmanager
def _launch(changes: Mapping[str, int]) -> Iterator[None]:
    from normkit import _pallas

    before = dict(_pallas.LAUNCH)
    _pallas.LAUNCH.update(changes)
    try:
        yield
    finally:
        _pallas.LAUNCH.clear()
        _pallas.LAUNCH.update(before)


def launch(log: Log, shapes: tuple[tuple[int, int], ...], dtypes: tuple[str, ...]) -> None:
    """RMSNorm through the kernels at each launch configuration of `LAUNCHES`, side by side
    with the default one, throughput mode."""
    for shape, dtype, backward in _groups(shapes, dtypes):
        _spend(log)
        x, dy = _inputs(shape, dtype)
        form = "forward+backward" if backward else "forward"
        candidates = {}
        tried = {"default": {}, **LAUNCHES[form]}
        if backward and shape[-1] >= 4096:
            tried.update(LONG_ROWS)
        for name, changes in tried.items():
            with _launch(changes):
                module = nkjax.RMSNorm(epsilon=EPS, output_dtype="input", implementation="pallas")
                candidates[name] = _program(*_linen(module, x), x, dy, backward)
        times = timed(candidates)["throughput"]
        log(section="launch", shape=shape, dtype=dtype, ms=times, **{"pass": form},
            over_default={n: round(t / times["default"], 3) for n, t in times.items()})


# --- main ------------------------------------------------------------------------------------


def _shape(text: str) -> tuple[int, int]:
    rows, n = text.lower().split("x")
    return int(rows), int(n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="jax-probe.jsonl")
    parser.add_argument("--budget", type=float, default=90.0,
                        help="seconds for the whole probe, compiles included (default 90)")
    parser.add_argument("--shapes", type=lambda s: tuple(map(_shape, s.split(","))),
                        default=SHAPES, help="rows x n, comma-separated")
    parser.add_argument("--dtypes", type=lambda s: tuple(s.split(",")), default=DTYPES)
    parser.add_argument("--sections", type=lambda s: tuple(s.split(",")), default=SECTIONS)
    parser.add_argument("--interpret", action="store_true",
                        help="the kernels in Pallas' interpreter (no GPU; small shapes)")
    args = parser.parse_args()
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    log = Log(args.out, args.budget)
    device = JaxBridge().devices()[-1]
    log(device=str(jax.devices()[0]), jax=jax.__version__, shapes=args.shapes,
        dtypes=args.dtypes, budget_s=args.budget, interpret=args.interpret)
    run: dict[str, Callable[[], None]] = {
        "check": lambda: check(log, device),
        "layers": lambda: layers(log, args.shapes, args.dtypes),
        "options": lambda: options(log, args.shapes[0], args.dtypes[-1]),
        "keras": lambda: keras_layers(log, args.shapes, args.dtypes),
        "apis": lambda: apis(log, args.shapes[:1], args.dtypes),
        "launch": lambda: launch(log, args.shapes, args.dtypes),
    }
    scope = pallas.interpreted() if args.interpret else contextlib.nullcontext()
    with scope:
        for section in SECTIONS:
            if section not in args.sections:
                continue
            try:
                run[section]()
            except OutOfTime:
                log(stopped=section, reason=f"the budget of {args.budget} s ran out")
                break
    log(seconds=round(time.perf_counter() - log.started, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
