"""CRC-32C: the C++ kernel (SSE4.2 and table paths) and the numpy fallback against a bitwise
reference, and the per-chunk checksums every I/O backend reports for real transfers."""
import os
import subprocess
import sys

import pytest
import torch

from zeroinf.io import AsyncIOHandle
from zeroinf.io.backends import backend_reasons
from zeroinf.io.checksum import (CHUNK_BYTES, ChunkChecksums, crc32c, crc32c_combine, crc32c_reference,
                                 first_mismatch)
from zeroinf.ops import load_op


def bitwise_crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C one bit at a time (RFC 3720's definition): the independent reference."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def _random_bytes(n: int, seed: int) -> bytes:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def test_check_value_and_random_bytes_match_the_bitwise_reference():
    assert bitwise_crc32c(b"123456789") == 0xE3069283
    op = load_op("aio")
    check = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert op.crc32c(check) == 0xE3069283
    assert crc32c_reference(b"123456789") == 0xE3069283
    # lengths around the kernel's 8-byte words and its 3 x 8192-byte interleaved stripes
    for n in (0, 1, 7, 8, 9, 100, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 13, 70001):
        data = _random_bytes(n, n)
        want = bitwise_crc32c(data)
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        assert op.crc32c(t) == want, n
        assert crc32c(data) == want, n
        assert crc32c_reference(data) == want, n
        if n > 3:  # an unaligned start and a continued value
            assert op.crc32c(t[3:], op.crc32c(t[:3])) == want, n


def test_combine_matches_the_crc_of_the_concatenation():
    op = load_op("aio")
    a, b = _random_bytes(5000, 1), _random_bytes(12345, 2)
    want = bitwise_crc32c(a + b)
    assert crc32c_combine(bitwise_crc32c(a), bitwise_crc32c(b), len(b)) == want
    assert op.crc32c_combine(bitwise_crc32c(a), bitwise_crc32c(b), len(b)) == want


def test_the_table_path_gives_the_same_values(tmp_path):
    data = _random_bytes(100_003, 7)
    (tmp_path / "d").write_bytes(data)
    code = ("import sys, torch; from zeroinf.ops import load_op; op = load_op('aio')\n"
            "t = torch.frombuffer(bytearray(open(sys.argv[1], 'rb').read()), dtype=torch.uint8)\n"
            "print(op.crc32c_hardware(), op.crc32c(t))\n")
    env = {**os.environ, "ZEROINF_CRC32C_ISA": "table"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d")], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", str(bitwise_crc32c(data))]


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 6]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


BACKENDS = ["libaio", "threads", "python"]


def _skip_unavailable(backend: str) -> None:
    why = backend_reasons(backend)  # checked here, not at collection: it may build the C++ op
    if why:
        pytest.skip(f"{backend}: {'; '.join(why)}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [64 << 10, 4 << 20])
@pytest.mark.parametrize("offset_buffer", [0, 1])
def test_every_backend_reports_the_chunk_crcs_of_the_bytes_moved(tmp_path, backend, block_size, offset_buffer):
    """Blocks smaller than a chunk (pieces merged), larger (cut), an O_DIRECT prefix plus a
    buffered tail (n % 4096 != 0), and an unaligned buffer (bounce copies): the write's and the
    read's CRCs equal the bitwise reference of each 1 MiB chunk."""
    _skip_unavailable(backend)
    n = 2 * CHUNK_BYTES + 5000
    data = _random_bytes(n, 3)
    src = torch.zeros(n + offset_buffer, dtype=torch.uint8)
    src[offset_buffer:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    src = src[offset_buffer:]
    want = [bitwise_crc32c(data[i:i + CHUNK_BYTES]) if i == 2 * CHUNK_BYTES else crc32c_reference(data[i:i + CHUNK_BYTES])
            for i in range(0, n, CHUNK_BYTES)]
    h = AsyncIOHandle(block_size=block_size, backend=backend)
    path = tmp_path / "f"
    w, r = ChunkChecksums(), ChunkChecksums()
    h.async_pwrite(src, path, checksums=w)
    h.wait()
    dst = torch.zeros(n, dtype=torch.uint8)
    h.sync_pread(dst, path, checksums=r)
    h.close()
    assert bytes(dst.numpy()) == data
    assert w.crcs == want and r.crcs == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_transfer_reports_no_checksums(tmp_path, monkeypatch, backend):
    _skip_unavailable(backend)
    monkeypatch.setenv("ZEROINF_AIO_FAULT", "eio:8192")
    h = AsyncIOHandle(block_size=4096, backend=backend)
    sums = ChunkChecksums()
    with pytest.raises(OSError):
        h.sync_pwrite(torch.ones(20000, dtype=torch.uint8), tmp_path / "f", checksums=sums)
    h.close()
    assert sums.crcs is None


def test_without_the_cxx_op_the_python_backend_verifies_with_the_numpy_crc(tmp_path):
    """ZEROINF_DISABLE_OPS=1: the python backend's checksums come from crc32c_reference, and a
    flipped byte still raises naming the file and the chunk's offset."""
    code = ("import sys, torch; from zeroinf.io import AsyncIOHandle, TensorSwapper, ChecksumMismatchError\n"
            "from zeroinf.io import checksum\n"
            "s = TensorSwapper(sys.argv[1], AsyncIOHandle(backend='python'))\n"
            "src = torch.randn(300_000); s.register('k', src.numel(), torch.float32)\n"
            "s.swap_out([('k', src)], async_op=False)\n"
            "assert checksum._native() is None\n"
            "assert s.manifest()['k']['crc32c'] == [checksum.crc32c_reference(src.view(torch.uint8)[i:i + (1 << 20)])"
            " for i in range(0, 1_200_000, 1 << 20)]\n"
            "f = open(s.path_for('k'), 'r+b'); f.seek(1_100_000); b = f.read(1); f.seek(1_100_000)\n"
            "f.write(bytes([b[0] ^ 1])); f.close()\n"
            "try:\n    s.swap_in([('k', torch.zeros(300_000))], async_op=False)\n"
            "except ChecksumMismatchError as e:\n    print(e.offset, e.filename == str(s.path_for('k')))\n")
    env = {**os.environ, "ZEROINF_DISABLE_OPS": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(1 << 20), "True"]
