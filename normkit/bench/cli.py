"""``normkit bench``: time normkit's norms against each framework's own; table, JSON and plot."""

from __future__ import annotations

import argparse
import sys

from normkit import backends

HELP = "time normkit's norms against each framework's own layers and a memory copy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``normkit bench``."""
    from normkit.bench.core import DTYPES

    parser.add_argument("--quick", action="store_true", help="hidden 1024 and 4096 at 1M elements, 3 rounds, one torch.compile pair")
    parser.add_argument("--backend", action="append", choices=[b.name for b in backends.BACKENDS], help="only this backend (repeatable)")
    parser.add_argument("--device", action="append", help="only this device (repeatable): cpu, cuda:0, gpu:0, ...")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="only this dtype (repeatable); default float32 and bfloat16, float16 too off the CPU")
    parser.add_argument("--json", metavar="PATH", help="write every row, with every field, as JSON")
    parser.add_argument("--plot", metavar="PATH.png", help="speed ratios figure (PNG); GB/s beside it in NAME-gbps.png")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write the files; 1 if a backend failed, else 0."""
    import normkit
    from normkit.bench import plot
    from normkit.bench import report as out
    from normkit.bench import run as bench

    result = bench(backends=args.backend, devices=args.device, dtypes=args.dtype, quick=args.quick)
    versions = "; ".join(f"{b}: " + ", ".join(f"{k} {v}" for k, v in vs.items()) for b, vs in result.versions.items())
    print(f"normkit {normkit.__version__} bench{' --quick' if args.quick else ''}, {versions}")
    if result.rows:
        print(out.table(result.rows))
    for backend, reason in result.skipped.items():
        print(f"{backend}: skipped, {reason}")
    for backend, error in result.errors.items():
        print(f"{backend}: FAILED, {error}", file=sys.stderr)
    print(f"{len(result.rows)} rows in {result.seconds:.0f} s")
    if args.json:
        out.write_json(args.json, result.rows, normkit=normkit.__version__, quick=args.quick, versions=result.versions,
                       skipped=result.skipped, errors=result.errors, seconds=result.seconds)
    if args.plot:
        if result.rows:
            plot.plot(args.plot, result.rows)
        else:
            print("no rows: no plot written", file=sys.stderr)
            return 1
    return 1 if result.errors else 0
