"""``normkit bench``: time normkit's norms against each framework's own; table, JSON and plot."""

from __future__ import annotations

import argparse
import json
import sys

from normkit import arguments, backends
from normkit.interrupts import INTERRUPTED, interruptible

HELP = "time normkit's norms against each framework's own layers and a memory copy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``normkit bench``."""
    from normkit.bench.core import DTYPES

    add = parser.add_argument
    add("--quick", action="store_true",
        help="hidden 1024 and 4096 at 1M elements, 3 rounds, one torch.compile pair")
    add("--backend", action="append", choices=[b.name for b in backends.BACKENDS],
        help="only this backend (repeatable)")
    add("--device", action="append", type=arguments.device,
        help="only this device (repeatable): cpu, cuda:N (alias gpu:N), tpu:N, mps")
    add("--dtype", action="append", choices=DTYPES,
        help="only this dtype (repeatable); default float32 and bfloat16, float16 too off the CPU")
    arguments.add_output(parser, "--json", "every row, with every field, as JSON")
    add("--plot", metavar="PATH.png", type=arguments.output_file,
        help="speed ratios figure (PNG); GB/s beside it in NAME-gbps.png")
    from normkit.bench.model import cli as model_cli

    model_cli.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write the files; 1 if a backend failed or no row was
    measured, 130 if it was interrupted (Ctrl-C or SIGTERM: the rows measured until then are
    shown and written, with ``"interrupted": true`` in the JSON), else 0."""
    if args.model is not None:
        from normkit.bench.model import cli as model_cli

        return model_cli.run(args)
    import normkit
    from normkit.bench import plot
    from normkit.bench import report as out
    from normkit.bench import run as bench

    result = interruptible(lambda: bench(
        backends=args.backend, devices=args.device, dtypes=args.dtype, quick=args.quick
    ))
    shown = sys.stderr if args.json == "-" else sys.stdout  # stdout is then the JSON's alone
    versions = "; ".join(
        f"{b}: " + ", ".join(f"{k} {v}" for k, v in vs.items()) for b, vs in result.versions.items()
    )
    print(f"normkit {normkit.__version__} bench{' --quick' if args.quick else ''}, {versions}",
          file=shown)
    if result.rows:
        print(out.table(result.rows), file=shown)
    for backend, reason in result.skipped.items():
        print(f"{backend}: skipped, {reason}", file=shown)
    for backend, error in result.errors.items():
        print(f"normkit bench: error: {backend}: {error}", file=sys.stderr)
    stopped = ", interrupted before the end of the sweep" if result.interrupted else ""
    print(f"{len(result.rows)} rows in {result.seconds:.0f} s{stopped}", file=shown)
    meta = {"normkit": normkit.__version__, "quick": args.quick, "versions": result.versions,
            "skipped": result.skipped, "errors": result.errors, "seconds": result.seconds,
            "interrupted": result.interrupted}
    if args.json:
        arguments.write_text(args.json, json.dumps({**meta, "rows": result.rows}, indent=1))
    if not result.rows:
        print(
            "normkit bench: error: no row was measured"
            + (": no plot written" if args.plot else ""),
            file=sys.stderr,
        )
        return INTERRUPTED if result.interrupted else 1
    if args.plot:
        plot.plot(args.plot, result.rows)
    if result.interrupted:
        return INTERRUPTED
    return 1 if result.errors else 0
