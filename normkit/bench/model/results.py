"""The model benchmark's numbers from its runs: step-time medians, ratios to LayerNorm, the norms'
share of a step, the cross-framework agreement of the losses, and the terminal table.

A run is one framework, norm (or the identity) and mode: its per-step ``losses`` and ``step_s``
as the worker measured them (see `normkit.bench.model` for the fields).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from normkit.bench.model.config import IDENTITY, MODES, NORMS, ModelConfig

Run = dict[str, Any]
AGREEMENT_STEPS = 5
"""The first steps whose losses the frameworks are compared on, beyond step 0."""


def final_loss(losses: Sequence[float]) -> float:
    """The mean loss of the last tenth of the steps (at least one)."""
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def summarize(runs: list[Run], config: ModelConfig) -> None:
    """Add the derived fields to every run, in place: ``median_step_s``, ``min_step_s`` (over
    the steps after ``config.timing_warmup``; None when there are none), ``first_step_s``,
    ``tokens_per_s``, ``final_loss``, ``vs_layernorm`` (median / the framework's own
    LayerNorm's, same framework and mode) and ``norm_share`` (``1 - identity median / median``)."""
    for run in runs:
        timed = run["step_s"][config.timing_warmup:]
        run["first_step_s"] = run["step_s"][0] if run["step_s"] else None
        run["median_step_s"] = statistics.median(timed) if timed else None
        run["min_step_s"] = min(timed) if timed else None
        run["tokens_per_s"] = (
            config.tokens_per_step / run["median_step_s"] if run["median_step_s"] else None
        )
        run["final_loss"] = final_loss(run["losses"]) if run["losses"] else None
    for run in runs:
        layer = _find(runs, run["framework"], run["mode"], "own-layer")
        identity = _find(runs, run["framework"], run["mode"], IDENTITY)
        median = run["median_step_s"]
        run["vs_layernorm"] = (
            median / layer["median_step_s"] if median and layer and layer["median_step_s"]
            else None
        )
        run["norm_share"] = (
            1.0 - identity["median_step_s"] / median
            if median and identity and identity["median_step_s"] and run["norm"] != IDENTITY
            else None
        )


def _find(runs: list[Run], framework: str, mode: str, norm: str) -> Run | None:
    return next(
        (r for r in runs if (r["framework"], r["mode"], r["norm"]) == (framework, mode, norm)),
        None,
    )


def agreement(runs: list[Run], config: ModelConfig) -> dict[str, Any]:
    """How closely the frameworks' losses agree, per norm: at step 0 (the same weights and
    batch), against `ModelConfig.step0_tolerance`, over the first `AGREEMENT_STEPS` steps (the
    optimizer's steps too), and in the final loss (`final_loss`) after all the steps; and each
    framework's eager against its compiled losses over the eager steps. A spread is the largest
    loss minus the smallest; ``within_tolerance`` is None when fewer than two frameworks have
    losses."""
    found: dict[str, Any] = {"tolerance": config.step0_tolerance(), "step0": {},
                             "step0_spread": {}, "first_steps": AGREEMENT_STEPS,
                             "first_steps_spread": {}, "final_loss_spread": {},
                             "eager_vs_compiled": {}}
    for norm in NORMS:
        curves, finals = {}, []
        for framework in dict.fromkeys(r["framework"] for r in runs):
            run = _find(runs, framework, "compiled", norm) or _find(runs, framework, "eager", norm)
            if run and run["losses"]:
                curves[framework] = run["losses"]
                finals.append(final_loss(run["losses"]))
        if curves:
            found["step0"][norm] = {f: losses[0] for f, losses in curves.items()}
        if len(curves) > 1:
            found["step0_spread"][norm] = _spread([c[0] for c in curves.values()])
            steps = min(AGREEMENT_STEPS, *(len(c) for c in curves.values()))
            found["first_steps_spread"][norm] = max(
                _spread([c[i] for c in curves.values()]) for i in range(steps)
            )
            found["final_loss_spread"][norm] = _spread(finals)
    for run in runs:
        other = _find(runs, run["framework"], "compiled", run["norm"])
        if run["mode"] == "eager" and other and run["losses"] and other["losses"]:
            pairs = zip(run["losses"], other["losses"], strict=False)
            found["eager_vs_compiled"].setdefault(run["framework"], {})[run["norm"]] = max(
                abs(a - b) for a, b in pairs
            )
    spreads = found["step0_spread"].values()
    found["within_tolerance"] = max(spreads) <= found["tolerance"] if spreads else None
    return found


def _spread(values: list[float]) -> float:
    return max(values) - min(values)


def table(runs: list[Run], config: ModelConfig) -> str:
    """Per framework, one line per norm: step times eager and compiled with their ratio to the
    framework's LayerNorm, the norms' share (identity ablation; torch's profiler too), tokens
    per second and the final loss of the compiled run."""
    lines = []
    head = (f"  {'norm':<34} {'eager ms':>9} {'vs LN':>6} {'compiled ms':>12} {'vs LN':>6}"
            f" {'norm share':>14} {'tokens/s':>9} {'final loss':>10} {'1st step s':>10}")
    for framework in dict.fromkeys(r["framework"] for r in runs):
        mine = [r for r in runs if r["framework"] == framework]
        lines += [f"{framework} on {mine[0]['device']}", head]
        for norm in (*NORMS, IDENTITY):
            found = {m: _find(mine, framework, m, norm) for m in MODES}
            if not any(found.values()):
                continue
            name = next(r["implementation"] for r in found.values() if r)
            cells = []
            for mode in MODES:
                run = found[mode]
                ms = run["median_step_s"] * 1e3 if run and run["median_step_s"] else None
                ratio = run["vs_layernorm"] if run else None
                cells += [_number(ms, 9, ".1f"), _number(ratio, 6, ".2f")]
            shares = [run["norm_share"] if run else None for run in found.values()]
            share = "/".join("-" if s is None else f"{s:.0%}" for s in shares)
            profiled = found["eager"].get("profiled_norm_share") if found["eager"] else None
            if profiled is not None:
                share += f" p{profiled:.0%}"
            compiled = found["compiled"] or found["eager"]
            assert compiled is not None
            lines.append(
                f"  {name:<34} {' '.join(cells[:2])} {cells[2]:>12} {cells[3]} {share:>14} "
                f"{_number(compiled['tokens_per_s'], 9, '.0f')} "
                f"{_number(compiled['final_loss'], 10, '.3f')} "
                f"{_number(compiled['first_step_s'], 10, '.1f')}"
            )
    lines.append(
        "vs LN: median step time / the framework's LayerNorm's; norm share: 1 - the identity's "
        "median / this one's, eager/compiled (p: torch.profiler's, eager); tokens/s, final "
        f"loss (mean of the last tenth of {config.steps} steps) and the first step's seconds "
        "(its compilation) of the compiled run"
    )
    return "\n".join(lines)


def _number(value: float | None, width: int, spec: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"

