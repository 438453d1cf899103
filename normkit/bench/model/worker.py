"""A model benchmark worker: one framework's training runs, in a process of its own
(`normkit.workers`).

``python -m normkit.bench.model.worker`` reads ``{"framework", "config", "folder", "device",
"variants", "modes", "profile"}`` and emits ``{"versions", "device_kind", "implementations"}``
(or ``{"unavailable": why}``), then per mode, after building one trainer per variant, one
``{"round": {"mode", "step", "losses", "seconds"}, "work"}`` per training step: every variant
takes that step, in an order reversed every other step (`normkit.bench.timing`'s rule), each
timed alone. After the eager steps, ``{"profiled": {"norm", "share"}, "work"}`` per norm where
the framework's module has a profiler (torch).
"""

from __future__ import annotations

import gc
import importlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from normkit import workers
from normkit.bench.model.config import IDENTITY, ModelConfig, config_from_dict
from normkit.bench.model.data import batches

FRAMEWORKS = {"torch": "torch", "tf": "keras", "jax": "flax"}
"""The framework each of normkit's backends stands for here: torch, Keras, Flax NNX."""
MODULES = {
    "torch": lambda: importlib.import_module("normkit.bench.model.torch"),
    "keras": lambda: importlib.import_module("normkit.bench.model.keras"),
    "flax": lambda: importlib.import_module("normkit.bench.model.flax"),
}
"""Each framework's model, imported only in its worker."""
PROFILED = ("torch",)
"""The frameworks whose module measures the norms' share with a profiler
(``profiled_norm_share``)."""
PROFILED_STEPS = 3
# Rough cost of a step, in compiled steps, to weigh the progress bar's estimate of the time
# left: per framework, an eager step and a compiled one's first (its compilation).
EAGER_WEIGHT = {"torch": 1.5, "keras": 7.0, "flax": 4.0}
COMPILE_WEIGHT = {"torch": 150.0, "keras": 250.0, "flax": 100.0}


def steps_of(config: ModelConfig, mode: str) -> int:
    return config.eager_steps if mode == "eager" else config.steps


def step_work(framework: str, mode: str, step: int, variants: int) -> float:
    """The weight of one round (every variant's step ``step``) for the progress bar."""
    if mode == "eager":
        return EAGER_WEIGHT[framework] * variants
    return (COMPILE_WEIGHT[framework] if step == 0 else 1.0) * variants


def planned_work(config: ModelConfig, framework: str, variants: Sequence[str],
                 modes: Sequence[str], profile: bool) -> tuple[int, float]:
    """One framework's job for the progress bar: its events (rounds, profiled norms) and
    their weight."""
    rounds = sum(steps_of(config, mode) for mode in modes)
    work = sum(
        step_work(framework, mode, step, len(variants))
        for mode in modes for step in range(steps_of(config, mode))
    )
    if profile and framework in PROFILED and "eager" in modes:
        profiled = sum(v != IDENTITY for v in variants)
        rounds += profiled
        work += EAGER_WEIGHT[framework] * PROFILED_STEPS * profiled
    return rounds, work


def run_job(job: Mapping[str, Any], emit: workers.Emit) -> None:
    """Train every variant of the job in each mode, emitting each step's losses and times."""
    framework = job["framework"]
    module = MODULES[framework]()
    config, device = config_from_dict(job["config"]), job["device"]
    seen = module.devices()
    if device not in seen:
        emit({"unavailable": f"no device {device} (it sees {seen})"})
        return
    variants: list[str] = list(job["variants"])
    emit({
        "versions": module.versions(), "device_kind": module.device_kind(device),
        "implementations": {v: module.implementation(v) for v in variants},
    })
    data, folder = batches(config), Path(job["folder"])
    for mode in job["modes"]:
        trainers = {
            v: module.Trainer(config, v, mode == "compiled", folder, data, device)
            for v in variants
        }
        count = steps_of(config, mode)
        for step in range(count):
            order = variants if step % 2 == 0 else variants[::-1]
            losses, seconds = {}, {}
            for variant in order:
                start = time.perf_counter()
                losses[variant] = trainers[variant].step(step)
                seconds[variant] = time.perf_counter() - start
            emit({"round": {"mode": mode, "step": step, "losses": losses, "seconds": seconds},
                  "work": step_work(framework, mode, step, len(variants))})
        if mode == "eager" and job["profile"] and framework in PROFILED:
            steps = [(count + i) % config.steps for i in range(PROFILED_STEPS)]
            for variant in variants:
                if variant != IDENTITY:
                    share = module.profiled_norm_share(trainers[variant], variant, steps)
                    emit({"profiled": {"norm": variant, "share": share},
                          "work": EAGER_WEIGHT[framework] * PROFILED_STEPS})
        del trainers
        gc.collect()


if __name__ == "__main__":
    workers.serve(run_job)
