"""AsyncIOHandle's knobs, config and backend choice: DeepSpeed's aio block, the env var over the
argument, a forced backend that is unavailable, the backend report, bad buffers, ``zeroinf tune-io``,
and a backend probe that leaves the global RNG alone."""
import errno

import pytest
import torch

from zeroinf.io import AIOError, AsyncIOHandle, BackendUnavailableError, DiskFullError
from zeroinf.io import backends as io_backends
from zeroinf.ops import OpUnavailableError
from aio_helpers import BACKENDS


def test_from_config_deepspeed_block():
    h = AsyncIOHandle.from_config({"block_size": 262144, "queue_depth": 32, "thread_count": 2,
                                   "single_submit": False, "overlap_events": True, "use_gds": False})
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism()) == (262144, 32, 2)
    with pytest.raises(ValueError, match=r"^aio\.block_sise: unknown key"):
        AsyncIOHandle.from_config({"block_sise": 4096})
    with pytest.raises(ValueError, match=r"^aio\.block_size: expected an integer >= 1, got 0"):
        AsyncIOHandle.from_config({"block_size": 0})
    with pytest.raises(ValueError, match=r"^aio\.single_submit"):
        AsyncIOHandle.from_config({"single_submit": "yes"})
    with pytest.raises(ValueError, match=r"^aio\.thread_count: 3 disagrees with intra_op_parallelism=2"):
        AsyncIOHandle.from_config({"intra_op_parallelism": 2, "thread_count": 3})  # tester-41 F9


def test_env_var_beats_argument(monkeypatch):
    monkeypatch.setenv("ZEROINF_AIO_BACKEND", "python")
    assert AsyncIOHandle(backend="threads").backend == "python"
    monkeypatch.setenv("ZEROINF_AIO_BACKEND", "uring")
    with pytest.raises(ValueError, match="ZEROINF_AIO_BACKEND=uring"):
        AsyncIOHandle()


def test_forced_backend_unavailable_says_why(monkeypatch):
    def unavailable():
        raise OpUnavailableError("disabled for the test")

    monkeypatch.setattr(io_backends, "_load_aio_op", unavailable)
    with pytest.raises(BackendUnavailableError, match="disabled for the test"):
        AsyncIOHandle(backend="libaio")
    assert AsyncIOHandle(backend="python").backend == "python"


def test_backend_report_shape():
    rows = io_backends.backend_report()
    assert [r["name"] for r in rows] == BACKENDS
    assert all(isinstance(r["available"], bool) and isinstance(r["why"], str) for r in rows)
    assert rows[-1]["available"]  # the pure-Python backend always runs


def test_bad_buffers(tmp_path):
    h = AsyncIOHandle(backend="python")
    with pytest.raises(ValueError, match="contiguous"):
        h.sync_pwrite(torch.zeros(4, 4)[:, 1], tmp_path / "f")
    with pytest.raises(TypeError, match="torch.Tensor"):
        h.sync_pwrite(b"abc", tmp_path / "f")
    for bad in (-1, 2**63):  # off_t is signed 64-bit: 2**63 was a raw pybind TypeError (tester-44 F5)
        with pytest.raises(ValueError, match=r"file_offset must be an integer in \[0, 2\*\*63\)"):
            h.sync_pwrite(torch.zeros(4), tmp_path / "f", bad)
    assert isinstance(DiskFullError(errno.ENOSPC, "x", "p"), AIOError)
    # views whose bytes are not their values, and sparse tensors, are refused saying so (tester-44 F8)
    for bad, says in ((torch.randn(8, dtype=torch.complex64).conj(), r"lazily conjugated view.*resolve_conj"),
                      (torch.randn(8)._neg_view(), r"lazily negated view.*resolve_neg"),
                      (torch.eye(3).to_sparse(), r"torch.sparse_coo tensor, which has no flat bytes")):
        with pytest.raises(ValueError, match=says):
            h.sync_pwrite(bad, tmp_path / "f")
    with pytest.raises(TypeError, match="cannot be pickled .* make one in each process"):
        import pickle
        pickle.dumps(h)


def test_tune_io_cli_prints_a_loadable_aio_block(tmp_path, capsys):
    import json

    from zeroinf.cli import main
    from zeroinf.io.tune import parse_bytes

    # the same units as every other tool: K/M/G decimal, KiB/MiB/GiB binary
    assert [parse_bytes(s) for s in ("4096", "256K", "256KiB", "1G", "2GiB")] == [4096, 256_000, 1 << 18, 10**9, 2 << 30]
    with pytest.raises(ValueError, match="expected a number of bytes"):
        parse_bytes("1.5 apples")
    # a decimal block size is no multiple of 4096: refused with the fix, nothing written
    assert main(["tune-io", "--path", str(tmp_path), "--block-sizes", "256K"]) == 2
    assert "'256K' = 256000 bytes is not a positive multiple of 4096" in capsys.readouterr().err
    # bad values end in one line on stderr and exit 2, not a traceback (helper-33, t30_cli_tracebacks.sh)
    for extra, says in ((["--queue-depths", "0"], "--queue-depths: each must be >= 1"),
                        (["--size", "0"], "--size: must be positive"), (["--repeat", "0"], "--repeat: must be >= 1"),
                        (["--backend", "bogus"], "--backend: 'bogus' is not one of libaio, threads, python"),
                        (["--size", "4TB"], "PinnedMemoryError")):
        assert main(["tune-io", "--path", str(tmp_path), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("zeroinf tune-io: error: ") and says in err and err.count("\n") == 1, err
    rc = main(["tune-io", "--path", str(tmp_path), "--size", "1MiB", "--block-sizes", "256KiB,512KiB",
               "--queue-depths", "2", "--repeat", "1", "--backend", "python"])
    assert rc == 0
    out = capsys.readouterr().out
    block = json.loads(out[out.index("{"):])
    assert block["aio"]["block_size"] in (1 << 18, 1 << 19) and block["aio"]["queue_depth"] == 2
    AsyncIOHandle.from_config(block["aio"])
    assert list(tmp_path.iterdir()) == []  # the test file is removed


def test_backend_probe_leaves_the_global_rng_alone(monkeypatch):
    from zeroinf.io import backends

    monkeypatch.setattr(backends, "_probe_cache", {})  # force a fresh probe
    torch.manual_seed(0)
    want = torch.rand(4)
    torch.manual_seed(0)
    AsyncIOHandle()
    assert torch.equal(torch.rand(4), want)
