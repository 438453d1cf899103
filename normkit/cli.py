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
import types
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

import normkit
from normkit import arguments, backends, dtypes
from normkit.bench import cli as bench_cli
from normkit.doctor import cli as doctor_cli
from normkit.interrupts import INTERRUPTED, interruptible
from normkit.port import cli as port_cli
from normkit.spec import (
    ALL_KINDS,
    CASTS,
    DEFAULT_ALPHA_INIT,
    DEFAULT_EPS,
    EPS_PLACEMENTS,
    NormSpec,
)


def _add_info(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--no-devices", action="store_true", help="skip asking each backend for its devices"
    )
    parser.add_argument(
        "--support", action="store_true",
        help="also print what each implementation computes: one line per NormSpec option (and "
             "per call argument one framework takes), one column per implementation of each "
             "installed backend (torch's kernels, normkit.tf on each Keras backend, normkit.jax's "
             "XLA program and Pallas kernels); + computes it, ~ the backend falls back to "
             "another of its implementations, - refuses it. Asked of each backend's own code in "
             "a worker (about a minute); docs/support.md has the reasons",
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
    report: dict[str, object] = {
        "normkit": normkit.__version__,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "backends": rows,
    }
    supported = None
    if args.support:
        from normkit.conformance import support

        supported = support.table()
        report["support"] = {
            "columns": list(supported.columns),
            "cells": {o: {c: list(supported.cells[o][c]) for c in supported.columns}
                      for o in supported.options},
            "missing": dict(supported.missing),
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
    if supported is not None:
        from normkit.conformance import support

        print("support (docs/support.md):")
        print(support.text(supported))
    return 0


def _add_reference(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("values", nargs="+", type=float, metavar="VALUE", help="one row of input values")
    add("--kind", choices=ALL_KINDS, default="rms",
        help="rms, partial_rms (needs --p), layer or dyt (default rms)")
    add("--eps", type=float, default=None,
        help=f"the constant that keeps 1/rms finite (default {DEFAULT_EPS:g}; DyT has none)")
    add("--eps-placement", choices=EPS_PLACEMENTS, default="inside",
        help="inside the square root, 1/sqrt(s + eps), or outside it, 1/(sqrt(s) + eps) "
             "(default inside)")
    add("--p", type=float, default=None,
        help="partial_rms: the statistic reads the first floor(n p) values, 0 < p <= 1")
    add("--alpha-init", type=float, default=None,
        help=f"dyt: y = w tanh(alpha x) + b with this alpha (default {DEFAULT_ALPHA_INIT:g})")
    add("--scale-offset", type=float, default=0.0,
        help="the scale is scale_offset + w: 1 for Gemma's convention (default 0)")
    add("--cast", choices=CASTS, default="after_scale",
        help="for float16 and bfloat16 inputs: round y_hat to the input dtype before the scale "
             "(before_scale, Llama) or round once after it (default after_scale)")
    add("--dtype", choices=list(dtypes.DTYPE_NAMES), default="float64",
        help="the dtype the values are rounded to first (default float64)")
    add("--scale", type=float, nargs="+", metavar="W",
        help="w, one value per input value (default: its initial value, 1 - scale_offset)")
    add("--bias", type=float, nargs="+", metavar="B",
        help="b, one value per input value (default: no bias)")


def _run_reference(args: argparse.Namespace) -> int:
    from normkit import reference

    dyt = args.kind == "dyt"
    if dyt and (args.eps is not None or args.p is not None):
        raise ValueError("--kind dyt has no statistic: leave out --eps and --p")
    if not dyt and args.alpha_init is not None:
        raise ValueError(f"--alpha-init applies to --kind dyt, not {args.kind}")
    spec = NormSpec(
        args.kind,
        eps=None if dyt else args.eps,
        eps_placement=None if dyt else args.eps_placement,
        p=args.p,
        scale_offset=args.scale_offset,
        bias=True if args.bias else (None if dyt else False),
        cast=args.cast,
        alpha_init=args.alpha_init,
    )
    if dyt and not args.bias:
        spec = spec.replace(bias=False)
    x = np.asarray(args.values, dtype=np.float64).astype(dtypes.DTYPE_NAMES[args.dtype])
    y = reference.normalize(x, spec, args.scale, args.bias)
    grads = reference.normalize_vjp(x, np.ones_like(x), spec, args.scale, args.bias)
    print(repr(spec))
    print(f"x        = {_row(x)}  ({x.dtype.name})")
    print(f"y        = {_row(y)}  ({y.dtype.name})")
    print(f"d sum(y) / dx = {_row(grads.dx)}  ({grads.dx.dtype.name})")
    for name, value in (("w", grads.dscale), ("b", grads.dbias)):
        if value is not None and (args.scale if name == "w" else args.bias):
            print(f"d sum(y) / d{name} = {_row(value)}  ({value.dtype.name})")
    return 0


def _row(values: np.ndarray) -> str:
    """The values as the shortest decimals that read back to them in their own dtype, float64
    to 6 significant digits (``%g``)."""
    if values.dtype == np.float64:
        return "[" + ", ".join(f"{v:g}" for v in values.tolist()) + "]"
    return "[" + ", ".join(str(v) for v in values) + "]"


def _add_conformance(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--full", action="store_true",
        help="the whole matrix (1131 cases per target and device, on more shapes: about 30 "
             "minutes on 2 CPU cores); by default a matrix that still touches every kind, "
             "option and dtype, forward and backward")
    add("--backend", type=arguments.names,
        help="comma-separated targets or prefixes: torch, tf, tf[jax,jit], jax.nnx, ... "
             "(default: every installed one)")
    add("--kind", type=arguments.names,
        help=f"comma-separated kinds: {', '.join(ALL_KINDS)} (default: all)")
    add("--dtype", type=arguments.names,
        help="comma-separated dtypes: float32, float16, bfloat16, float64 (default: all)")
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
    parser.add_argument(
        "layer", metavar="LAYER",
        help=f"a built-in layer ({', '.join(names)}), or your own: package.module:function "
             "for a function fn(x) -> y (fn(x, scale, bias) with --params), or "
             "package.module:Class for a layer Class(n) called as layer(x)",
    )
    parser.add_argument("--n", type=arguments.row_size, default=64,
                        help="the normalized size to probe, at least 2 (default 64)")
    parser.add_argument("--device", type=arguments.device, default="cpu",
                        help="cpu (default), cuda:N (alias gpu:N), tpu:N or mps")
    parser.add_argument("--backend", choices=[b.name for b in backends.BACKENDS],
                        help="your function's framework (default: from its module's package)")
    parser.add_argument("--params", action="store_true",
                        help="your function takes (x, scale, bias), so the scale, offset, bias "
                             "and cast order can be determined too")


def _run_identify(args: argparse.Namespace) -> int:
    import importlib
    import os

    from normkit.conformance.peers import PEERS

    peer = next((p for p in PEERS if p.name == args.layer), None)
    if peer is None:
        return _identify_own(args)
    if args.backend or args.params:
        raise ValueError("--backend and --params apply to your own function, not to a built-in")
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
        print(f"it appears to implement {peer.claims!r}")
    return 0


# the framework of a function, from the top-level package of the module it is defined in
_FRAMEWORKS = {"torch": "torch", "transformers": "torch", "jax": "jax", "flax": "jax",
               "tensorflow": "tf", "keras": "tf", "tf_keras": "tf"}


def _framework(target: object, module: object) -> str | None:
    """The backend of ``target``: from the package it is defined in, else from the one
    framework its module imports (``import torch``)."""
    defined = str(getattr(target, "__module__", "") or "").split(".")[0]
    if defined in _FRAMEWORKS:
        return _FRAMEWORKS[defined]
    imported = {
        _FRAMEWORKS[top] for value in vars(module).values()
        if (top := str(getattr(value, "__name__", "") if isinstance(value, types.ModuleType)
                       else getattr(value, "__module__", "") or "").split(".")[0]) in _FRAMEWORKS
    }
    return imported.pop() if len(imported) == 1 else None


def _identify_own(args: argparse.Namespace) -> int:
    """``normkit identify package.module:function`` (or ``:Class``, built with ``n``)."""
    import importlib

    from normkit.identify import identify

    module_name, colon, attribute = args.layer.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(
            f"{args.layer!r} is neither a built-in layer (normkit identify --help lists them) "
            "nor package.module:function"
        )
    module = importlib.import_module(module_name)
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"{module_name} has no attribute {attribute!r}")
    if not callable(target):
        raise ValueError(f"{args.layer} is not callable")
    backend = args.backend or _framework(target, module)
    if backend is None:
        raise ValueError(f"cannot tell the framework of {args.layer}: pass --backend")
    fn = target(args.n) if isinstance(target, type) else target
    if isinstance(target, type) and args.params:
        raise ValueError("--params applies to a function: a layer Class(n) has its own")
    try:
        found = identify(fn, (args.n,), backend=backend, params=args.params, device=args.device)
    except ValueError as exc:  # it behaves like no norm: a finding, not a usage error
        _error("identify", f"{args.layer}: {exc}")
        return 1
    print(f"{args.layer} (size {args.n}, {backend}) behaves as:")
    print(found.describe())
    return 0


def _add_warmup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", action="append", metavar="DTYPE",
                        help="compile for inputs of this dtype only: float32, bfloat16 or float16 "
                             "(repeatable; default: all three)")
    parser.add_argument("--no-gated", action="store_true",
                        help="leave out the kernels of gated and grouped norms (default: compile "
                             "them too)")


def _run_warmup(args: argparse.Namespace) -> int:
    from normkit.torch.warmup import DTYPES, compile_now

    return compile_now(args.dtype or tuple(DTYPES), gated=not args.no_gated)


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]

