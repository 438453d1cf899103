"""``normkit bench --model``: a small language model trained in torch, Keras and Flax, each norm.

The RMSNorm paper's claim, end to end: a decoder-only, Llama-like model (`ModelConfig`) written
once per framework in its own idiom (``normkit.bench.model.torch``, ``.keras``, ``.flax``), its
norm a parameter: the framework's own LayerNorm and RMSNorm, and normkit's LayerNorm, RMSNorm,
PartialRMSNorm (p = 0.0625) and DyT (`config.NORMS`). Every framework starts from the same
weights (`normkit.bench.model.weights`: drawn once in numpy, the norms moved with
`normkit.port`), trains on the same batches of a sorting task (`normkit.bench.model.data`) with
the same AdamW and schedule, so its losses agree with the others' (`results.agreement`).

`run` trains each framework in a worker process of its own, one after the other: first every
norm (and the identity, to see what the norms cost) for ``eager_steps`` eager steps, then for
``steps`` compiled steps (``torch.compile``, Keras ``jit_compile``, ``nnx.jit``); every step of
every variant is timed, the variants interleaved step by step.

Each run (one framework, norm and mode) is a dict:

- ``framework`` (``torch``, ``keras``, ``flax``), ``backend`` (normkit's: ``torch``, ``tf``,
  ``jax``), ``device``, ``norm`` (one of `config.VARIANTS`), ``implementation`` (the layer, e.g.
  ``normkit.torch.RMSNorm``), ``mode`` (``eager`` or ``compiled``), ``compiler`` (None eager);
- ``losses``, ``step_s``: per step, the loss before the update and the step's time (forward,
  backward and optimizer; the loss read back, so the step has finished);
- ``first_step_s`` (compiled: mostly compilation), ``median_step_s``, ``min_step_s`` (over the
  steps after ``timing_warmup``), ``tokens_per_s``, ``final_loss`` (mean of the last tenth);
- ``vs_layernorm``: median / the framework's own LayerNorm's (same mode): the paper's claim is
  0.36-0.93 for RMSNorm; ``norm_share``: ``1 - identity median / median``, the part of the step
  the norms cost (the model with every norm replaced by the identity, timed beside it);
  ``profiled_norm_share``: torch eager only, the norms' ops (forward and their backward nodes)
  over all ops in ``torch.profiler``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normkit import backends as _backends
from normkit import workers
from normkit.arguments import refuse_empty
from normkit.bench.model import machine, results
from normkit.bench.model.config import IDENTITY, MODES, NORMS, SIZES, ModelConfig, config_to_dict
from normkit.bench.model.weights import write
from normkit.bench.model.worker import FRAMEWORKS, planned_work
from normkit.progress import Progress

__all__ = ["ModelConfig", "ModelReport", "SIZES", "run"]

WORKER = "normkit.bench.model.worker"
COMPILERS = {"torch": "torch.compile", "keras": "jit_compile", "flax": "nnx.jit"}


@dataclass
class ModelReport:
    """One model benchmark: its config, the runs (see above), the agreement of the losses
    (`results.agreement`), the machine, and per framework its versions, or why it was skipped
    or failed; ``interrupted`` when stopped before the end (the runs hold the steps taken)."""

    size: str
    config: ModelConfig
    device: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    agreement: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, dict[str, str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        found = dataclasses.asdict(self)
        found["config"] = config_to_dict(self.config)
        return found


def omp_wait_policy() -> str:
    """The OpenMP wait policy of the workers: the environment's ``OMP_WAIT_POLICY``, else
    ``PASSIVE``. OpenMP threads spin while they wait by default; on a machine whose cores other
    jobs share, a spinning thread holds a core its partner needs, and torch.compile's CPU code
    (an OpenMP region per kernel) ran 10-30 times slower than with passive waiting."""
    return os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


def _environment(backend: _backends.Backend) -> tuple[dict[str, str] | None, str]:
    """The worker's environment for ``backend`` (its own, or the first alternative that is
    installed: Keras on JAX without TensorFlow), or None and why it cannot run."""
    common = {"OMP_WAIT_POLICY": omp_wait_policy()}
    if not backend.missing():
        return {**backend.env, **common}, ""
    alternative = backend.alternative()
    if alternative is not None and FRAMEWORKS[backend.name] == "keras":
        return {**alternative.env, **common}, ""
    return None, f"{', '.join(backend.missing())} not installed: {backend.install}"


def run(
    *,
    size: str = "cpu",
    config: ModelConfig | None = None,
    backends: Sequence[str] | None = None,
    device: str = "cpu",
    norms: Sequence[str] | None = None,
    modes: Sequence[str] | None = None,
    identity: bool = True,
    profile: bool = True,
    progress: bool = True,
) -> ModelReport:
    """Train the model with each norm in each framework, one worker process after another.

    Args:
      size: a key of `SIZES` (``tiny``, ``cpu``, ``gpu``); ``config`` replaces it when given.
      backends: normkit's backends whose framework to train (``torch``: torch; ``tf``: Keras,
        on TensorFlow, or on JAX where TensorFlow is missing; ``jax``: Flax NNX); default all.
        One not installed is skipped with the install command.
      device: one device name (``cpu``, ``cuda:0``, ...); a framework that does not see it is
        skipped.
      norms: from `config.NORMS`; default all.
      modes: ``eager`` and/or ``compiled``; default both.
      identity: also train the model without norms beside them (``norm_share``).
      profile: also measure the norms' share with ``torch.profiler`` (torch, eager).
      progress: draw a progress bar with the time left on stderr.

    Interrupted (KeyboardInterrupt), it stops the worker and returns the steps taken so far,
    with ``interrupted`` set.
    """
    refuse_empty(backends=backends, norms=norms, modes=modes)
    chosen_norms = list(dict.fromkeys(norms or NORMS))
    chosen_modes = [m for m in MODES if m in (modes or MODES)]
    unknown = sorted({*chosen_norms} - {*NORMS}) + sorted({*(modes or ())} - {*MODES})
    if unknown:
        raise ValueError(f"unknown norms or modes {unknown}; norms: {NORMS}, modes: {MODES}")
    config = config or SIZES[size]
    device = _backends.device_name(device)
    variants = [*chosen_norms, *([IDENTITY] if identity else [])]
    chosen = [_backends.get(b) for b in backends] if backends else list(_backends.BACKENDS)
    start = time.perf_counter()
    report = ModelReport(size if config is SIZES.get(size) else "custom", config, device,
                         machine={**machine.describe(), "OMP_WAIT_POLICY": omp_wait_policy()})
    bar = Progress("bench --model") if progress else None
    plans = {
        b.name: planned_work(config, FRAMEWORKS[b.name], variants, chosen_modes, profile)
        for b in chosen
    }
    if bar is not None:
        for rounds, work in plans.values():
            bar.add(rounds, work)
    try:
        with tempfile.TemporaryDirectory(prefix="normkit-model-") as folder:
            write(config, Path(folder), chosen_norms)
            for backend in chosen:
                job = {"framework": FRAMEWORKS[backend.name], "config": config_to_dict(config),
                       "folder": folder, "device": device, "variants": variants,
                       "modes": chosen_modes, "profile": profile}
                rounds, work = _train(backend, job, report, bar)
                planned_rounds, planned = plans[backend.name]
                if bar is not None and rounds < planned_rounds:  # skipped or failed
                    bar.advance(f"{job['framework']}: stopped", planned_rounds - rounds,
                                planned - work)
    except KeyboardInterrupt:
        report.interrupted = True
    if bar is not None:
        bar.close()
    results.summarize(report.runs, config)
    report.agreement = results.agreement(report.runs, config)
    report.machine["load_average_end"] = machine.load_average()
    report.seconds = time.perf_counter() - start
    return report


def _train(backend: _backends.Backend, job: dict[str, Any], report: ModelReport,
           bar: Progress | None) -> tuple[int, float]:
    """Run one framework's job in a worker, its steps into ``report``; the events and work
    done."""
    framework = job["framework"]
    env, why = _environment(backend)
    if env is None:
        report.skipped[framework] = why
        return 0, 0.0
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    events, done = 0, 0.0

    def advance(label: str, work: float) -> None:
        nonlocal events, done
        events += 1
        done += work
        if bar is not None:
            bar.advance(f"{framework} {label}", 1, work)

    def on_event(event: dict[str, Any]) -> None:
        if "unavailable" in event:
            report.skipped[framework] = event["unavailable"]
        elif "versions" in event:
            report.versions[framework] = event["versions"]
            report.machine.setdefault("devices", {})[framework] = event["device_kind"]
            for mode in job["modes"]:
                for variant in job["variants"]:
                    runs[mode, variant] = {
                        "framework": framework, "backend": backend.name,
                        "device": job["device"], "norm": variant,
                        "implementation": event["implementations"][variant], "mode": mode,
                        "compiler": COMPILERS[framework] if mode == "compiled" else None,
                        "losses": [], "step_s": [], "profiled_norm_share": None,
                    }
        elif "round" in event:
            step = event["round"]
            if step["step"] == 0:  # the mode's runs count from their first step on
                report.runs += [runs[step["mode"], v] for v in job["variants"]]
            for variant, loss in step["losses"].items():
                runs[step["mode"], variant]["losses"].append(loss)
                runs[step["mode"], variant]["step_s"].append(step["seconds"][variant])
            advance(f"{step['mode']} step {step['step'] + 1}", event["work"])
        elif "profiled" in event:
            found = event["profiled"]
            runs["eager", found["norm"]]["profiled_norm_share"] = found["share"]
            advance(f"profiler: {found['norm']}", event["work"])

    error = workers.run(WORKER, job, env, on_event)
    if error:
        report.errors[framework] = error
    return events, done
