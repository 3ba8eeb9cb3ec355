"""``zinf doctor``: each check on a real directory, the failures it must catch, and the CLI's exit
code. Mount data for the filesystem rules is passed in as FsInfo values (no I/O is faked)."""

from __future__ import annotations

import json
import resource
import shutil

import pytest

from zinf import doctor
from zinf.cli import main
from zinf.config import load_config
from zinf.doctor import CheckResult, Status
from zinf.storage.fsinfo import FsInfo, probe_o_direct

from test_bench_io import ramfs_dir, shm_dir  # noqa: F401  (fixtures: real ramfs and tmpfs dirs)

MiB = 1 << 20
TiB = 1 << 40


def test_path_check(tmp_path):
    assert doctor.check_path(tmp_path).status is Status.PASS
    missing = doctor.check_path(tmp_path / "nope")
    assert missing.status is Status.FAIL and "does not exist" in missing.detail
    assert f"mkdir -p {tmp_path / 'nope'}" in missing.fix
    (tmp_path / "f").write_text("x")
    as_file = doctor.check_path(tmp_path / "f")
    assert as_file.status is Status.FAIL and as_file.fix


def test_filesystem_check_on_the_real_mount(tmp_path):
    r = doctor.check_filesystem(tmp_path)
    assert r.status in (Status.PASS, Status.WARN)
    assert r.values["fstype"] in r.detail
    if "noatime" not in r.values["options"]:
        assert r.status is Status.WARN and "noatime" in r.fix


@pytest.mark.parametrize(
    "fs, status, fix_word",
    [
        (FsInfo("/nvme", "xfs", "/dev/nvme0n1", ["rw", "noatime", "discard"]), Status.PASS, ""),
        (FsInfo("/nvme", "ext4", "/dev/nvme0n1", ["rw", "relatime"]), Status.WARN, "noatime"),
        (FsInfo("/dev/shm", "tmpfs", "tmpfs", ["rw", "noatime"]), Status.WARN, "NVMe"),
        (FsInfo("/", "overlay", "overlay", ["rw", "noatime"]), Status.WARN, "docker"),
        (FsInfo("/mnt", "nfs4", "srv:/x", ["rw", "noatime"]), Status.WARN, "local"),
        (FsInfo("/mnt", "btrfs", "/dev/sda", ["rw", "noatime"]), Status.WARN, "xfs"),
    ],
)
def test_filesystem_rules(tmp_path, fs, status, fix_word):
    r = doctor.check_filesystem(tmp_path, fs)
    assert r.status is status
    assert fix_word in r.fix
    if status is Status.PASS:
        assert "discard is on" in r.detail


def test_o_direct_check(tmp_path):
    r = doctor.check_o_direct(tmp_path)
    assert r.values["o_direct"] == probe_o_direct(tmp_path)
    assert r.status is (Status.PASS if r.values["o_direct"] else Status.WARN)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_free_space_check(tmp_path):
    free_bytes = shutil.disk_usage(tmp_path).free
    only = doctor.check_free_space(tmp_path)
    assert only.status is Status.PASS and only.values["free_bytes"] > 0
    fits = doctor.check_free_space(tmp_path, state_bytes=1 * MiB)
    assert fits.status is Status.PASS
    too_big = doctor.check_free_space(tmp_path, state_bytes=free_bytes + 1 * TiB, why="test")
    assert too_big.status is Status.FAIL
    assert "free" in too_big.fix and "nvme_path" in too_big.fix


