"""The speed targets the benchmark judges (docs/benchmarks.md), from one run's rows or several.

A `Target` reads one value per hidden size of the sweep (or one at `TOKEN_SHAPE`) from the rows
it selects: a ratio to a peer (the peer's median time over normkit's), a fraction of the copy
floor, or normkit's host time per call over a peer's. It is met when every hidden size meets
its bound. A run that did not measure a target (its backend, device or memory view absent)
leaves it out.

`judge` reads several runs as one: each value is the median of the runs' values, so that a
target within a few percent of its bound is decided by the median of three full runs, not by
one run's noise. Targets with ``runs=3`` (parity by design, and those issue 50 decided that
way) are final only with three full runs; with fewer their verdict says how many it read.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from normkit.bench.core import (
    AS_ALLOCATED,
    HIDDEN,
    HUGE_PAGES,
    LATENCY,
    QUICK_HIDDEN,
    THROUGHPUT,
    TOKEN_SHAPE,
)

Row = dict[str, Any]
PARITY_RUNS = 3
LIGER = "Liger RMSNorm (Triton)"
PARTIAL = "normkit.torch.PartialRMSNorm(p=0.0625)"
KERAS = {"RMSNorm": "keras.layers.RMSNormalization", "LayerNorm": "keras.layers.LayerNormalization"}
FLAX = {"RMSNorm": "flax.linen.RMSNorm", "LayerNorm": "flax.linen.LayerNorm"}
TORCH = {"RMSNorm": "torch.nn.RMSNorm", "LayerNorm": "torch.nn.LayerNorm"}
DTYPES = ("float32", "bfloat16")
PASSES = ("forward", "forward+backward")
XLA_MODES = ("jax.jit", "tf.function(jit_compile=True)")


@dataclass(frozen=True)
class Target:
    """One target: the rows it reads (``where``: row fields and their values), what it reads
    from them (``measure``: ``"ratio"`` to ``peer``, ``"fraction"`` of the copy floor, ``"host"``
    time over ``peer``'s) and the bound (at least ``bound``; at most with ``at_most``). ``runs``:
    how many full runs' median decides it."""

    name: str
    where: Mapping[str, Any] = field(hash=False)
    measure: str
    bound: float
    peer: str | None = None
    at_most: bool = False
    runs: int = 1
    family: str = ""
    case: str = ""

    @property
    def token(self) -> bool:
        """Whether it reads the one-token rows (else the sweep's hidden sizes)."""
        return self.measure == "host"

    def value(self, row: Row, index: Mapping[tuple[Any, ...], Row]) -> float | None:
        """The value this target reads from ``row`` (None where the row lacks it)."""
        if self.measure == "fraction":
            return float(row["fraction_of_copy_floor"])
        if self.measure == "ratio":
            ratio = row["ratios"].get(self.peer)
            return None if ratio is None else float(ratio)
        peer = index.get(_key(row, self.peer))
        ours, theirs = row.get("host_s"), peer and peer.get("host_s")
        return None if not ours or not theirs else float(ours) / float(theirs)

    def meets(self, value: float) -> bool:
        return value <= self.bound if self.at_most else value >= self.bound

    def cell(self, value: float) -> str:
        """``value`` as the target states it: a percentage of the copy floor, else a ratio."""
        return f"{value:.0%}" if self.measure == "fraction" else f"{value:.2f}x"


@dataclass(frozen=True)
class Verdict:
    """A target judged on ``runs`` runs: per hidden size the median of their values (None for a
    size a run should have measured and none did), whether every size meets the bound, and
    whether that decides it (enough full runs)."""

    target: Target
    values: dict[int, float | None]
    runs: int
    met: bool
    quick: bool = False

    @property
    def final(self) -> bool:
        """Whether the runs decide it: full runs, as many as the target asks for."""
        return not self.quick and self.runs >= self.target.runs

    @property
    def verdict(self) -> str:
        """``met`` / ``not met``; with the runs read where they do not decide it: ``met (quick
        run)``, ``not met in 1 of 3 runs``."""
        word = "met" if self.met else "not met"
        if self.quick:
            return f"{word} (quick run)"
        if not self.final:
            return f"{word} in {self.runs} of {self.target.runs} runs"
        return word

    def cells(self) -> str:
        """``"1024: 0.97x, 4096: 1.02x"``; ``"1x4096: 1.37x"`` at one token."""
        return ", ".join(
            f"{'x'.join(map(str, TOKEN_SHAPE)) if self.target.token else hidden}: "
            + ("-" if value is None else self.target.cell(value))
            for hidden, value in self.values.items()
        )


def _key(row: Row, implementation: str | None) -> tuple[Any, ...]:
    return (
        row["backend"], row["device"], row["pass"], row["mode"], row.get("timing", LATENCY),
        row["memory"], tuple(row["shape"]), row["dtype"], implementation,
    )


def _matches(row: Row, where: Mapping[str, Any]) -> bool:
    return all(row.get(k, LATENCY if k == "timing" else None) == v for k, v in where.items())


def _ratio(name: str, where: Mapping[str, Any], peer: str, bound: float, runs: int = 1,
           family: str = "", case: str = "") -> Target:
    return Target(name, where, "ratio", bound, peer, runs=runs, family=family, case=case)


def _case(ours: str, dtype: str, pass_: str, bound: str) -> str:
    """The terminal's short line of a target: ``"nnx.RMSNorm  bfloat16  forward  >= 0.95x"``."""
    layer = ours.removeprefix("normkit.").split(".", 1)[-1]
    return f"{layer:<15}{dtype:<9}{pass_:<17}{bound}"


def _cpu_framework_targets(devices: Sequence[str]) -> Iterable[Target]:
    """Keras' and Flax's targets: normkit's layers against the framework's own, latency."""
    if "cpu" not in devices:
        return
    keras_modes = [("Keras/TF", "eager"), ("Keras/TF", "tf.function(jit_compile=True)"),
                   ("Keras/JAX", "JAX eager"), ("Keras/JAX", "jax.jit")]
    for where_, mode in keras_modes:
        family = f"{where_} {mode} on cpu, latency: normkit.tf against keras.layers' layer"
        for dtype in DTYPES:
            for pass_ in PASSES:
                for layer, peer in KERAS.items():
                    ours = f"normkit.tf.{layer}"
                    bound, runs = _cpu_bound(layer, mode, pass_)
                    yield _ratio(
                        f"{where_} {mode} {dtype} {pass_}: `{ours}` >= {bound}x `{peer}`",
                        _select("tf", "cpu", mode, dtype, pass_, ours), peer, bound, runs,
                        family, _case(ours, dtype, pass_, f">= {bound}x"),
                    )
    family = "Flax jax.jit on cpu, latency: normkit.jax (linen, nnx) against flax.linen's layer"
    for dtype in DTYPES:
        for pass_ in PASSES:
            for layer, peer in FLAX.items():
                for ours in (f"normkit.jax.{layer}", f"normkit.jax.nnx.{layer}"):
                    bound, runs = _cpu_bound(layer, "jax.jit", pass_)
                    yield _ratio(
                        f"Flax jax.jit {dtype} {pass_}: `{ours}` >= {bound}x `{peer}`",
                        _select("jax", "cpu", "jax.jit", dtype, pass_, ours), peer, bound, runs,
                        family, _case(ours, dtype, pass_, f">= {bound}x"),
                    )


def _cpu_bound(layer: str, mode: str, pass_: str) -> tuple[float, int]:
    """A CPU target's bound and the runs that decide it: 0.95x in the median of three runs where
    normkit runs the framework's own ops (Keras' eager RMSNorm) or XLA's program for the
    forward (issue 50); 1.0x in one run elsewhere."""
    parity = layer == "RMSNorm" and mode in ("eager", "JAX eager")
    xla_forward = mode in XLA_MODES and pass_ == "forward"
    return (0.95, PARITY_RUNS) if parity or xla_forward else (1.0, 1)


def _select(backend: str, device: str, mode: str, dtype: str, pass_: str, ours: str,
            timing: str = LATENCY, memory: str = AS_ALLOCATED) -> dict[str, Any]:
    return {"backend": backend, "device": device, "mode": mode, "dtype": dtype, "pass": pass_,
            "implementation": ours, "timing": timing, "memory": memory}


def _cpu_torch_targets(devices: Sequence[str]) -> Iterable[Target]:
    """The CPU kernel's targets, on equal memory (`HUGE_PAGES`), latency."""
    if "cpu" not in devices:
        return

    def equal(dtype: str, pass_: str, ours: str = "normkit.torch.RMSNorm") -> dict[str, Any]:
        return _select("torch", "cpu", "eager", dtype, pass_, ours, memory=HUGE_PAGES)

    family = "torch eager on cpu, latency, equal memory (outputs on huge pages)"
    floors = [("float32", "forward", 0.90), ("float32", "forward+backward", 0.80),
              ("bfloat16", "forward", 0.85)]
    for dtype, pass_, bound in floors:
        yield Target(f"torch CPU, equal memory: {dtype} RMSNorm {pass_} >= {bound:.0%} of the "
                     "copy floor", equal(dtype, pass_), "fraction", bound, runs=PARITY_RUNS,
                     family=family,
                     case=_case("RMSNorm", dtype, pass_, f">= {bound:.0%} of copy"))
    yield _ratio("torch CPU, equal memory: float32 RMSNorm forward >= 1.1x `torch.nn.LayerNorm`",
                 equal("float32", "forward"), "torch.nn.LayerNorm", 1.1, family=family,
                 case=_case("RMSNorm", "float32", "forward", ">= 1.1x nn.LayerNorm"))
    for pass_ in PASSES:
        yield _ratio(f"torch CPU, equal memory: bfloat16 LayerNorm {pass_} >= 1.0x "
                     "`torch.nn.LayerNorm`", equal("bfloat16", pass_, "normkit.torch.LayerNorm"),
                     "torch.nn.LayerNorm", 1.0, family=family,
                     case=_case("LayerNorm", "bfloat16", pass_, ">= 1.0x nn.LayerNorm"))
    for dtype in DTYPES:
        for pass_ in PASSES:
            yield _ratio(f"torch CPU, equal memory: {dtype} {pass_}: `PartialRMSNorm` >= 0.95x "
                         "`RMSNorm`", equal(dtype, pass_, PARTIAL), "normkit.torch.RMSNorm", 0.95,
                         PARITY_RUNS, family,
                         _case("PartialRMSNorm", dtype, pass_, ">= 0.95x RMSNorm"))


def _host_targets(devices: Sequence[str]) -> Iterable[Target]:
    """Host time per call at one token, every device (issue 49): normkit.torch.RMSNorm at most
    1.5x `torch.nn.RMSNorm`'s, forward and forward+backward, throughput timing."""
    for device in devices:
        family = f"torch eager on {device}, one token, throughput: host time per call"
        for dtype in DTYPES:
            for pass_ in PASSES:
                where = _select("torch", device, "eager", dtype, pass_, "normkit.torch.RMSNorm",
                                THROUGHPUT)
                yield Target(f"torch {device} host time at one token, {dtype} {pass_}: "
                             "`RMSNorm` <= 1.5x `torch.nn.RMSNorm`", where, "host", 1.5,
                             "torch.nn.RMSNorm", at_most=True, family=family,
                             case=_case("RMSNorm", dtype, pass_, "<= 1.5x nn.RMSNorm"))


def _gpu_targets(devices: Sequence[str]) -> Iterable[Target]:
    """The GPU targets of issues 49 and 50, on each CUDA device."""
    for device in (d for d in devices if d.startswith("cuda")):
        yield from _gpu_torch_targets(device)
        yield from _gpu_jax_targets(device)


def _gpu_torch_targets(device: str) -> Iterable[Target]:
    """normkit.torch on ``device``: the copy floor and torch's layers (and Liger's RMSNorm) in
    throughput, torch's eager layers in latency, torch's compiled layers compiled."""
    for timing, mode in ((THROUGHPUT, "eager"), (LATENCY, "eager"),
                         (THROUGHPUT, "torch.compile")):
        family = f"torch {mode} on {device}, {timing}: normkit.torch against torch's layers"
        for dtype in DTYPES:
            for pass_ in PASSES:
                for layer, peer in TORCH.items():
                    ours = f"normkit.torch.{layer}"
                    where = _select("torch", device, mode, dtype, pass_, ours, timing)
                    head = f"torch {device} {mode} {timing} {dtype} {pass_}: `{ours}`"
                    if (timing, mode) == (THROUGHPUT, "eager"):
                        floor = 0.90 if pass_ == "forward" else 0.80
                        yield Target(f"{head} >= {floor:.0%} of the copy floor", where,
                                     "fraction", floor, family=family,
                                     case=_case(ours, dtype, pass_, f">= {floor:.0%} of copy"))
                    peers = [peer, LIGER] if (layer, mode) == ("RMSNorm", "eager") and (
                        timing == THROUGHPUT) else [peer]
                    for other in peers:
                        short = "Liger" if other == LIGER else other.removeprefix("torch.")
                        yield _ratio(f"{head} >= 1.0x `{other}`", where, other, 1.0,
                                     family=family,
                                     case=_case(ours, dtype, pass_, f">= 1.0x {short}"))


def _gpu_jax_targets(device: str) -> Iterable[Target]:
    """normkit.jax against Flax's layers and the copy floor, normkit.tf on Keras' JAX backend
    against Keras', jitted, throughput (issue 50)."""
    family = f"Flax jax.jit on {device}, throughput: normkit.jax against flax.linen's layer"
    for dtype in DTYPES:
        for pass_ in PASSES:
            for layer, peer in FLAX.items():
                for ours in (f"normkit.jax.{layer}", f"normkit.jax.nnx.{layer}"):
                    where = _select("jax", device, "jax.jit", dtype, pass_, ours, THROUGHPUT)
                    head = f"Flax {device} throughput {dtype} {pass_}: `{ours}`"
                    yield _ratio(f"{head} >= 1.0x `{peer}`", where, peer, 1.0, family=family,
                                 case=_case(ours, dtype, pass_, ">= 1.0x"))
                    if pass_ == "forward":
                        yield Target(f"{head} >= 90% of the copy floor", where, "fraction", 0.90,
                                     family=family,
                                     case=_case(ours, dtype, pass_, ">= 90% of copy"))
    family = (f"Keras/JAX jax.jit on {device}, throughput: normkit.tf against keras.layers' "
              "layer")
    for dtype in DTYPES:
        for pass_ in PASSES:
            for layer, peer in KERAS.items():
                ours = f"normkit.tf.{layer}"
                yield _ratio(
                    f"Keras/JAX {device} jax.jit throughput {dtype} {pass_}: `{ours}` >= 1.0x "
                    f"`{peer}`", _select("tf", device, "jax.jit", dtype, pass_, ours, THROUGHPUT),
                    peer, 1.0, family=family, case=_case(ours, dtype, pass_, ">= 1.0x"))


def targets(devices: Sequence[str]) -> list[Target]:
    """Every target on ``devices``, in the order docs/benchmarks.md lists them."""
    return [*_cpu_framework_targets(devices), *_cpu_torch_targets(devices),
            *_host_targets(devices), *_gpu_targets(devices)]


@dataclass(frozen=True)
class Run:
    """One run's rows, and whether it was the quick sweep."""

    rows: Sequence[Row]
    quick: bool = False

    @property
    def hidden(self) -> tuple[int, ...]:
        """The hidden sizes each target must meet: the full sweep's, or those a quick run
        measured."""
        if not self.quick:
            return HIDDEN
        return tuple(sorted({r["shape"][1] for r in self.rows
                             if tuple(r["shape"]) != TOKEN_SHAPE})) or QUICK_HIDDEN


def judge(runs: Sequence[Run]) -> list[Verdict]:
    """Every target that some run measured, judged on the median of the runs' values per hidden
    size; a size missing from every run fails it. ValueError for quick runs mixed with full ones
    (their shapes differ)."""
    if not runs:
        raise ValueError("no run to judge")
    if len({run.quick for run in runs}) > 1:
        raise ValueError("quick and full runs measure different shapes: combine one kind only")
    quick = runs[0].quick
    devices = list(dict.fromkeys(r["device"] for run in runs for r in run.rows))
    indexes = [{_key(r, r["implementation"]): r for r in run.rows} for run in runs]
    verdicts = []
    for target in targets(devices):
        per_run = [_values(target, run, index) for run, index in zip(runs, indexes, strict=True)]
        measured = [v for v in per_run if v]
        if not measured:
            continue
        sizes = [TOKEN_SHAPE[1]] if target.token else list(runs[0].hidden)
        values: dict[int, float | None] = {}
        for size in sizes:
            found = [v[size] for v in measured if size in v]
            values[size] = statistics.median(found) if found else None
        met = all(v is not None and target.meets(v) for v in values.values())
        verdicts.append(Verdict(target, values, len(measured), met, quick))
    return verdicts


def _values(target: Target, run: Run, index: Mapping[tuple[Any, ...], Row]) -> dict[int, float]:
    """The target's value per hidden size in one run (the one-token row's for a host target)."""
    found = {}
    for row in run.rows:
        if not _matches(row, target.where) or (tuple(row["shape"]) == TOKEN_SHAPE) != target.token:
            continue
        value = target.value(row, index)
        if value is not None:
            found[row["shape"][1]] = value
    return found


def markdown(verdicts: Sequence[Verdict]) -> list[str]:
    """The verdicts as docs/benchmarks.md's table."""
    lines = ["| target | measured (hidden: value) | verdict |", "|---|---|---|"]
    for v in verdicts:
        word = v.verdict if v.met else f"**{v.verdict}**"
        lines.append(f"| {v.target.name} | {v.cells()} | {word} |")
    return lines
