"""normkit.port files are checked before they are trusted: a digest of the specs and tensors,
.npz members sized from their headers before anything is inflated, and offset moves that
would overflow or lose the scale refused."""

import argparse
import io
import json
import re
import struct
import tracemalloc
import warnings
import zipfile

import numpy as np
import pytest

from normkit import NormSpec, dtypes, port
from normkit.port import cli

LAYER = NormSpec("layer", eps=1e-5)
RMS = NormSpec("rms", eps=1e-6)
GEMMA = NormSpec("rms", eps=1e-6, scale_offset=1.0)


def layer_params(dtype=np.float32):
    rng = np.random.default_rng(0)
    scale = dtypes.round_to(1.0 + 0.1 * rng.standard_normal(8), dtype)
    scale[0] = 1.5
    return {"scale": scale, "bias": dtypes.round_to(0.1 * rng.standard_normal(8), dtype)}


def safetensors_header(path):
    """The JSON header of a safetensors file and the offset of its data."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), 8 + size


def rewrite_safetensors(path, edit_tensors=None, edit_meta=None):
    """Rewrite ``path`` with its tensors and normkit metadata passed through the edits."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path))
    meta = json.loads(safetensors_header(path)[0]["__metadata__"]["normkit"])
    tensors = edit_tensors(tensors) if edit_tensors else tensors
    meta = edit_meta(meta) if edit_meta else meta
    save_file(tensors, str(path), metadata={"normkit": json.dumps(meta)})


def rewrite_npz(path, edit_tensors=None, edit_meta=None):
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(str(arrays.pop("__normkit__")[()]))
    arrays = edit_tensors(arrays) if edit_tensors else arrays
    meta = edit_meta(meta) if edit_meta else meta
    np.savez(path, **arrays, __normkit__=np.array(json.dumps(meta)))


def with_eps(meta, eps):
    meta["layers"][""]["eps"] = eps
    return meta


def load_refused(path, *fragments):
    with pytest.raises(ValueError) as info:
        port.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --- the digest ----------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