def test_bytes_per_param_follow_the_config():
    assert doctor.nvme_bytes_per_param(doctor.seed_layout_config()) == 16  # fp32: master + m + v + grad
    bf16 = load_config({"bf16": {"enabled": True}, "zero_optimization": {
        "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}})
    assert doctor.nvme_bytes_per_param(bf16) == 2 + 16
    params_only = load_config({"bf16": {"enabled": True}, "zero_optimization": {"offload_param": {"device": "nvme"}}})
    assert doctor.nvme_bytes_per_param(params_only) == 2
    assert doctor.nvme_bytes_per_param(load_config({})) == 0


def test_memlock_check():
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    no_cuda = doctor.check_memlock(16 * MiB, cuda=False)
    assert no_cuda.status is Status.PASS
    huge = doctor.check_memlock(1 << 60, cuda=True)
    if soft == resource.RLIM_INFINITY:
        assert huge.status is Status.PASS and huge.detail == "unlimited"
    else:
        assert huge.status is Status.WARN and "ulimit -l unlimited" in huge.fix
        assert huge.values["memlock_bytes"] == soft


def test_bandwidth_check_measures_and_cleans_up(tmp_path):
    r = doctor.check_bandwidth(tmp_path, bytes_per_op=8 * MiB)
    assert r.status in (Status.PASS, Status.WARN)
    for key in ("read_GBps", "write_GBps", "raw_read_GBps", "raw_write_GBps"):
        assert r.values[key] > 0
    assert (r.status is Status.WARN) == (min(r.values["read_GBps"], r.values["write_GBps"]) < doctor.SLOW_DISK_GBps)
    assert list(tmp_path.iterdir()) == []


def test_disk_link_check_returns_a_status(tmp_path):
    r = doctor.check_disk_link(tmp_path)
    assert isinstance(r, CheckResult) and r.status in (Status.PASS, Status.WARN, Status.SKIP)
    assert r.detail


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_gpu_check_skips_without_nvidia_smi():
    r = doctor.check_gpu()
    assert r.status is Status.SKIP
    assert "skip: no NVIDIA GPU found" in r.detail


def test_parse_nvidia_smi():
    text = "NVIDIA H200, 00000000:4E:00.0, 5, 5, 16, 16\nNVIDIA H200, 00000000:5F:00.0, 1, 5, [N/A], 16\n"
    gpus = doctor.parse_nvidia_smi(text)
    assert gpus[0] == {"name": "NVIDIA H200", "bus_id": "00000000:4E:00.0", "gen": 5, "gen_max": 5,
                       "width": 16, "width_max": 16}
    assert gpus[1]["gen"] == 1 and gpus[1]["width"] is None


def test_run_checks_on_a_missing_path_fails_and_skips_the_rest(tmp_path):
    results = doctor.run_checks(tmp_path / "nope", measure=False)
    by_name = {r.name: r for r in results}
    assert by_name["path"].status is Status.FAIL
    for name in ("filesystem", "O_DIRECT", "free space", "bandwidth", "disk link"):
        assert by_name[name].status is Status.SKIP
    assert doctor.exit_code(results) == 1


def test_config_paths_are_compared(tmp_path):
    cfg = load_config({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "other")}}})
    r = doctor.check_config_paths(tmp_path, cfg)
    assert r.status is Status.WARN and str(tmp_path / "other") in r.detail
    same = load_config({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}})
    assert doctor.check_config_paths(tmp_path, same).status is Status.PASS


def test_cli_exit_codes(capsys, tmp_path):
    main(["doctor", "--path", str(tmp_path), "--no-measure"])  # no FAIL: returns, no SystemExit
    out = capsys.readouterr().out
    for name in ("path", "filesystem", "O_DIRECT", "free space", "ulimit -l", "bandwidth", "disk link", "gpu"):
        assert f" {name}:" in out
    assert "0 FAIL" in out

    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--path", str(tmp_path / "missing"), "--no-measure"])
    assert exc.value.code == 1
    assert "FAIL path:" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--path", str(tmp_path), "--state-bytes", "100000TiB", "--no-measure"])
    assert exc.value.code == 1
    assert "FAIL free space:" in capsys.readouterr().out


def test_cli_params_use_the_config(capsys, tmp_path):
    cfg = tmp_path / "ds.json"
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg.write_text(json.dumps({"bf16": {"enabled": True},
                               "zero_optimization": {"offload_param": nvme, "offload_optimizer": nvme}}))
    main(["doctor", "--path", str(tmp_path), "--config", str(cfg), "--params", "1000000", "--no-measure"])
    out = capsys.readouterr().out
    assert "PASS config:" in out
    assert "1,000,000 params x 18 bytes on NVMe" in out


def test_o_direct_check_warns_on_a_ramfs_that_refuses_it(ramfs_dir):
    """A real ramfs mount (no O_DIRECT): the check says so and names the fix."""
    r = doctor.check_o_direct(ramfs_dir)
    assert r.status is Status.WARN and "ramfs" in r.detail and r.fix
    assert r.values == {"o_direct": False}
    assert doctor.check_bandwidth(ramfs_dir, bytes_per_op=4 << 20).status in (Status.PASS, Status.WARN)
    assert list(ramfs_dir.iterdir()) == []


def test_checks_on_tmpfs_follow_the_kernel(shm_dir):
    r = doctor.check_o_direct(shm_dir)
    assert (r.status is Status.PASS) == probe_o_direct(shm_dir)
    fs = doctor.check_filesystem(shm_dir)
    assert "tmpfs" in fs.detail and fs.status is Status.WARN  # RAM, not an NVMe drive


def test_cpu_threads_check_warns_when_torch_takes_every_core():
    busy = doctor.check_cpu_threads(torch_threads=16, cores=16)
    assert busy.status is Status.WARN and "OMP_NUM_THREADS=12" in busy.fix
    assert doctor.check_cpu_threads(torch_threads=8, cores=16).status is Status.PASS
    assert doctor.check_cpu_threads(torch_threads=2, cores=2).status is Status.PASS  # nothing to leave on 2 cores
    names = [r.name for r in doctor.run_checks("/nonexistent-zinf", measure=False)]
    assert "cpu threads" in names
