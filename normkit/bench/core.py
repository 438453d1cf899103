"""What every backend's benchmark shares: the sweep, the groups, the row schema; no framework.

A backend benchmark (``normkit.bench.<backend>``) lists its `Group` s with ``plan(sweep)`` and
times one with ``measure(group, sweep)``, which builds the candidates and hands them to
`time_group`: every implementation of the group and a copy of the same bytes, interleaved.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from normkit.arguments import device
from normkit.bench.timing import Stopwatch, Timing, Wait, interleaved

PASSES = ("forward", "forward+backward")
ROLES = ("normkit", "peer", "copy floor")
DTYPES = ("float32", "bfloat16", "float16")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
LATENCY, THROUGHPUT = "latency", "throughput"
TIMINGS = (LATENCY, THROUGHPUT)
"""How a group is timed (the rows' ``timing``): a wait for the device after each call, or many
calls back to back between two waits (`normkit.bench.timing`)."""
FIELDS = (
    "implementation", "role", "backend", "device", "pass", "mode", "timing", "memory", "shape",
    "dtype", "median_s", "min_s", "max_s", "repeats", "calls", "host_s", "bytes_moved",
    "gb_per_s", "fraction_of_copy_floor", "ratios", "peak_memory_bytes",
    "saved_for_backward_bytes",
)
HIDDEN = (1024, 4096, 16384)
ELEMENTS = 32 * 2**20
QUICK_HIDDEN = (4096,)
QUICK_ELEMENTS = 2**20
EPS = 1e-6
TOKEN_SHAPE = (1, 4096)
"""One token's row, as a decoding step normalizes it: a call's time there is host work (checks,
dispatch, launches), not memory traffic, and it is timed over many rounds (`Sweep.token_rounds`)."""
TOKEN_ROUNDS = 200
QUICK_TOKEN_ROUNDS = 20
THROUGHPUT_CALLS = 50
"""Calls per throughput sample: back to back between two waits for the device."""
THROUGHPUT_MIN_CALLS = 2
CPU_SAMPLE_S = 0.05
QUICK_CPU_SAMPLE_S = 0.02
"""On the CPU a throughput sample of the swept shapes holds as many calls as fill this many
seconds (`Sweep.cpu_sample_s`; at least `THROUGHPUT_MIN_CALLS`, at most `THROUGHPUT_CALLS`): a
call there takes 1 to 500 ms, its host work well under 1 % of it, and 50 calls a sample would
make the sweep last hours. Elsewhere, and at one token everywhere, a sample is
`THROUGHPUT_CALLS` calls."""
QUICK_DTYPES = ("float32",)
TIMING_NOTE = {
    LATENCY: "latency: a wait for the device after every call, as a step that reads its result "
             "does",
    THROUGHPUT: f"throughput: {THROUGHPUT_CALLS} calls back to back between two waits, per call, "
                "as a loop that keeps the device busy runs them (on the CPU's large shapes as "
                f"many as fill {CPU_SAMPLE_S * 1e3:.0f} ms, {QUICK_CPU_SAMPLE_S * 1e3:.0f} ms with "
                f"--quick, at least {THROUGHPUT_MIN_CALLS}: there a call computes before it "
                "returns)",
}
"""What each timing means, in one sentence (the summary, the figures)."""
# Where every implementation's outputs live: as each allocates them, or all on transparent huge
# pages (torch on the CPU: normkit's kernel advises its outputs onto huge pages, torch's
# allocator does so only under THP_MEM_ALLOC_ENABLE=1, which it reads once per process).
AS_ALLOCATED, HUGE_PAGES = "as allocated", "on huge pages"
MEMORY_VIEWS = (AS_ALLOCATED, HUGE_PAGES)
MEMORY_NOTE = (
    "on huge pages: torch's CPU groups timed again in a process whose torch puts its own "
    "outputs on transparent huge pages (THP_MEM_ALLOC_ENABLE=1) as normkit's CPU kernel does, "
    "so that every implementation and the copy write into the same kind of memory"
)
"""What the memory view ``"on huge pages"`` means, in one sentence (the summary, the figure)."""
# The backends timed a second time on the CPU in the huge-pages view, and the environment that
# makes their allocator put its outputs there.
HUGE_PAGE_ENV: Mapping[str, Mapping[str, str]] = {"torch": {"THP_MEM_ALLOC_ENABLE": "1"}}
# The backends timed again on an alternative framework (`normkit.backends.Alternative`, by its
# note), in a worker of its own: normkit.tf on Keras' JAX backend.
ALSO_ON: Mapping[str, tuple[str, ...]] = {"tf": ("Keras on JAX",)}
KERAS_JAX_MODES = ("JAX eager", "jax.jit")
"""The modes of normkit.tf's rows on Keras' JAX backend: op by op, and under ``jax.jit``."""
MODES = ("eager", "torch.compile", "tf.function(jit_compile=True)", *KERAS_JAX_MODES)
"""Every mode a backend runs its layers in (`Sweep.modes` selects among them)."""


@dataclass(frozen=True)
class Sweep:
    """The shapes, dtypes, devices, timings and repeat counts of one benchmark run.

    ``dtypes`` / ``devices`` None: float32 and bfloat16 (plus float16 off the CPU) on every
    device the backend sees. ``repeats`` latency samples per group (``token_rounds`` at one
    token), then ``throughput_repeats`` throughput samples (``token_throughput_repeats``).
    """

    hidden: tuple[int, ...] = HIDDEN
    elements: int = ELEMENTS
    warmup: int = 2
    repeats: int = 8
    dtypes: tuple[str, ...] | None = None
    devices: tuple[str, ...] | None = None
    quick: bool = False
    memory: str = AS_ALLOCATED
    token_rounds: int = TOKEN_ROUNDS
    timings: tuple[str, ...] = TIMINGS
    modes: tuple[str, ...] | None = None
    throughput_repeats: int = 3
    token_throughput_repeats: int = 10
    cpu_sample_s: float = CPU_SAMPLE_S

    @classmethod
    def make(
        cls, quick: bool = False, devices: Sequence[str] | None = None,
        dtypes: Sequence[str] | None = None, timings: Sequence[str] | None = None,
        modes: Sequence[str] | None = None,
    ) -> Sweep:
        """The default sweep (hidden 1024, 4096, 16384 at 32M elements, 8 latency rounds; one
        token's row over `TOKEN_ROUNDS`) or the quick one (hidden 4096 at 1M elements, 3
        rounds; the token's over `QUICK_TOKEN_ROUNDS`; float32 unless ``dtypes`` says
        otherwise), each in both timings (default) or those of ``timings``, in every mode each
        backend runs (default) or those of ``modes``."""
        for kind, given, known in (("dtype", dtypes, DTYPES), ("timing", timings, TIMINGS),
                                   ("mode", modes, MODES)):
            for name in given or ():
                if name not in known:
                    raise ValueError(f"{kind} {name!r} is not one of {known}")
        chosen = tuple(dtypes) if dtypes else None
        where = tuple(devices) if devices else None
        how = tuple(t for t in TIMINGS if t in timings) if timings else TIMINGS
        which = tuple(modes) if modes else None
        if quick:
            return cls(
                QUICK_HIDDEN, QUICK_ELEMENTS, 1, 3, chosen or QUICK_DTYPES, where, quick=True,
                token_rounds=QUICK_TOKEN_ROUNDS, timings=how, modes=which,
                token_throughput_repeats=3, cpu_sample_s=QUICK_CPU_SAMPLE_S,
            )
        return cls(dtypes=chosen, devices=where, timings=how, modes=which)

    def shapes(self) -> list[tuple[int, int]]:
        """``(rows, hidden)`` for each hidden size, about ``elements`` elements each, then
        `TOKEN_SHAPE`."""
        return [(max(1, self.elements // h), h) for h in self.hidden] + [TOKEN_SHAPE]

    def dtypes_on(self, device: str) -> tuple[str, ...]:
        """The dtypes to time on ``device``."""
        if self.dtypes is not None:
            return self.dtypes
        return DTYPES[:2] if device == "cpu" else DTYPES

    def select(self, seen: Sequence[str]) -> list[str]:
        """The devices of ``seen`` (the backend's) that this sweep asked for."""
        return [d for d in seen if self.devices is None or d in self.devices]

    def calls(self, device: str, shape: Sequence[int], seconds_per_call: float) -> int:
        """Calls per throughput sample of a call that takes ``seconds_per_call`` (see
        `CPU_SAMPLE_S`)."""
        if device != "cpu" or tuple(shape) == TOKEN_SHAPE:
            return THROUGHPUT_CALLS
        fill = int(self.cpu_sample_s / max(seconds_per_call, 1e-9))
        return max(THROUGHPUT_MIN_CALLS, min(THROUGHPUT_CALLS, fill))


@dataclass(frozen=True)
class Group:
    """Implementations timed together: one backend, device, pass, mode, shape, dtype and memory
    view (`MEMORY_VIEWS`)."""

    backend: str
    device: str
    pass_: str
    mode: str
    shape: tuple[int, int]
    dtype: str
    memory: str = AS_ALLOCATED

    @property
    def label(self) -> str:
        rows, hidden = self.shape
        on = "" if self.memory == AS_ALLOCATED else f" [{self.memory}]"
        return (
            f"{self.backend} {self.device} {self.dtype} {rows}x{hidden} {self.pass_} {self.mode}"
            + on
        )

    @property
    def backward(self) -> bool:
        return self.pass_ == "forward+backward"

    @property
    def bytes_moved(self) -> int:
        """Forward reads x and writes y; backward also reads x and dy and writes dx."""
        return bytes_moved(self.shape, self.dtype, self.pass_)

    @property
    def copy_elements(self) -> int:
        """Elements of a buffer whose copy (read it, write another) moves `bytes_moved`."""
        return self.bytes_moved // (2 * ITEMSIZE[self.dtype])


def swept(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the hidden-size sweep: all but those of `TOKEN_SHAPE`."""
    return [r for r in rows if tuple(r["shape"]) != TOKEN_SHAPE]


def short_name(implementation: str, backend: str) -> str:
    """A normkit implementation's name without its backend's package: ``"RMSNorm"`` for
    ``normkit.jax.RMSNorm``, ``"nnx.RMSNorm"`` for ``normkit.jax.nnx.RMSNorm``; another name
    as it is."""
    return implementation.removeprefix(f"normkit.{backend}.")


def bytes_moved(shape: Sequence[int], dtype: str, pass_: str) -> int:
    """Bytes one pass must move at least: 2 tensors forward, 5 forward+backward (params ignored)."""
    tensors = {"forward": 2, "forward+backward": 5}[pass_]
    rows, hidden = shape
    return tensors * rows * hidden * ITEMSIZE[dtype]


def plan_groups(
    backend: str,
    sweep: Sweep,
    seen: Sequence[str],
    modes: Callable[[str, str, str, int], Iterable[str]],
) -> list[Group]:
    """Every group of a backend: device x dtype x shape x pass x each mode ``modes(device, dtype,
    pass, shape index)`` yields that the sweep selects (`Sweep.modes`); a mode's groups before
    the next mode's (a run stopped at a time limit has the eager ones, which the targets read
    most)."""
    groups = [
        Group(backend, device, pass_, mode, shape, dtype, sweep.memory)
        for device in sweep.select(seen)
        for dtype in sweep.dtypes_on(device)
        for i, shape in enumerate(sweep.shapes())
        for pass_ in PASSES
        for mode in modes(device, dtype, pass_, i)
        if sweep.modes is None or mode in sweep.modes
    ]
    return sorted(groups, key=lambda g: MODES.index(g.mode))


def time_group(
    group: Group,
    sweep: Sweep,
    candidates: Mapping[str, Callable[[], object]],
    copy: tuple[str, Callable[[], object]],
    *,
    wait: Wait | None = None,
    stopwatch: Stopwatch | None = None,
    extras: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Time ``candidates`` and the ``copy`` floor interleaved, in each of the sweep's timings;
    one row each per timing (see `normkit.bench`).

    ``wait`` blocks on a call's result (None: calls finish before they return); ``stopwatch``
    times a throughput sample (default: the host's clock after ``wait``), e.g. CUDA events.
    Names starting with ``normkit.`` get the role "normkit"; ``extras`` adds fields per name
    (``peak_memory_bytes``, ``saved_for_backward_bytes``).
    """
    everything = {**candidates, copy[0]: copy[1]}
    token = group.shape == TOKEN_SHAPE
    warmup = sweep.warmup * (10 if token else 1)
    timed: dict[str, dict[str, Timing]] = {}
    if LATENCY in sweep.timings:
        timed[LATENCY] = interleaved(
            everything, warmup=warmup, repeats=sweep.token_rounds if token else sweep.repeats,
            wait=wait,
        )
    if THROUGHPUT in sweep.timings:
        probe = timed.get(LATENCY) or interleaved(everything, warmup=warmup, repeats=1, wait=wait)
        calls = {k: sweep.calls(group.device, group.shape, t.median_s) for k, t in probe.items()}
        timed[THROUGHPUT] = interleaved(
            everything, warmup=0, calls=calls, wait=wait, stopwatch=stopwatch,
            repeats=sweep.token_throughput_repeats if token else sweep.throughput_repeats,
        )
    rows = []
    for timing, timings in timed.items():
        rows += _rows(group, timing, timings, copy[0], list(candidates), extras or {})
    return rows


def _rows(
    group: Group, timing: str, timings: Mapping[str, Timing], copy_name: str,
    names: Sequence[str], extras: Mapping[str, Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """One group's rows in one timing."""
    floor = timings[copy_name].median_s
    rows = []
    for name, t in timings.items():
        role = (
            "copy floor"
            if name == copy_name
            else "normkit"
            if name.startswith("normkit.")
            else "peer"
        )
        rows.append(
            {
                "implementation": name,
                "role": role,
                "backend": group.backend,
                "device": group.device,
                "pass": group.pass_,
                "mode": group.mode,
                "timing": timing,
                "memory": group.memory,
                "shape": list(group.shape),
                "dtype": group.dtype,
                "median_s": t.median_s,
                "min_s": t.min_s,
                "max_s": t.max_s,
                "repeats": t.repeats,
                "calls": t.calls,
                "host_s": t.host_s,
                "bytes_moved": group.bytes_moved,
                "gb_per_s": group.bytes_moved / t.median_s / 1e9,
                "fraction_of_copy_floor": floor / t.median_s,
                "ratios": {}
                if role == "copy floor"
                else {peer: timings[peer].median_s / t.median_s for peer in names if peer != name},
                "peak_memory_bytes": None,
                "saved_for_backward_bytes": None,
                **extras.get(name, {}),
            }
        )
    return rows


class BackendBench(Protocol):
    """What ``normkit.bench.<backend>`` provides."""

    def plan(self, sweep: Sweep) -> list[Group]: ...
    def measure(self, group: Group, sweep: Sweep) -> list[dict[str, Any]]: ...
    def versions(self) -> dict[str, str]: ...
    def devices(self) -> list[str]: ...


def collect(
    bench: BackendBench,
    sweep: Sweep,
    on_group: Callable[[Group, list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure every group of ``bench.plan(sweep)`` in order; the rows of all."""
    rows: list[dict[str, Any]] = []
    for group in bench.plan(sweep):
        measured = bench.measure(group, sweep)
        rows += measured
        if on_group is not None:
            on_group(group, measured)
    return rows


def run(
    bench: BackendBench,
    quick: bool = False,
    devices: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    timings: Sequence[str] | None = None,
    modes: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Every group of ``bench``'s sweep (`Sweep.make`), timed in this process; rows in
    `normkit.bench`'s schema."""
    return collect(bench, Sweep.make(quick, devices, dtypes, timings, modes))


def backend_main(bench: BackendBench, argv: Sequence[str] | None = None) -> None:
    """``python -m normkit.bench.<backend>``: run that backend's benchmark here, print the table."""
    from normkit.bench import report

    parser = argparse.ArgumentParser(description=(bench.__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="hidden 4096 at 1M elements and one token, 3 rounds"
    )
    parser.add_argument(
        "--device", action="append", type=device,
        help="only this device (repeatable): cpu, cuda:N (alias gpu:N), tpu:N, mps",
    )
    parser.add_argument(
        "--dtype", action="append", choices=DTYPES, help="only this dtype (repeatable)"
    )
    parser.add_argument(
        "--timing", action="append", choices=TIMINGS, help="only this timing (repeatable)"
    )
    parser.add_argument(
        "--mode", action="append", choices=MODES, help="only this mode (repeatable)"
    )
    args = parser.parse_args(argv)
    sweep = Sweep.make(args.quick, args.device, args.dtype, args.timing, args.mode)
    print(", ".join(f"{k} {v}" for k, v in bench.versions().items()))
    print(report.table(collect(bench, sweep)))


def sweep_to_dict(sweep: Sweep) -> dict[str, Any]:
    """``sweep`` as JSON-ready data (for the worker process)."""
    return asdict(sweep)


def sweep_from_dict(data: Mapping[str, Any]) -> Sweep:
    """The inverse of `sweep_to_dict`."""
    tuples: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return Sweep(**tuples)