@pytest.mark.parametrize("dtype", [np.float32, dtypes.bfloat16])
def test_files_record_a_digest_that_is_the_same_in_both_formats(tmp_path, suffix, dtype):
    params = layer_params(dtype)
    path = port.save(tmp_path / f"norm{suffix}", params, LAYER)
    other = port.save(tmp_path / ("norm.npz" if suffix == ".safetensors" else "norm.safetensors"),
                      params, LAYER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded, spec = port.load(path)
    assert spec == LAYER and loaded["scale"].tobytes() == params["scale"].tobytes()

    def recorded(p):
        if p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as npz:
                return json.loads(str(npz["__normkit__"][()]))["sha256"]
        return json.loads(safetensors_header(p)[0]["__metadata__"]["normkit"])["sha256"]

    digest = recorded(path)
    assert set(digest) == {"specs", "tensors"} and set(digest["tensors"]) == {"scale", "bias"}
    assert all(len(h) == 64 for h in [digest["specs"], *digest["tensors"].values()])
    assert recorded(other) == digest


def test_a_flipped_data_byte_in_safetensors_is_refused(tmp_path):
    path = port.save(tmp_path / "norm.safetensors", layer_params(), LAYER)
    header, start = safetensors_header(path)
    begin = start + header["scale"]["data_offsets"][0]
    data = bytearray(path.read_bytes())
    data[begin + 1] ^= 0x01  # the first element, 1.5, becomes 1.5 + 2**-15 = 1.50003
    path.write_bytes(bytes(data))
    from safetensors.numpy import load_file

    assert load_file(str(path))["scale"][0] != np.float32(1.5)  # the file itself reads fine
    load_refused(path, "integrity check failed: tensor(s) 'scale' differ (data, dtype or shape) "
                 "from the sha256 digest recorded when the file was written; the file was "
                 "corrupted or edited (nothing was loaded)")


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_an_edited_eps_is_refused(tmp_path, suffix):
    path = port.save(tmp_path / f"norm{suffix}", layer_params(), LAYER)
    rewrite = rewrite_npz if suffix == ".npz" else rewrite_safetensors
    rewrite(path, edit_meta=lambda meta: with_eps(meta, 1e-3))
    load_refused(path, "integrity check failed: the specs in its metadata (format, version, "
                 "convention, layers) differ from the sha256 digest")


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_edited_added_and_removed_tensors_are_refused(tmp_path, suffix):
    rewrite = rewrite_npz if suffix == ".npz" else rewrite_safetensors
    path = port.save(tmp_path / f"norm{suffix}", layer_params(), LAYER)
    rewrite(path, edit_tensors=lambda t: {**t, "bias": t["bias"] * np.float32(2)})
    load_refused(path, "integrity check failed: tensor(s) 'bias' differ")
    path = port.save(tmp_path / f"norm{suffix}", layer_params(), LAYER)
    rewrite(path, edit_tensors=lambda t: {**t, "extra": t["bias"]})
    load_refused(path, "integrity check failed: tensor(s) 'extra' were added")
    path = port.save(tmp_path / f"norm{suffix}", layer_params(), LAYER)
    rewrite(path, edit_tensors=lambda t: {"scale": t["scale"]})
    load_refused(path, "integrity check failed: tensor(s) 'bias' are missing")


def test_bfloat16_bits_read_as_another_dtype_are_refused(tmp_path):
    path = port.save(tmp_path / "norm.npz", layer_params(dtypes.bfloat16), LAYER)
    rewrite_npz(path, edit_meta=lambda meta: {**meta, "bfloat16": ["bias"]})  # scale: uint16
    load_refused(path, "integrity check failed: tensor(s) 'scale' differ (data, dtype or shape)")


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_a_file_without_a_digest_loads_with_a_warning(tmp_path, suffix):
    params = layer_params()
    path = port.save(tmp_path / f"norm{suffix}", params, LAYER)
    rewrite = rewrite_npz if suffix == ".npz" else rewrite_safetensors
    rewrite(path, edit_meta=lambda meta: {k: v for k, v in meta.items() if k != "sha256"})
    with pytest.warns(UserWarning, match=r"norm\.\w+: has no integrity digest \(written before "
                      r"normkit recorded one\), so corruption or edits cannot be detected; "
                      "rewrite it with normkit.port.save_norms"):
        loaded, spec = port.load(path)
    assert spec == LAYER and loaded["scale"].tobytes() == params["scale"].tobytes()


@pytest.mark.parametrize("digest", ["abc", {"specs": "abc"}, {"specs": 1, "tensors": {}}])
def test_a_malformed_digest_is_refused(tmp_path, digest):
    path = port.save(tmp_path / "norm.safetensors", layer_params(), LAYER)
    rewrite_safetensors(path, edit_meta=lambda meta: {**meta, "sha256": digest})
    load_refused(path, "the metadata's 'sha256' digest is malformed")


@pytest.mark.parametrize("number", ["NaN", "1e400"])
def test_non_finite_numbers_in_the_metadata_are_refused(tmp_path, number):
    path = port.save(tmp_path / "norm.safetensors", layer_params(), LAYER)
    from safetensors.numpy import load_file, save_file

    meta = json.loads(safetensors_header(path)[0]["__metadata__"]["normkit"])
    text = json.dumps(with_eps(meta, 12345.0)).replace("12345.0", number)
    save_file(load_file(str(path)), str(path), metadata={"normkit": text})
    load_refused(path, "the normkit metadata is not valid JSON")


def test_an_eps_too_large_for_a_float_is_an_invalid_spec(tmp_path):
    path = port.save(tmp_path / "norm.safetensors", layer_params(), LAYER)
    rewrite_safetensors(path, edit_meta=lambda meta: {
        k: v for k, v in with_eps(meta, 10**400).items() if k != "sha256"})
    load_refused(path, "invalid spec: ")


# --- .npz members ----------------------------------------------------------------------------


def npy_bytes(header, data):
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + data


def test_a_crc_failure_names_the_file_and_the_member(tmp_path):
    path = port.save(tmp_path / "norm.npz", layer_params(), LAYER)
    data = bytearray(path.read_bytes())
    at = data.index(np.float32(1.5).tobytes())  # the scale's first element, stored uncompressed
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    load_refused(path, "member 'scale.npy' is corrupt: Bad CRC-32 for file 'scale.npy'")


def test_a_truncated_file_names_the_file(tmp_path):
    path = port.save(tmp_path / "norm.npz", layer_params(), LAYER)
    path.write_bytes(path.read_bytes()[:-40])
    load_refused(path, "is not a readable .npz (zip) archive: ", "(truncated or corrupt?)")


def test_a_truncated_member_is_reported_as_truncated(tmp_path):
    path = tmp_path / "norm.npz"
    header = {"descr": "<f4", "fortran_order": False, "shape": (64,)}
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("scale.npy", npy_bytes(header, np.ones(16, np.float32).tobytes()))
    load_refused(path, "member 'scale.npy' is truncated: its header declares a float32 array of "
                 "shape (64,) (256 bytes), but the member holds 64 bytes of data")


def test_trailing_bytes_in_a_member_are_refused(tmp_path):
    path = tmp_path / "norm.npz"
    header = {"descr": "<f4", "fortran_order": False, "shape": (4,)}
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("scale.npy", npy_bytes(header, np.ones(8, np.float32).tobytes()))
    load_refused(path, "member 'scale.npy' is corrupt: its header declares a float32 array of "
                 "shape (4,) (16 bytes), but the member holds 32 bytes of data")


def test_a_member_without_an_npy_header_is_refused(tmp_path):
    path = tmp_path / "norm.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("scale.npy", b"not an array at all")
    load_refused(path, "member 'scale.npy' has no valid .npy header")


def patch_central_directory(path, offset, value):
    """Overwrite a 4-byte field of the (single) member's central directory entry."""
    data = bytearray(path.read_bytes())
    entry = data.index(b"PK\x01\x02")
    data[entry + offset : entry + offset + 4] = struct.pack("<I", value)
    path.write_bytes(bytes(data))


def single_member_npz(path, npy, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        archive.writestr("scale.npy", npy)
    return path


def test_a_member_declared_past_the_end_of_the_file_is_refused(tmp_path):
    header = {"descr": "<f4", "fortran_order": False, "shape": (4,)}
    path = single_member_npz(tmp_path / "norm.npz", npy_bytes(header, bytes(16)))
    patch_central_directory(path, 20, 10**6)  # the compressed size
    load_refused(path, "member 'scale.npy' is truncated: it declares 1000000 stored bytes at "
                 "offset 0, past the end of the ")


def test_an_encrypted_member_cannot_be_read(tmp_path):
    header = {"descr": "<f4", "fortran_order": False, "shape": (4,)}
    path = single_member_npz(tmp_path / "norm.npz", npy_bytes(header, bytes(16)))
    patch_central_directory(path, 8, 0x1)  # general purpose flags: encrypted
    load_refused(path, "member 'scale.npy' cannot be read: ", "encrypted")


def test_a_corrupt_deflate_stream_names_the_member(tmp_path):
    header = {"descr": "<f4", "fortran_order": False, "shape": (4096,)}
    values = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    path = single_member_npz(tmp_path / "norm.npz", npy_bytes(header, values.tobytes()),
                             zipfile.ZIP_DEFLATED)
    data = bytearray(path.read_bytes())
    data[2000:2400] = bytes(400)
    path.write_bytes(bytes(data))
    message = load_refused(path, "member 'scale.npy' is ")
    assert "corrupt" in message


def test_a_repeated_member_and_an_unknown_npy_version_are_refused(tmp_path):
    header = {"descr": "<f4", "fortran_order": False, "shape": (4,)}
    path = tmp_path / "norm.npz"
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w") as archive:
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate name
        archive.writestr("scale.npy", npy_bytes(header, bytes(16)))
        archive.writestr("scale.npy", npy_bytes(header, bytes(16)))
    load_refused(path, "the archive holds 'scale.npy' more than once")
    npy = bytearray(npy_bytes(header, bytes(16)))
    npy[6:8] = b"\x09\x00"  # format version 9.0
    single_member_npz(path, bytes(npy))
    load_refused(path, "member 'scale.npy' has no valid .npy header: unsupported .npy format "
                 "version (9, 0)")


def test_a_huge_declared_shape_is_refused_from_the_header(tmp_path):
    path = tmp_path / "norm.npz"
    header = {"descr": "<f4", "fortran_order": False, "shape": (2**40,)}
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("scale.npy", npy_bytes(header, b"\0" * 64))
    tracemalloc.start()
    try:
        load_refused(path, "member 'scale.npy' is truncated: its header declares a float32 array "
                     "of shape (1099511627776,) (4398046511104 bytes), but the member holds 64")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_a_zip_bomb_is_refused_before_inflating(tmp_path):
    path = tmp_path / "norm.npz"
    elements = 2**25  # 128 MiB of float32 zeros, deflated to about 128 KiB
    header = {"descr": "<f4", "fortran_order": False, "shape": (elements,)}
    chunk = bytes(2**22)
    deflated = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1)
    with deflated as archive, archive.open("scale.npy", "w", force_zip64=True) as member:
        member.write(npy_bytes(header, b""))
        for _ in range(elements * 4 // len(chunk)):
            member.write(chunk)
    assert path.stat().st_size < 2**20
    tracemalloc.start()
    try:
        message = load_refused(path, "member 'scale.npy' would inflate from ",
                               f"to {elements * 4 + 128} bytes, more than ",
                               "refused before inflating (a zip bomb?)")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "32 times its compressed size" in message
    assert peak < 2**20


def test_object_arrays_are_refused_from_the_header_without_unpickling(tmp_path):
    path = tmp_path / "norm.npz"
    header = {"descr": "|O", "fortran_order": False, "shape": (1,)}
    with zipfile.ZipFile(path, "w") as archive:  # a pickle that would fail loudly if executed
        archive.writestr("scale.npy", npy_bytes(header, b"\x80\x04cbuiltins\nexit\n."))
    load_refused(path, "holds object arrays, which only a pickle can read; normkit never "
                 "unpickles (nothing was loaded): member 'scale.npy' has dtype object")


def test_fortran_ordered_and_big_endian_members_load_as_written(tmp_path):
    scale = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    spec = NormSpec("rms", axis=(-2, -1))
    path = port.save(tmp_path / "norm.npz", {"scale": scale}, spec)
    rewrite_npz(path, edit_tensors=lambda t: {"scale": np.asfortranarray(t["scale"])})
    assert port.load(path)[0]["scale"].tobytes() == scale.tobytes()
    rewrite_npz(path, edit_tensors=lambda t: {"scale": t["scale"].astype(">f4")})
    loaded = port.load(path)[0]["scale"]
    assert loaded.dtype == np.float32 and loaded.tobytes() == scale.tobytes()


# --- offset moves that overflow -----------------------------------------------------------


def test_an_offset_move_that_overflows_the_dtype_is_refused():
    w = np.float32([0.5, 1.0, 1.5])
    with pytest.raises(ValueError) as info:
        port.convert({"scale": w}, RMS, src="numpy", dst="numpy",
                     dst_spec=RMS.replace(scale_offset=1e300))
    assert str(info.value) == (
        "moving the scale from scale_offset 0 to 1e+300 overflows float32: w' = w + (-1e+300) is "
        "-1e+300 at index (0,), beyond float32's largest value 3.403e+38 (it would be stored as "
        "infinity); keep the source offset"
    )
    with pytest.raises(ValueError, match="overflows bfloat16"):
        port.convert({"scale": w.astype(dtypes.bfloat16)}, RMS, src="numpy", dst="numpy",
                     dst_spec=RMS.replace(scale_offset=-1e39))


@pytest.mark.parametrize("dtype, offset", [(np.float64, 1e300), (np.float32, 1e30),
                                           (dtypes.bfloat16, 1e4)])
def test_an_offset_move_that_loses_the_scale_is_refused(dtype, offset):
    w = np.array([0.5, 1.0, 1.5], dtype)
    start = re.escape(f"moving the scale from scale_offset 0 to {offset:g} loses the scale in "
                      f"{np.dtype(dtype).name}: rounding w' = w + (-{offset:g}) changes the "
                      "effective scale (scale_offset + w) by ")
    with pytest.raises(ValueError, match=start):
        port.convert({"scale": w}, RMS, src="numpy", dst="numpy",
                     dst_spec=RMS.replace(scale_offset=offset))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, dtypes.bfloat16])
def test_the_gemma_offset_still_moves_both_ways(dtype):
    rng = np.random.default_rng(1)
    w = dtypes.round_to(0.1 * rng.standard_normal(256), dtype)
    to_zero = port.convert({"scale": w}, GEMMA, src="numpy", dst="numpy", dst_spec=RMS)["scale"]
    back = port.convert({"scale": to_zero}, RMS, src="numpy", dst="numpy", dst_spec=GEMMA)
    expected = dtypes.round_to(w.astype(np.float64) + 1.0, dtype)
    assert to_zero.tobytes() == expected.tobytes()
    assert back["scale"].dtype == np.dtype(dtype)


def test_the_cli_refuses_an_overflowing_offset_and_writes_nothing(tmp_path):
    src = port.save_norms(tmp_path / "src.safetensors",
                          {"layers.0.norm": ({"weight": np.float32([0.5, 1.5])}, RMS)},
                          convention="torch")
    dst = tmp_path / "dst.safetensors"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([str(src), str(dst), "--to", "flax", "--scale-offset", "1e300"])
    with pytest.raises(ValueError, match="moving the scale from scale_offset 0 to 1e\\+300 "
                       "overflows float32"):
        cli.run(args)
    assert not dst.exists()
