"""The ``normkit`` command line (also ``python -m normkit``).

Each subcommand is a module-level pair: a function that adds its arguments and one that runs it.
Heavy imports happen inside the run functions, so ``normkit --help`` stays fast.

Exit status: 0 when at least one check ran and none failed, 1 when a check failed (or none could
run), 2 for a usage error (bad arguments, a missing file, a backend that is not installed), 130
when interrupted (Ctrl-C; for ``bench`` and ``conformance`` SIGTERM too, after which they show
and write what they finished).
Every error is one line on stderr, ``normkit COMMAND: error: ...``, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

import numpy as np

import normkit
from normkit import arguments, backends, dtypes
from normkit.bench import cli as bench_cli
from normkit.doctor import cli as doctor_cli
from normkit.interrupts import INTERRUPTED, interruptible
from normkit.port import cli as port_cli
from normkit.spec import ALL_KINDS, CASTS, EPS_PLACEMENTS, KINDS, NormSpec


def _add_info(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--no-devices", action="store_true", help="skip asking each backend for its devices"
    )


def _run_info(args: argparse.Namespace) -> int:
    rows = []
    for backend in backends.BACKENDS:
        versions = backend.versions()
        complete = not backend.missing()
        alternative = None if complete else backend.alternative()
        row: dict[str, object] = {
            "backend": backend.name,
            "module": backend.module,
            "installed": complete or alternative is not None,
            "versions": versions,
            "install": backend.install,
        }
        if alternative is not None:
            row["via"] = alternative.note
            row["env"] = dict(alternative.env)
        if complete and not args.no_devices:
            try:
                row["devices"] = backend.devices()
            except RuntimeError as exc:
                row["devices_error"] = str(exc)
        rows.append(row)
    report = {
        "normkit": normkit.__version__,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "backends": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"normkit {normkit.__version__} (Python {report['python']}, numpy {np.__version__})")
    for row in rows:
        found = row["versions"]
        assert isinstance(found, dict)
        listed = ", ".join(f"{p} {v or '-'}" for p, v in found.items())
        if not row["installed"]:
            print(f"  {row['module']:<13} not installed ({listed}); {row['install']}")
            continue
        if "via" in row:
            env = row["env"]
            assert isinstance(env, dict)
            selected = " ".join(f"{k}={v}" for k, v in env.items())
            print(f"  {row['module']:<13} {listed}; usable as {row['via']} ({selected})")
            continue
        seen = row.get("devices", row.get("devices_error", "devices not listed"))
        devices = ", ".join(seen) if isinstance(seen, list) else seen
        print(f"  {row['module']:<13} {listed}; devices: {devices}")
    return 0


def _add_reference(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("values", nargs="+", type=float, help="one row of input values")
    parser.add_argument("--kind", choices=KINDS, default="rms")
    parser.add_argument("--eps", type=float, default=NormSpec.eps)
    parser.add_argument("--eps-placement", choices=EPS_PLACEMENTS, default="inside")
    parser.add_argument("--p", type=float, default=None, help="partial fraction (partial_rms)")
    parser.add_argument("--scale-offset", type=float, default=0.0)
    parser.add_argument("--cast", choices=CASTS, default="after_scale")
    parser.add_argument("--dtype", choices=list(dtypes.DTYPE_NAMES), default="float64")
    parser.add_argument("--scale", type=float, nargs="+", help="w, one value per input value")
    parser.add_argument("--bias", type=float, nargs="+", help="b, one value per input value")


def _run_reference(args: argparse.Namespace) -> int:
    from normkit import reference

    spec = NormSpec(
        args.kind,
        eps=args.eps,
        eps_placement=args.eps_placement,
        p=args.p,
        scale_offset=args.scale_offset,
        bias=True if args.bias else None,
        cast=args.cast,
    )
    x = np.asarray(args.values, dtype=np.float64).astype(dtypes.DTYPE_NAMES[args.dtype])
    y = reference.normalize(x, spec, args.scale, args.bias)
    dx = reference.normalize_vjp(x, np.ones_like(x), spec, args.scale, args.bias).dx
    print(spec)
    print(f"x       = {x.astype(np.float64).tolist()}  ({args.dtype})")
    print(f"y       = {y.astype(np.float64).tolist()}  ({y.dtype.name})")
    print(f"d sum(y)/dx = {dx.tolist()}")
    return 0


def _add_conformance(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--full", action="store_true",
        help="the whole matrix (994 cases per target and device: about 25 minutes on 2 CPU "
             "cores); by default a matrix that still touches every kind, option and dtype, "
             "forward and backward (a few minutes)")
    add("--backend", type=arguments.names,
        help="comma-separated targets or prefixes: torch, tf, tf[jax,jit], jax.nnx, ...")
    add("--kind", type=arguments.names, help=f"comma-separated kinds of {list(ALL_KINDS)}")
    add("--dtype", type=arguments.names,
        help="comma-separated dtypes: float32, float16, bfloat16, float64")
    add("--device", type=arguments.devices,
        help="comma-separated devices: cpu, cuda:N (alias gpu:N), tpu:N, mps (default: all seen)")
    add("--peers", action="store_true",
        help="check the frameworks' built-in layers instead of normkit's")
    add("--jobs", type=arguments.positive_int, default=2,
        help="worker processes at once (default 2)")
    add("--no-pairwise", action="store_true",
        help="skip comparing implementations with each other")
    arguments.add_output(parser, "--json", "every case with its figures")
    arguments.add_output(parser, "--markdown", "the report as Markdown")


def _run_conformance(args: argparse.Namespace) -> int:
    from normkit import conformance
    from normkit.conformance import report as reports

    if args.json == "-" and args.markdown == "-":
        raise ValueError("--json and --markdown cannot both write to stdout")
    result = interruptible(lambda: conformance.run(
        backends=args.backend,
        kinds=tuple(args.kind) if args.kind else ALL_KINDS,
        dtypes=tuple(args.dtype) if args.dtype else None,
        devices=args.device,
        quick=not args.full,
        peers=args.peers,
        jobs=args.jobs,
        pairwise=not args.no_pairwise,
    ))
    to_stdout = "-" in (args.json, args.markdown)
    print(reports.text(result), file=sys.stderr if to_stdout else sys.stdout)
    title = (
        "Built-in layers against the NormSpec they appear to implement" if args.peers
        else "normkit conformance"
    )
    if args.json:
        arguments.write_text(args.json, reports.to_json(result))
    if args.markdown:
        render = reports.peers_markdown if args.peers else reports.markdown
        arguments.write_text(args.markdown, render(result, title))
    if result.interrupted:
        _error("conformance", "interrupted: the report holds the cases that finished")
        return INTERRUPTED
    if not result.ran:
        reasons = [f"{t}: {why}" for t, why in result.skipped_targets.items()]
        reasons += sorted({f"{r.target}: {r.reason}" for r in result.results})[:3]
        _error("conformance", "no case ran: " + ("; ".join(reasons) or "no target selected"))
        return 1
    # Peers depart from their specs by design; the report documents how. normkit's own must not.
    return 1 if result.failed and not args.peers else 0


def _add_identify(parser: argparse.ArgumentParser) -> None:
    from normkit.conformance.peers import PEERS

    names = [p.name for p in PEERS]
    parser.add_argument("layer", choices=names, metavar="LAYER", help=f"one of: {', '.join(names)}")
    parser.add_argument("--n", type=arguments.row_size, default=64,
                        help="the normalized size to probe, at least 2 (default 64)")
    parser.add_argument("--device", type=arguments.device, default="cpu",
                        help="cpu (default), cuda:N (alias gpu:N), tpu:N or mps")


def _run_identify(args: argparse.Namespace) -> int:
    import importlib
    import os

    from normkit.conformance.peers import PEERS

    peer = next(p for p in PEERS if p.name == args.layer)
    missing = peer.missing()
    if missing:
        raise ImportError(f"{args.layer}: {missing}")
    os.environ.update(peer.environment)
    seen = backends.bridge(peer.backends[0]).devices()
    if args.device not in seen:
        raise ValueError(f"device {args.device} is not one {peer.backends[0]} sees: {seen}")
    hook = importlib.import_module(peer.hook)
    try:
        found = hook.identify(**peer.variant, n=args.n, device=args.device)
    except ValueError as exc:  # the layer behaves like no norm: a finding, not a usage error
        _error("identify", f"{args.layer}: {exc}")
        return 1
    print(f"{args.layer} (size {args.n}) behaves as:")
    print(found.describe())
    if peer.claims is not None and found.spec != peer.claims:
        print(f"it appears to implement {peer.claims}")
    return 0


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]

COMMANDS: list[Command] = [
    ("bench", bench_cli.add_arguments, bench_cli.run),
    ("conformance", _add_conformance, _run_conformance),
    ("doctor", doctor_cli.add_arguments, doctor_cli.run),
    ("identify", _add_identify, _run_identify),
    ("info", _add_info, _run_info),
    ("port", port_cli.add_arguments, port_cli.run),
    ("reference", _add_reference, _run_reference),
]
HELP = {
    "bench": bench_cli.HELP,
    "conformance": (
        "check every installed implementation against the reference, forward and backward"
    ),
    "doctor": doctor_cli.HELP,
    "identify": "probe a framework's built-in norm layer and print the NormSpec it follows",
    "info": "normkit's version and, per backend, whether it is installed, its version and devices",
    "port": port_cli.HELP,
    "reference": (
        "apply the numpy reference to one row of numbers (a quick way to see the semantics)"
    ),
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``normkit COMMAND: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    description = (normkit.__doc__ or "normkit").splitlines()[0]
    parser = _Parser(prog="normkit", description=description)
    parser.add_argument("--version", action="version", version=f"normkit {normkit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add_arguments, run in COMMANDS:
        command = sub.add_parser(name, help=HELP[name], description=HELP[name])
        add_arguments(command)
        command.set_defaults(run=run)
    return parser


def _error(command: str, message: str) -> None:
    print(f"normkit {command}: error: {message}", file=sys.stderr)


def _one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status (see the module doc)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (ValueError, TypeError, ImportError, OSError) as exc:
        _error(args.command, _one_line(exc))
        return 2
    except KeyboardInterrupt:
        _error(args.command, "interrupted")
        return INTERRUPTED
    except Exception as exc:  # a framework's own failure: still one line, and a failed run
        _error(args.command, f"{type(exc).__name__}: {_one_line(exc)}")
        return 1
