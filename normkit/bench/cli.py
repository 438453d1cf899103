"""``normkit bench``: time normkit's norms against each framework's own; summary, table, JSON and
plot; ``--combine`` reads several runs' JSON files as one."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from normkit import arguments, backends
from normkit.interrupts import INTERRUPTED, interruptible

HELP = "time normkit's norms against each framework's own layers and a memory copy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``normkit bench``."""
    from normkit.bench.core import DTYPES, MODES, TIMINGS
    from normkit.bench.model.config import MODES as MODEL_MODES

    add = parser.add_argument
    add("--quick", action="store_true",
        help="a smoke run (under a minute on 2 cores once the compilation caches are warm): "
             "hidden 4096 at 1M elements and one token, float32 (--dtype for others), 3 samples, "
             "one torch.compile pair, outputs as allocated only")
    add("--backend", action="append", choices=[b.name for b in backends.BACKENDS],
        help="only this backend (repeatable)")
    add("--device", action="append", type=arguments.device,
        help="only this device (repeatable): cpu, cuda:N (alias gpu:N), tpu:N, mps")
    add("--dtype", action="append", choices=DTYPES,
        help="only this dtype (repeatable); default float32 and bfloat16, float16 too off the CPU")
    add("--timing", action="append", choices=TIMINGS,
        help="only this timing (repeatable; default both): latency waits for the device after "
             "each call, throughput between many calls back to back")
    add("--mode", action="append", choices=[*MODES, *MODEL_MODES],
        help="only this mode (repeatable; default every mode of each backend); with --model: "
             f"{' or '.join(MODEL_MODES)}")
    add("--table", action="store_true",
        help="print every row after the summary, a header per group")
    arguments.add_output(parser, "--json", "every row, with every field, as JSON")
    add("--plot", metavar="PATH.png", type=arguments.output_file,
        help="speed ratios figure (PNG); GB/s beside it in NAME-gbps.png")
    add("--combine", nargs="+", metavar="RUN.json", type=arguments.input_file,
        help="run nothing: read these runs' --json files as one (each figure their median) and "
             "judge the targets on them; --json and --plot write the combination")
    from normkit.bench.model import cli as model_cli

    model_cli.add_arguments(parser)


RUN_OPTIONS = ("quick", "backend", "device", "dtype", "timing", "mode")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or combine runs), print the summary (then every row with ``--table``),
    write the files; 1 if a backend failed or no row was measured, 130 if it was interrupted
    (Ctrl-C or SIGTERM: the rows measured until then are shown and written, with
    ``"interrupted": true`` in the JSON), else 0. ``--model`` runs the model benchmark
    instead (`normkit.bench.model`)."""
    if args.model is not None:
        from normkit.bench.model import cli as model_cli

        return model_cli.run(args)
    if args.combine:
        given = [f"--{o}" for o in RUN_OPTIONS if getattr(args, o)]
        if given:
            raise ValueError(f"--combine reads runs and measures nothing: drop {', '.join(given)}")
        return _combine(args)
    from normkit.bench.core import MODES

    if args.mode and not set(args.mode) <= set(MODES):
        raise ValueError(f"--mode {', '.join(sorted(set(args.mode) - set(MODES)))} is a mode of "
                         "--model only")
    import normkit
    from normkit.bench import run as bench

    result = interruptible(lambda: bench(
        backends=args.backend, devices=args.device, dtypes=args.dtype, timings=args.timing,
        modes=args.mode, quick=args.quick,
    ))
    data = {"normkit": normkit.__version__, "quick": args.quick, "versions": result.versions,
            "machine": result.machine, "skipped": result.skipped, "errors": result.errors,
            "seconds": result.seconds, "interrupted": result.interrupted, "rows": result.rows}
    return _report(args, data, [data])


def _combine(args: argparse.Namespace) -> int:
    from normkit.bench import runs

    loaded = [runs.load(path) for path in args.combine]
    return _report(args, runs.merge(loaded), loaded)


def _report(args: argparse.Namespace, data: dict[str, Any], parts: list[dict[str, Any]]) -> int:
    """Print the summary (and the table), write the JSON and the figures; the exit status."""
    from normkit.bench import plot, runs, summary, targets
    from normkit.bench import report as out

    shown = sys.stderr if args.json == "-" else sys.stdout  # stdout is then the JSON's alone
    rows = data["rows"]
    verdicts = targets.judge([runs.as_run(part) for part in parts]) if rows else []
    print(summary.summary(data, verdicts, len(parts)), file=shown)
    if args.table and rows:
        print("\n" + out.table(rows), file=shown)
    for line in summary.skipped(data):
        print(line, file=shown)
    for backend, error in data["errors"].items():
        print(f"normkit bench: error: {backend}: {error}", file=sys.stderr)
    stopped = ", interrupted before the end of the sweep" if data["interrupted"] else ""
    more = "" if args.table else "; every row: --table, every field: --json PATH"
    print(f"{len(rows)} rows in {data['seconds']:.0f} s{stopped}{more}", file=shown)
    if args.json:
        verdict_data = [{"target": v.target.name, "values": v.values, "runs": v.runs,
                         "met": v.met, "final": v.final} for v in verdicts]
        arguments.write_text(args.json, json.dumps({**data, "targets": verdict_data}, indent=1))
    if not rows:
        print(
            "normkit bench: error: no row was measured"
            + (": no plot written" if args.plot else ""),
            file=sys.stderr,
        )
        return INTERRUPTED if data["interrupted"] else 1
    if args.plot:
        plot.plot(args.plot, rows)
    if data["interrupted"]:
        return INTERRUPTED
    return 1 if data["errors"] else 0
