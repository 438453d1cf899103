"""Norm parameters with their `NormSpec` on disk: safetensors, or ``.npz``; never pickle.

A file holds one or more norm layers. Each layer has a name (``""`` for a single norm, else its
path in a model, e.g. ``"layers.0.input_layernorm"``) and its tensors are stored as
``"<name>.<param>"`` (or ``"<param>"`` for ``""``), the parameter named in the file's
convention (``weight``/``bias`` for torch, ``scale``/``bias`` otherwise). The metadata, under
the key ``"normkit"``, is JSON::

    {"format": "normkit.norms", "version": 1, "convention": "torch",
     "layers": {"<name>": <NormSpec.to_dict()>, ...}}

In ``.npz`` files the metadata is a 0-d string array named ``"__normkit__"`` and bfloat16
tensors are stored as their uint16 bits, listed under ``"bfloat16"`` in the metadata.

Integrity: the metadata also holds ``"sha256"``: ``{"specs": <hex>, "tensors": {<key>: <hex>}}``,
the SHA-256 of the canonical JSON of ``format``, ``version``, ``convention`` and ``layers``
(sorted keys, no spaces), and of each tensor's dtype name, shape and C-order little-endian
bytes (bfloat16 as bfloat16, in both formats). `load_norms` refuses a file whose digest does not
match, and loads a file without one (written before normkit recorded it) with a warning. The
digest detects corruption and edits, not forgery: whoever can edit the file can rewrite it.

``.npz`` files are read member by member: each ``.npy`` header is parsed first (an object dtype
is refused, nothing is unpickled), the sizes it declares are checked against the zip headers,
and a member is inflated only up to its declared size, which may exceed 1 MiB only within 32
times its compressed size (a zip bomb is refused before inflating).

Norms files are read through `normkit.files.open_regular` and written through
`normkit.files.write_atomically`: a path that is not a regular file is refused without waiting
on it, and an interrupted write leaves the previous file intact.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import warnings
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from normkit import dtypes
from normkit.files import open_regular, write_atomically
from normkit.port.convert import CONVENTIONS, NAMES, convert, param_names
from normkit.spec import NormSpec

FORMAT = "normkit.norms"
FORMAT_VERSION = 1
METADATA_KEY = "normkit"
NPZ_METADATA = "__normkit__"
DIGEST_KEY = "sha256"
_DIGESTED = ("format", "version", "convention", "layers")  # the metadata the digest covers
_INFLATE_FREE = 1 << 20  # a member may inflate to this many bytes whatever its compression
_MAX_RATIO = 32  # beyond that, to at most this many times its compressed size

Layers = dict[str, tuple[dict[str, np.ndarray], NormSpec]]

__all__ = [
    "DIGEST_KEY", "FORMAT_VERSION", "load", "load_norms", "save", "save_norms", "stored_convention",
]


def save(
    path: str | os.PathLike[str],
    params: Mapping[str, Any],
    spec: NormSpec,
    *,
    convention: str = "numpy",
) -> Path:
    """Write one norm's ``params`` (named in ``convention``) and ``spec`` to ``path``.

    safetensors, unless ``path`` ends in ``.npz`` or the ``safetensors`` package is missing:
    then ``.npz`` (the suffix replaced, with a warning, in the second case). Returns the path
    written. bfloat16 parameters are stored bit-exactly in both formats.
    """
    return save_norms(path, {"": (params, spec)}, convention=convention)


def load(
    path: str | os.PathLike[str], *, to: str = "numpy"
) -> tuple[dict[str, np.ndarray], NormSpec]:
    """The parameters (named in convention ``to``) and spec of the single norm in ``path``.

    Raises ValueError naming the file if it is not a normkit file (a pickle is refused without
    being unpickled), it is corrupt or truncated, its contents do not match the digest recorded
    when it was written, its metadata is missing, malformed or of another format version, its
    tensors do not match its specs, or it holds a whole model's norms (use `load_norms`). A file
    without a digest loads with a warning.
    """
    layers = load_norms(path, to=to)
    if list(layers) != [""]:
        raise ValueError(
            f"{path}: holds the norms of a model ({len(layers)} layers: "
            f"{_preview(list(layers))}), not a single norm; use load_norms or import_norms"
        )
    return layers[""]


def save_norms(
    path: str | os.PathLike[str],
    layers: Mapping[str, tuple[Mapping[str, Any], NormSpec]],
    *,
    convention: str = "numpy",
) -> Path:
    """Write several named norms, ``{name: (params, spec)}``, to one file; see `save`."""
    path = Path(path)
    if convention not in NAMES:
        raise ValueError(f"convention={convention!r} is not one of {CONVENTIONS}")
    if not layers:
        raise ValueError(
            f"{path}: no norm layers to write (a model's norms must be normkit layers)"
        )
    tensors: dict[str, np.ndarray] = {}
    specs: dict[str, dict[str, object]] = {}
    for name, (params, spec) in layers.items():
        if not isinstance(spec, NormSpec):
            raise TypeError(f"{_layer(name)}spec must be a NormSpec, got {type(spec).__name__}")
        try:
            values = convert(params, spec, src=convention, dst=convention)
        except (ValueError, TypeError) as err:  # a single norm (save) has no layer name
            raise type(err)(f"{_layer(name)}{err}") from None
        specs[name] = spec.to_dict()
        for param, value in values.items():
            tensors[_key(name, param)] = np.ascontiguousarray(value)
    metadata: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "convention": convention,
        "layers": specs,
    }
    metadata[DIGEST_KEY] = _digest(json.loads(json.dumps(metadata)), tensors)
    use_npz = path.suffix == ".npz"
    if not use_npz:
        try:
            from safetensors.numpy import save as safetensors_bytes
        except ImportError:
            path = path.with_suffix(".npz")
            warnings.warn(f"safetensors is not installed: writing {path} instead", stacklevel=2)
            use_npz = True
    if use_npz:
        write_atomically(path, lambda f: _write_npz(f, tensors, metadata))
    else:
        data = safetensors_bytes(tensors, metadata={METADATA_KEY: json.dumps(metadata)})
        write_atomically(path, lambda f: f.write(data))
    return path


def load_norms(path: str | os.PathLike[str], *, to: str = "numpy") -> Layers:
    """Every norm in ``path``, ``{name: (params, spec)}``, parameters named in ``to``.

    See `load` for what is refused.
    """
    if to not in NAMES:
        raise ValueError(f"to={to!r} is not one of {CONVENTIONS}")
    path = Path(path)
    tensors, meta = _read(path)
    convention = meta["convention"]
    layers: Layers = {}
    unclaimed = set(tensors)
    for name, spec in meta["layers"].items():
        keys = {_key(name, p): p for p in param_names(spec, convention)}
        unclaimed -= set(keys)
        params = {p: tensors[k] for k, p in keys.items() if k in tensors}
        try:
            layers[name] = (convert(params, spec, src=convention, dst=to), spec)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: {_layer(name)}{err}") from None
    if unclaimed:
        raise ValueError(
            f"{path}: tensors {sorted(unclaimed)} are parameters of no layer its specs describe "
            "(a spec with bias=False has no bias): the metadata and the tensors disagree"
        )
    if DIGEST_KEY not in meta:
        warnings.warn(
            f"{path}: has no integrity digest (written before normkit recorded one), so "
            "corruption or edits cannot be detected; rewrite it with normkit.port.save_norms "
            "or `normkit port` to add one",
            UserWarning,
            stacklevel=2,
        )
    return layers


def stored_convention(path: str | os.PathLike[str]) -> str:
    """The convention the parameters in ``path`` are named in (refusing what `load` refuses)."""
    return str(_read(Path(path))[1]["convention"])


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The tensors and the parsed metadata of a normkit file (never unpickling)."""
    with open_regular(path) as f:
        head = f.read(9)
        size = os.fstat(f.fileno()).st_size
        if head[:4] == b"PK\x03\x04":
            tensors, raw = _read_npz(path, f, size)
        elif _is_safetensors(head, size):
            tensors, raw = _read_safetensors(path)
        elif len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5:  # PROTO, protocol 2-5
            raise ValueError(
                f"{path}: is a Python pickle; normkit never unpickles (nothing was loaded)"
            )
        else:
            raise ValueError(
                f"{path}: is neither a safetensors nor an .npz file (unrecognized header)"
            )
    return tensors, _parse_metadata(path, raw, tensors)


