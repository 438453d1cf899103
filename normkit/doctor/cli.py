"""``normkit doctor PATH [--against ORIGINAL] [--json OUT] [--fix OUT]``.

Exit status 0 when no norm tensor has a finding, 1 when one has (so it can gate a conversion
in CI; with ``--fix`` the corrected copy is written and the status is still 1), 2 for a usage
error or a checkpoint that cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from normkit import arguments

HELP = ("find the norm bugs in a converted checkpoint (Hugging Face, mlx-lm, GGUF, normkit "
        "norms): offset doubled or missing, eps changed, dtype narrowed")


def _existing(text: str) -> str:
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return text


def _new(text: str) -> str:
    path = Path(text)
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text} exists; --fix writes a new checkpoint")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {path.parent} does not exist")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``normkit doctor``."""
    parser.add_argument("path", metavar="PATH", type=_existing,
                        help="a Hugging Face or mlx-lm model directory (config.json and "
                        "safetensors), a GGUF file or a normkit norms file")
    parser.add_argument("--against", metavar="ORIGINAL", type=_existing,
                        help="the checkpoint PATH was converted from: every norm tensor is "
                        "compared with its counterpart, exactly (equal, +1, -1, scaled, "
                        "different)")
    arguments.add_output(parser, "--json", "the report as JSON")
    parser.add_argument("--fix", metavar="OUT", type=_new,
                        help="write a corrected copy of PATH to OUT (needs --against: only "
                        "exact findings are corrected)")


def run(args: argparse.Namespace) -> int:
    """Examine ``args.path``; print the report; 1 on a finding."""
    from normkit.doctor.examine import examine
    from normkit.doctor.fix import fix

    if args.fix and not args.against:
        raise ValueError("--fix needs --against ORIGINAL: only exact findings are corrected")
    report = examine(args.path, against=args.against)
    if args.json:
        arguments.write_text(args.json, report.to_json())
    print(report.describe(), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.fix:
        written = fix(report, args.fix)
        print(f"wrote {written}: {len(report.findings)} tensor(s) corrected" if written
              else "no finding: nothing written")
    return 1 if report.findings else 0