COMMANDS: list[Command] = [
    ("bench", bench_cli.add_arguments, bench_cli.run),
    ("conformance", _add_conformance, _run_conformance),
    ("doctor", doctor_cli.add_arguments, doctor_cli.run),
    ("identify", _add_identify, _run_identify),
    ("info", _add_info, _run_info),
    ("port", port_cli.add_arguments, port_cli.run),
    ("reference", _add_reference, _run_reference),
    ("warmup", _add_warmup, _run_warmup),
]
HELP = {
    "bench": bench_cli.HELP,
    "conformance": (
        "check every installed implementation against the reference, forward and backward"
    ),
    "doctor": doctor_cli.HELP,
    "identify": (
        "probe a norm (a framework's built-in layer, or your own function) and print the "
        "NormSpec it follows"
    ),
    "info": (
        "normkit's version and, per backend, whether it is installed, its version and devices "
        "(--support: what each implementation computes)"
    ),
    "port": port_cli.HELP,
    "reference": (
        "apply the numpy reference to one row of numbers (a quick way to see the semantics)"
    ),
    "warmup": (
        "compile normkit.torch's CPU kernel (numba) on this machine now, so that no process "
        "runs the slower composite path while it compiles"
    ),
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``normkit COMMAND: error: ...``; the
    top-level one keeps its subcommands' parsers in ``commands``."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> _Parser:
    description = (normkit.__doc__ or "normkit").splitlines()[0]
    parser = _Parser(prog="normkit", description=description)
    parser.add_argument("--version", action="version", version=f"normkit {normkit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = {}
    for name, add_arguments, run in COMMANDS:
        command = sub.add_parser(name, help=HELP[name], description=HELP[name])
        add_arguments(command)
        command.set_defaults(run=run)
        parser.commands[name] = command
    return parser


def _error(command: str, message: str) -> None:
    print(f"normkit {command}: error: {message}", file=sys.stderr)


def _one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status (see the module doc)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's error, "normkit COMMAND: error: ..."
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
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
