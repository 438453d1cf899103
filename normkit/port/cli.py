"""``normkit port SRC DST [--to CONVENTION]``: rewrite a normkit norms file, in another format
(by DST's suffix), for another framework's parameter names, or with another offset."""

from __future__ import annotations

import argparse

from normkit import arguments
from normkit.port.convert import CONVENTIONS, convert
from normkit.port.files import load_norms, save_norms, stored_convention
from normkit.spec import OFFSET_DTYPES, NormSpec

HELP = (
    "rewrite a normkit norms file (safetensors or .npz): in the other format, another "
    "framework's convention or another scale offset"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``normkit port``."""
    parser.add_argument("src", metavar="SRC", type=arguments.input_file,
                        help="a file written by normkit.port (save or export_norms)")
    parser.add_argument("dst", metavar="DST", type=arguments.output_file,
                        help="the file to write: .npz for numpy's format, else safetensors")
    parser.add_argument(
        "--to",
        choices=CONVENTIONS,
        help="the parameter names to write: torch weight/bias, the others scale/bias "
        "(default: SRC's own)",
    )
    parser.add_argument(
        "--scale-offset",
        type=float,
        metavar="OFFSET",
        help="rewrite every scaled layer for this scale_offset (e.g. 0 for a Gemma-style 1): "
        "w' = w + (old - new), rounded once to the parameter dtype",
    )
    parser.add_argument(
        "--offset-dtype",
        choices=OFFSET_DTYPES,
        help="rewrite every layer with a scale offset for this offset_dtype: from 'param' to "
        "'float32' exactly (w' = round(offset + w) - offset), from 'float32' to 'param' with w "
        "kept (the effective scale is then rounded to w's dtype); needed to move a 'param' "
        "layer to --scale-offset 0",
    )


def run(args: argparse.Namespace) -> int:
    """Read ``args.src``, rename (and re-offset) every layer, write ``args.dst``; returns 0."""
    if args.to is None:
        args.to = stored_convention(args.src)
    layers = load_norms(args.src, to=args.to)
    if args.scale_offset is not None or args.offset_dtype is not None:
        moved = {}
        for name, (params, spec) in layers.items():
            target = _target(name, spec, args.scale_offset, args.offset_dtype)
            converted = convert(
                params, spec, src=args.to, dst=args.to, dst_spec=target,
                change_offset_dtype=args.offset_dtype is not None,
            )
            moved[name] = (converted, target)
        layers = moved
    written = save_norms(args.dst, layers, convention=args.to)
    print(f"wrote {written}: {len(layers)} norm layer(s), {args.to} convention")
    return 0


def _target(
    name: str, spec: NormSpec, scale_offset: float | None, offset_dtype: str | None
) -> NormSpec:
    """``spec`` with the new offset (scaled layers) and offset dtype (layers with an offset;
    without one it is ``"float32"``)."""
    if not spec.scale:
        return spec
    offset = spec.scale_offset if scale_offset is None else scale_offset
    if offset != 0:
        return spec.replace(scale_offset=offset, offset_dtype=offset_dtype or spec.offset_dtype)
    if spec.offset_dtype == "param" and offset_dtype != "float32":
        raise ValueError(
            f"layer {name!r}: its offset_dtype is 'param' (scale_offset + w rounded in w's "
            "dtype), which needs an offset; pass --offset-dtype float32 to rewrite its scale "
            "for the float32 offset"
        )
    return spec.replace(scale_offset=0.0, offset_dtype="float32")
