"""``normkit bench --model``: the model benchmark's options, table, JSON file and figures.

It shares ``--backend``, ``--device``, ``--quick``, ``--mode`` (here ``eager`` or
``compiled``), ``--json`` and ``--plot`` with ``normkit bench`` (`normkit.bench.cli`), which hands
the run here when ``--model`` is given.
"""

from __future__ import annotations

import argparse
import json
import sys

from normkit import arguments
from normkit.bench.model.config import MODES, NORMS, SIZES
from normkit.interrupts import INTERRUPTED, interruptible

AUTO = "auto"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options only ``--model`` reads."""
    group = parser.add_argument_group("the model benchmark (--model)")
    add = group.add_argument
    add("--model", nargs="?", const=AUTO, choices=[*SIZES, AUTO], metavar="SIZE",
        help="train a small Llama-like language model with each norm in torch, Keras and Flax "
             "instead: step times eager and compiled, the norms' share of a step, loss curves "
             "(docs/benchmarks-e2e.md). SIZE: tiny (seconds; also --quick), cpu (a few "
             "minutes on 2 cores; the default), gpu (the default on a GPU device)")
    add("--steps", type=arguments.positive_int,
        help="compiled training steps per norm (default: the size's)")
    add("--norm", action="append", choices=NORMS, help="only this norm (repeatable)")


def size_of(args: argparse.Namespace) -> str:
    """The size ``--model`` names; ``auto``: tiny with --quick, gpu on a GPU, else cpu."""
    if args.model != AUTO:
        return str(args.model)
    if args.quick:
        return "tiny"
    return "gpu" if args.device and args.device[0] != "cpu" else "cpu"


def run(args: argparse.Namespace) -> int:
    """Train, print the table and the agreement, write the files; 2 for options the model
    benchmark cannot take, 1 if a framework failed or no step was measured, 130 if interrupted
    (the steps taken until then are shown and written), else 0."""
    import dataclasses

    import normkit
    from normkit.bench import model
    from normkit.bench.model import plot, results

    if args.dtype:
        print("normkit bench: error: --model trains in float32; leave out --dtype",
              file=sys.stderr)
        return 2
    if args.mode and not set(args.mode) <= set(MODES):
        print(f"normkit bench: error: --model runs the modes {', '.join(MODES)}; "
              f"not {', '.join(sorted(set(args.mode) - set(MODES)))}", file=sys.stderr)
        return 2
    if args.device and len(args.device) > 1:
        print("normkit bench: error: --model runs on one device; give --device once",
              file=sys.stderr)
        return 2
    size = size_of(args)
    config = SIZES[size]
    if args.steps is not None:
        config = dataclasses.replace(
            config, steps=args.steps, warmup_steps=min(config.warmup_steps, args.steps),
            timing_warmup=min(config.timing_warmup, args.steps - 1),
        )
    report = interruptible(lambda: model.run(
        size=size, config=config, backends=args.backend,
        device=args.device[0] if args.device else "cpu", norms=args.norm, modes=args.mode,
    ))
    shown = sys.stderr if args.json == "-" else sys.stdout
    versions = "; ".join(
        f"{f}: " + ", ".join(f"{k} {v}" for k, v in vs.items()) for f, vs in report.versions.items()
    )
    print(f"normkit {normkit.__version__} bench --model {size} ({report.config.layers} blocks, "
          f"d_model {report.config.d_model}, {report.config.tokens_per_step} tokens a step), "
          f"{versions}", file=shown)
    if report.runs:
        print(results.table(report.runs, report.config), file=shown)
        print(agreement_line(report.agreement), file=shown)
    for framework, reason in report.skipped.items():
        print(f"{framework}: skipped, {reason}", file=shown)
    for framework, error in report.errors.items():
        print(f"normkit bench: error: {framework}: {error}", file=sys.stderr)
    stopped = ", interrupted before the end" if report.interrupted else ""
    print(f"{len(report.runs)} runs in {report.seconds:.0f} s{stopped}; load average "
          f"{report.machine['load_average_start']} at the start, "
          f"{report.machine['load_average_end']} at the end", file=shown)
    if args.json:
        found = {"normkit": normkit.__version__, "benchmark": "model", **report.to_dict()}
        arguments.write_text(args.json, json.dumps(found, indent=1))
    if not any(r["losses"] for r in report.runs):
        print("normkit bench: error: no step was measured"
              + (": no plot written" if args.plot else ""), file=sys.stderr)
        return INTERRUPTED if report.interrupted else 1
    if args.plot:
        plot.plot(args.plot, report.runs, report.config)
    if report.interrupted:
        return INTERRUPTED
    return 1 if report.errors else 0


def agreement_line(found: dict[str, object]) -> str:
    """The cross-framework agreement of the losses, one line."""
    spreads, early, final = (found[k] for k in ("step0_spread", "first_steps_spread",
                                                "final_loss_spread"))
    assert isinstance(spreads, dict) and isinstance(early, dict) and isinstance(final, dict)
    if not spreads:
        return "step-0 losses: fewer than two frameworks, nothing to compare"
    verdict = "within" if found["within_tolerance"] else "NOT within"
    return (f"losses across frameworks: largest spread at step 0 {max(spreads.values()):.2g}, "
            f"{verdict} the tolerance {found['tolerance']:.2g}; over the first "
            f"{found['first_steps']} steps {max(early.values()):.2g}; of the final loss "
            f"{max(final.values()):.2g}")
