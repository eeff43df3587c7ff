"""``zeroinf train``'s private NVMe swap folders: the log's nvme column counts this run's swap files
only; a killed run's folder is removed by the next run, an empty half-made one once old, another
user's is left alone, and only folders this scheme made on this host are removed."""
import os
import time

import pytest

from train_helpers import OFFLOAD, TINY, _log, _start, _train


def test_nvme_column_counts_this_runs_swap_files_only(tmp_path):
    """The swap folders were summed whole: files an earlier run left there (swap files outlive
    close) counted as this run's, 4.6 MiB against 2.6 (helper-48 P2)."""
    swap = tmp_path / "nv" / "zeroinf_optimizer" / "rank0" / "zeroinf-swap"
    swap.mkdir(parents=True)
    (swap / "earlier_run-0123456789ab.swp").write_bytes(b"\1" * (8 << 20))
    _train(["--offload", "nvme-optimizer", "--nvme-path", "nv", "--steps", "2", *TINY, "--no-plot", "--out", "o"],
           tmp_path)
    ours = sum(p.stat().st_blocks * 512 for p in swap.iterdir() if p.suffix in (".swp", ".json")
               and not p.name.startswith("earlier_run"))
    assert 0 < ours < 8 << 20
    assert [r["nvme_bytes"] for r in _log(tmp_path / "o")] == [ours, ours]


def test_a_killed_runs_private_swap_folder_is_removed_by_the_next_run(tmp_path):
    """A run killed outright (SIGKILL; a second SIGTERM) cannot remove its private swap folder; the
    next run in that directory does, and leaves a live run's and a --keep run's alone."""
    from zeroinf.cli.train import make_private_dir, remove_stale_private_dirs
    proc = _start(["--offload", OFFLOAD, "--steps", "200", *TINY, "--no-plot"], tmp_path, "killed", 1)
    proc.kill()
    proc.communicate(timeout=60)
    (stale,) = tmp_path.glob(".zeroinf-nvme-r0-*")
    nbytes = sum(f.stat().st_size for f in stale.rglob("*") if f.is_file())
    assert nbytes > 0
    live, fd = make_private_dir(tmp_path, 0)            # a run still going: its folder stays
    kept, kfd = make_private_dir(tmp_path, 0, keep=True)
    os.close(kfd)                                        # a --keep run that ended: its folder stays
    rank1, r1fd = make_private_dir(tmp_path, 1)
    os.close(r1fd)                                       # rank 1 of a killed 2-rank run: removed too (tester-33 M7)
    older = tmp_path / ".zeroinf-nvme-r0-a8ct497w"      # an older version's (--keep?) folder: no OWNER, stays (M2)
    older.mkdir()
    (older / "x.swp").write_bytes(b"0" * 4096)
    try:
        proc = _train(["--offload", OFFLOAD, "--steps", "1", *TINY, "--no-plot", "--out", "next"], tmp_path)
        for d, n in ((stale, nbytes), (rank1, 0)):  # rank 1's holds its OWNER note only: 0.0 MiB
            assert f"removed {d.name} ({n / 2**20:.1f} MiB), the private swap folder of a run that ended without " \
                   "removing it (killed)" in proc.stderr, proc.stderr
        assert sorted(tmp_path.glob(".zeroinf-*")) == sorted([live, kept, older])
    finally:
        os.close(fd)
    assert [d for d, _ in remove_stale_private_dirs(tmp_path)] == [live]
    assert sorted(tmp_path.glob(".zeroinf-*")) == sorted([kept, older])


def test_an_empty_half_made_private_folder_is_removed_once_old(tmp_path):
    """A run killed between mkdtemp and writing OWNER left an empty .zeroinf-new-r folder that
    no later run removed (tester-34). An hour old and empty, it is removed; a fresh one (a run
    may be between those two calls) and one holding anything stay."""
    from zeroinf.cli.train import remove_stale_private_dirs
    old, fresh, full = (tmp_path / f".zeroinf-new-r{r}-abcdefg{r}" for r in range(3))
    for d in (old, fresh, full):
        d.mkdir()
    (full / "x").write_text("x")
    for d in (old, full):
        os.utime(d, (time.time() - 3700, time.time() - 3700))
    assert remove_stale_private_dirs(tmp_path) == [(old, 0)]
    assert sorted(tmp_path.iterdir()) == [fresh, full]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_another_users_private_swap_folder_is_left_alone(tmp_path):
    """In a shared directory (/tmp) another user's folder, even one looking stale, is not ours:
    Path.exists() on its 0700 contents raised PermissionError and train ended in a traceback
    (tester-33 M1); as root it was removed."""
    from zeroinf.cli.train import make_private_dir, remove_stale_private_dirs
    theirs, fd = make_private_dir(tmp_path, 0)
    os.close(fd)
    for p in (theirs, *theirs.iterdir()):
        os.chown(p, 65534, 65534)
    theirs.chmod(0o700)
    assert remove_stale_private_dirs(tmp_path) == [] and theirs.is_dir()


def test_only_folders_this_scheme_made_on_this_host_are_removed(tmp_path):
    """tester-34 N5: a name with a trailing newline and a folder whose OWNER is a link were taken
    for private swap folders; a folder another host made on a shared file system (whose flock
    may be local to each host) must not be taken either. A real stale one still goes."""
    from zeroinf.cli.train import make_private_dir, remove_stale_private_dirs
    stale, fd = make_private_dir(tmp_path, 0)
    os.close(fd)
    newline = tmp_path / (stale.name[:-1] + "x\n")
    newline.mkdir()
    (newline / "OWNER").write_text((stale / "OWNER").read_text())
    linked, fd = make_private_dir(tmp_path, 1)
    os.close(fd)
    (tmp_path / "owner-text").write_text((linked / "OWNER").read_text())
    (linked / "OWNER").unlink()
    (linked / "OWNER").symlink_to(tmp_path / "owner-text")
    other, fd = make_private_dir(tmp_path, 2)
    os.close(fd)
    (other / "OWNER").write_text("another-host\nzeroinf train, pid 1\n")
    assert [d for d, _ in remove_stale_private_dirs(tmp_path)] == [stale]
    assert newline.is_dir() and linked.is_dir() and other.is_dir() and (tmp_path / "owner-text").is_file()