def _layer(name: str) -> str:
    """How an error names a layer: ``"layer 'name': "``, nothing for a single norm (``""``)."""
    return f"layer {name!r}: " if name else ""


def _key(name: str, param: str) -> str:
    return f"{name}.{param}" if name else param


def _preview(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")


def _write_npz(f: BinaryIO, tensors: dict[str, np.ndarray], metadata: dict[str, Any]) -> None:
    arrays = {}
    bf16 = []
    for key, value in tensors.items():
        if value.dtype == dtypes.bfloat16:
            bf16.append(key)
            value = value.view(np.uint16)
        arrays[key] = value
    metadata = {**metadata, "bfloat16": bf16}
    np.savez(f, **arrays, **{NPZ_METADATA: np.array(json.dumps(metadata))})  # type: ignore[arg-type]


def _read_npz(path: Path, f: BinaryIO, size: int) -> tuple[dict[str, np.ndarray], str | None]:
    """The arrays and raw metadata of the .npz open as ``f`` (``size`` bytes), named ``path``."""
    try:
        archive = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise ValueError(
            f"{path}: is not a readable .npz (zip) archive: {err} (truncated or corrupt?)"
        ) from None
    with archive:
        infos = archive.infolist()
        members = [info.filename for info in infos]
        pickles = [m for m in members if not m.endswith(".npy")]
        if pickles:
            hint = " (a torch.save file?)" if any(m.endswith(".pkl") for m in pickles) else ""
            raise ValueError(
                f"{path}: is a zip archive holding {_preview(pickles)}, not an .npz of arrays"
                f"{hint}; normkit never unpickles (nothing was loaded)"
            )
        repeated = sorted({m for m in members if members.count(m) > 1})
        if repeated:
            raise ValueError(f"{path}: the archive holds {_preview(repeated)} more than once")
        for info in infos:
            _check_member_sizes(path, info, size)
        arrays = {
            info.filename[: -len(".npy")]: _read_member(path, archive, info) for info in infos
        }
    raw = arrays.pop(NPZ_METADATA, None)
    if raw is None:
        return arrays, None
    if raw.dtype.kind != "U" or raw.shape != ():
        raise ValueError(
            f"{path}: {NPZ_METADATA!r} must be a JSON string, got {raw.dtype} {raw.shape}"
        )
    text = str(raw[()])
    try:
        bf16 = json.loads(text).get("bfloat16", [])
    except (json.JSONDecodeError, AttributeError):
        return arrays, text  # _parse_metadata names the problem
    if not isinstance(bf16, list) or not all(isinstance(k, str) and k in arrays for k in bf16):
        raise ValueError(f"{path}: metadata 'bfloat16' must list stored tensor names, got {bf16!r}")
    for key in bf16:
        if arrays[key].dtype != np.uint16:
            raise ValueError(
                f"{path}: bfloat16 tensor {key!r} is stored as {arrays[key].dtype}, not uint16 bits"
            )
        arrays[key] = arrays[key].view(dtypes.bfloat16)
    return arrays, text


def _check_member_sizes(path: Path, info: zipfile.ZipInfo, file_size: int) -> None:
    """Refuse, from the zip headers alone, a member larger than the file or a zip bomb."""
    name = info.filename
    if info.header_offset + info.compress_size > file_size:
        raise ValueError(
            f"{path}: member {name!r} is truncated: it declares {info.compress_size} stored "
            f"bytes at offset {info.header_offset}, past the end of the {file_size}-byte file"
        )
    limit = max(_INFLATE_FREE, _MAX_RATIO * info.compress_size)
    if info.file_size > limit:
        raise ValueError(
            f"{path}: member {name!r} would inflate from {info.compress_size} to "
            f"{info.file_size} bytes, more than {limit} ({_MAX_RATIO} times its compressed "
            f"size, or {_INFLATE_FREE} bytes): refused before inflating (a zip bomb?)"
        )


def _read_member(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    """One ``.npy`` member: its header parsed and checked against the member's size before its
    data is read; never unpickled."""
    name = info.filename
    where = f"{path}: member {name!r}"
    try:
        with archive.open(info) as stream:
            try:
                version = np.lib.format.read_magic(stream)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
                elif version == (2, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
                else:
                    raise ValueError(f"unsupported .npy format version {version}")
            except ValueError as err:
                raise ValueError(f"{where} has no valid .npy header: {err}") from None
            if dtype.hasobject:
                raise ValueError(
                    f"{path}: holds object arrays, which only a pickle can read; normkit never "
                    f"unpickles (nothing was loaded): member {name!r} has dtype {dtype}"
                )
            declared = math.prod(shape) * dtype.itemsize
            held = info.file_size - stream.tell()
            if declared != held:
                problem = "is truncated" if declared > held else "is corrupt"
                raise ValueError(
                    f"{where} {problem}: its header declares a {dtype} array of shape {shape} "
                    f"({declared} bytes), but the member holds {held} bytes of data"
                )
            data = stream.read(declared)
            stream.read(1)  # at the end of the member, zipfile checks its CRC
    except zipfile.BadZipFile as err:
        raise ValueError(f"{where} is corrupt: {err}") from None
    except (zlib.error, EOFError, OSError) as err:
        raise ValueError(f"{where} is truncated or corrupt: {err}") from None
    except (RuntimeError, NotImplementedError) as err:  # encrypted, unknown compression
        raise ValueError(f"{where} cannot be read: {err}") from None
    array = np.frombuffer(bytearray(data), dtype=dtype)
    array = array.reshape(shape[::-1]).T if fortran else array.reshape(shape)
    return array.astype(dtype.newbyteorder("="), order="C", copy=False)


def _is_safetensors(head: bytes, size: int) -> bool:
    """An 8-byte little-endian header size that fits the file of ``size`` bytes, then the JSON
    header's ``{``."""
    return (
        len(head) == 9
        and 2 <= struct.unpack("<Q", head[:8])[0] <= size - 8
        and head[8:9] == b"{"
    )


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], str | None]:
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as err:
        raise ImportError(
            f"{path}: reading safetensors needs safetensors: pip install 'normkit[port]'"
        ) from err
    try:
        with safe_open(str(path), framework="numpy") as f:
            raw = (f.metadata() or {}).get(METADATA_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: is not a readable safetensors file: {err}") from None
    return tensors, raw


def _digest(metadata: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The SHA-256 of the specs (``_DIGESTED`` fields, canonical JSON) and of each tensor."""
    specs = {key: metadata.get(key) for key in _DIGESTED}
    text = json.dumps(specs, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return {
        "specs": hashlib.sha256(text.encode()).hexdigest(),
        "tensors": {key: _tensor_digest(tensors[key]) for key in sorted(tensors)},
    }


def _tensor_digest(value: np.ndarray) -> str:
    """SHA-256 of ``value``'s dtype name, shape and C-order little-endian bytes."""
    little = value.astype(value.dtype.newbyteorder("<"), copy=False)
    digest = hashlib.sha256(f"{value.dtype.name}{list(value.shape)}".encode())
    digest.update(np.ascontiguousarray(little).tobytes())
    return digest.hexdigest()


def _verify_digest(path: Path, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
    """Refuse ``path`` unless its specs and tensors match the digest it records."""
    recorded = meta[DIGEST_KEY]
    well_formed = (
        isinstance(recorded, dict)
        and isinstance(recorded.get("specs"), str)
        and isinstance(recorded.get("tensors"), dict)
    )
    if not well_formed:
        raise ValueError(
            f"{path}: the metadata's {DIGEST_KEY!r} digest is malformed: expected "
            '{"specs": <hex>, "tensors": {<name>: <hex>}}'
        )
    actual = _digest(meta, tensors)
    problems = []
    if actual["specs"] != recorded["specs"]:
        problems.append("the specs in its metadata (format, version, convention, layers) differ")
    missing = sorted(set(recorded["tensors"]) - set(actual["tensors"]))
    added = sorted(set(actual["tensors"]) - set(recorded["tensors"]))
    changed = sorted(
        k
        for k in actual["tensors"]
        if k in recorded["tensors"] and recorded["tensors"][k] != actual["tensors"][k]
    )
    if changed:
        problems.append(f"tensor(s) {_preview(changed)} differ (data, dtype or shape)")
    if missing:
        problems.append(f"tensor(s) {_preview(missing)} are missing")
    if added:
        problems.append(f"tensor(s) {_preview(added)} were added")
    if problems:
        raise ValueError(
            f"{path}: integrity check failed: {'; '.join(problems)} from the sha256 digest "
            "recorded when the file was written; the file was corrupted or edited (nothing was "
            "loaded)"
        )


def _parse_metadata(
    path: Path, raw: str | None, tensors: Mapping[str, np.ndarray]
) -> dict[str, Any]:
    """The checked metadata, with ``layers`` as ``{name: NormSpec}``; the digest verified."""
    if raw is None:
        raise ValueError(
            f"{path}: has no normkit metadata (key {METADATA_KEY!r}); write it with "
            "normkit.port.save or export_norms"
        )
    try:
        meta = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"{path}: the normkit metadata is not valid JSON: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: the normkit metadata is malformed: expected format {FORMAT!r}")
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: normkit format version {meta.get('version')!r}; this normkit reads "
            f"version {FORMAT_VERSION}"
        )
    if DIGEST_KEY in meta:
        _verify_digest(path, meta, tensors)
    if meta.get("convention") not in NAMES:
        raise ValueError(
            f"{path}: the metadata's convention {meta.get('convention')!r} is not one of "
            f"{CONVENTIONS}"
        )
    layers = meta.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{path}: the metadata's 'layers' must map layer names to NormSpecs")
    specs = {}
    for name, data in layers.items():
        try:
            specs[name] = NormSpec.from_dict(data)
        except (ValueError, TypeError, OverflowError) as err:
            raise ValueError(f"{path}: {_layer(name)}invalid spec: {err}") from None
    return {**meta, "layers": specs}


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is beyond float64's range")
    return value
