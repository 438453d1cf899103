"""``normkit port SRC DST --to CONVENTION``: rewrite a normkit norms file for another framework."""

from __future__ import annotations

import argparse

from normkit import arguments
from normkit.port.convert import CONVENTIONS, convert
from normkit.port.files import load_norms, save_norms

HELP = "rewrite a normkit norms file (safetensors or .npz) in another framework's convention"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``normkit port``."""
    parser.add_argument("src", metavar="SRC", type=arguments.input_file,
                        help="a file written by normkit.port (save or export_norms)")
    parser.add_argument("dst", metavar="DST", type=arguments.output_file,
                        help="the file to write: .npz for numpy's format, else safetensors")
    parser.add_argument(
        "--to",
        choices=CONVENTIONS,
        required=True,
        help="the parameter names to write: torch weight/bias, the others scale/bias",
    )
    parser.add_argument(
        "--scale-offset",
        type=float,
        metavar="OFFSET",
        help="rewrite every scaled layer for this scale_offset (e.g. 0 for a Gemma-style 1): "
        "w' = w + (old - new), rounded once to the parameter dtype",
    )


def run(args: argparse.Namespace) -> int:
    """Read ``args.src``, rename (and re-offset) every layer, write ``args.dst``; returns 0."""
    layers = load_norms(args.src, to=args.to)
    if args.scale_offset is not None:
        moved = {}
        for name, (params, spec) in layers.items():
            target = spec.replace(scale_offset=args.scale_offset) if spec.scale else spec
            moved[name] = (convert(params, spec, src=args.to, dst=args.to, dst_spec=target), target)
        layers = moved
    written = save_norms(args.dst, layers, convention=args.to)
    print(f"wrote {written}: {len(layers)} norm layer(s), {args.to} convention")
    return 0
