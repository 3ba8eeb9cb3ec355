"""``zinf bench-io``: a real quick sweep on real files (O_DIRECT where the filesystem takes it),
its rows in a real SQLite profile database, the recommendation, cleanup, and the CLI's errors.

The quick sweep runs once per module (a few seconds) and the tests share its report.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from zinf import bench_io
from zinf.cli import main
from zinf.errors import ConfigError, StorageError
from zinf.storage.fsinfo import probe_o_direct

MiB = 1 << 20
QUICK_BYTES = 8 * MiB  # per point and direction: enough for positive, finite rates, fast


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def report(bench_dir) -> bench_io.BenchReport:
    warnings_seen: list[str] = []
    rep = bench_io.run_bench(
        bench_dir, sizes_bytes=bench_io.QUICK_SIZES_BYTES, settings=bench_io.default_grid(quick=True),
        bytes_per_op=QUICK_BYTES, baseline="python", warn=warnings_seen.append,
    )
    rep.warnings_seen = warnings_seen  # for the O_DIRECT test
    return rep


def test_quick_sweep_measures_every_point(report):
    grid = bench_io.default_grid(quick=True)
    assert [p.setting for p in report.points] == grid
    for p in report.points:
        for tp in (p.read, p.write):
            assert tp.bytes >= QUICK_BYTES
            assert 0 < tp.GBps < 1000  # positive and finite: a real transfer of real bytes
    assert report.baseline.method == "python"
    assert len(report.baseline.passes) == 2
    assert report.baseline.read.GBps > 0 and report.baseline.write.GBps > 0


def test_sweep_leaves_no_files(report, bench_dir):
    assert list(bench_dir.iterdir()) == []


def test_o_direct_used_where_the_filesystem_takes_it(report, bench_dir):
    assert report.o_direct == probe_o_direct(bench_dir)
    if report.o_direct:
        assert report.warnings_seen == []
    else:
        assert len(report.warnings_seen) == 1 and "O_DIRECT is refused" in report.warnings_seen[0]


def test_recommendation_is_the_best_measured_point(report):
    best = report.recommendation
    assert best in report.points
    assert all(best.combined_GBps >= p.combined_GBps for p in report.points)
    # the criterion is bytes over seconds of both directions
    expected = (best.read.bytes + best.write.bytes) / (best.read.seconds + best.write.seconds) / 1e9
    assert best.combined_GBps == pytest.approx(expected)
    snippet = report.aio_snippet()
    assert snippet.startswith('"aio": {')
    assert f'"block_size": {best.setting.block_size_bytes}' in snippet
    assert f'"queue_depth": {best.setting.queue_depth}' in snippet
    assert f'"thread_count": {best.setting.thread_count}' in snippet


def test_rows_land_in_sqlite_and_load_back(report, tmp_path):
    from profiler.calibrations import COLUMNS, load_calibrations, save_calibrations

    db_file = tmp_path / "profile.db"
    url = f"sqlite:///{db_file}"
    rows = report.calibration_rows()
    assert len(rows) == 2 * len(report.points) + 2
    assert save_calibrations(url, rows) == len(rows)

    with sqlite3.connect(db_file) as conn:  # straight from the file, not through our code
        stored = conn.execute("SELECT op, GBps, raw_baseline_GBps, source FROM calibrations").fetchall()
    assert len(stored) == len(rows)
    assert all(gbps > 0 for _, gbps, _, _ in stored)

    df = load_calibrations(url, path=str(report.path))
    assert list(df.columns) == list(COLUMNS)
    assert len(df) == len(rows)
    zinf_rows = df[df["method"] == "zinf"]
    assert len(zinf_rows) == 2 * len(report.points)
    assert set(df["method"]) == {"zinf", "python"}
    assert (zinf_rows["GBps"] > 0).all() and (zinf_rows["raw_baseline_GBps"] > 0).all()
    assert zinf_rows["vs_raw"].to_numpy() == pytest.approx((zinf_rows["GBps"] / zinf_rows["raw_baseline_GBps"]).to_numpy())
    assert (df["o_direct"] == report.o_direct).all()
    best = report.recommendation
    best_read = zinf_rows[(zinf_rows["op"] == "read") & (zinf_rows["block_size_bytes"] == best.setting.block_size_bytes)
                          & (zinf_rows["thread_count"] == best.setting.thread_count)
                          & (zinf_rows["queue_depth"] == best.setting.queue_depth)]
    assert best_read["GBps"].tolist() == pytest.approx([best.read.GBps])
    assert load_calibrations(url, path="/some/other/dir").empty


@pytest.mark.parametrize("method", ["python", "dd", "fio"])
def test_each_raw_baseline_measures_and_cleans_up(method, tmp_path):
    if method != "python" and not shutil.which(method):
        pytest.skip(f"{method} is not installed")
    o_direct = probe_o_direct(tmp_path)
    if method == "dd" and not bench_io._dd_usable(tmp_path, o_direct):
        pytest.skip("dd here does not report its timing")
    load = bench_io.plan_workload((1 * MiB, 2 * MiB), 6 * MiB)
    read, write = bench_io.measure_baseline(method, tmp_path, load, o_direct)
    assert read.bytes == write.bytes == load.bytes_per_op
    assert read.GBps > 0 and write.GBps > 0
    assert list(tmp_path.iterdir()) == []


def test_raw_loop_round_trips_bytes(tmp_path):
    from zinf.storage.aligned import aligned_empty

    o_direct = probe_o_direct(tmp_path)
    src, dst = aligned_empty(2 * MiB), aligned_empty(2 * MiB)
    bench_io._fill_random(src)
    dst.zero_()
    f = tmp_path / "raw.bin"
    assert bench_io.raw_write_file(f, src, o_direct=o_direct, fresh=True) > 0
    assert bench_io.raw_write_file(f, src, o_direct=o_direct, fresh=False) > 0  # in place
    assert f.stat().st_size == 2 * MiB
    assert bench_io.raw_read_file(f, dst, o_direct=o_direct) > 0
    assert bool((src == dst).all())


def test_parse_sizes():
    assert bench_io.parse_sizes("1MiB, 4MiB,8MiB,4MiB") == (MiB, 4 * MiB, 8 * MiB)
    for bad in ("3000", "2GiB", "", "1MiB,huge"):
        with pytest.raises(ConfigError):
            bench_io.parse_sizes(bad)


def test_bad_paths_raise_storage_errors(tmp_path):
    with pytest.raises(StorageError, match="does not exist"):
        bench_io.check_bench_dir(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="is a file"):
        bench_io.check_bench_dir(tmp_path / "file")


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory this process cannot create files in: mode 0555, or for root the ext4
    immutable flag (chattr +i), which root cannot write past either."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        undo = lambda: d.chmod(0o755)  # noqa: E731
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0:
        undo = lambda: subprocess.run(["chattr", "-i", str(d)], check=True)  # noqa: E731
    else:
        pytest.skip("cannot make a directory unwritable for root here (no chattr +i)")
    try:
        yield d
    finally:
        undo()


def _cli_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_cli_bad_path_is_one_line_and_exit_1(capsys, tmp_path, unwritable_dir):
    assert "does not exist" in _cli_error(capsys, ["bench-io", "--path", str(tmp_path / "missing"), "--no-db"])
    (tmp_path / "file").write_text("x")
    assert "is a file" in _cli_error(capsys, ["bench-io", "--path", str(tmp_path / "file"), "--no-db"])
    assert "not writable" in _cli_error(capsys, ["bench-io", "--path", str(unwritable_dir), "--no-db"])
    assert "--sizes" in _cli_error(capsys, ["bench-io", "--path", str(tmp_path), "--sizes", "3000", "--no-db"])


def test_cli_error_as_a_subprocess(tmp_path):
    """The installed entry point's path: `python -m zinf.cli`, a real process."""
    done = subprocess.run([sys.executable, "-m", "zinf.cli", "bench-io", "--path", str(tmp_path / "nope"), "--no-db"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr


def test_cli_quick_run_prints_table_and_writes_db(capsys, tmp_path):
    from profiler.calibrations import load_calibrations

    work = tmp_path / "disk"
    work.mkdir()
    url = f"sqlite:///{tmp_path / 'p.db'}"
    main(["bench-io", "--path", str(work), "--quick", "--db", url, "--sizes", "1MiB", "--baseline", "python"])
    out = capsys.readouterr().out
    assert '"aio": {' in out and "best" in out and "raw python" in out
    df = load_calibrations(url)
    n_points = len(bench_io.default_grid(quick=True))
    assert f"wrote {2 * n_points + 2} rows" in out
    assert len(df) == 2 * n_points + 2
    assert list(work.iterdir()) == []


@pytest.fixture
def shm_dir():
    """A directory on tmpfs (/dev/shm). Linux >= 6.6 accepts O_DIRECT there; older kernels refuse."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="zinf-test-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_bench_io_on_tmpfs_reports_what_the_kernel_allows(shm_dir):
    seen: list[str] = []
    rep = bench_io.run_bench(shm_dir, sizes_bytes=(MiB,), settings=bench_io.default_grid(quick=True)[:1],
                             bytes_per_op=4 * MiB, baseline="python", warn=seen.append)
    assert rep.o_direct == probe_o_direct(shm_dir)
    assert bool(seen) == (not rep.o_direct)  # a warning exactly when it fell back to buffered I/O
    assert all(r["GBps"] > 0 for r in rep.calibration_rows())
    assert list(shm_dir.iterdir()) == []


@pytest.fixture
def ramfs_dir(tmp_path):
    """A ramfs mount, where O_DIRECT is refused (needs root and mount rights; skipped without)."""
    d = tmp_path / "ramfs"
    d.mkdir()
    if not shutil.which("mount") or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(d)],
                                                   capture_output=True).returncode != 0:
        pytest.skip("cannot mount a ramfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_o_direct_refused_measures_buffered_and_says_so(ramfs_dir, tmp_path):
    from profiler.calibrations import load_calibrations, save_calibrations

    assert not probe_o_direct(ramfs_dir)
    seen: list[str] = []
    rep = bench_io.run_bench(ramfs_dir, sizes_bytes=(MiB,), settings=bench_io.default_grid(quick=True)[:1],
                             bytes_per_op=4 * MiB, baseline="python", warn=seen.append)
    assert not rep.o_direct
    assert len(seen) == 1 and "O_DIRECT is refused on ramfs" in seen[0]
    assert all(r["source"].endswith("/buffered") for r in rep.calibration_rows())
    url = f"sqlite:///{tmp_path / 'p.db'}"
    save_calibrations(url, rep.calibration_rows())
    assert not load_calibrations(url)["o_direct"].any()
    assert list(ramfs_dir.iterdir()) == []
