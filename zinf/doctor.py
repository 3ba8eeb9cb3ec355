"""``zinf doctor``: the seed article's NVMe checklist, automated.

Each check is a small function that looks at one thing and returns a :class:`CheckResult`
(``PASS``, ``WARN``, ``FAIL`` or ``SKIP``, what it found, and the fix). :func:`run_checks` runs
them in order; the CLI prints one line per check and exits 1 if any check FAILed.

The checklist (seed article, section 2, plus what zinf itself needs):

* the swap directory exists and is writable;
* its filesystem: xfs or ext4 on a real disk, mounted ``noatime`` (``discard`` is reported);
* ``O_DIRECT`` accepted (zinf falls back to buffered I/O, through the page cache, without it);
* free space against the training state that will live there;
* ``ulimit -l`` (RLIMIT_MEMLOCK), the limit on locked memory;
* read and write bandwidth, measured (about a second): zinf's own path and a raw loop;
* the disk's PCIe link (sysfs; what ``lspci -vv`` shows as LnkSta);
* torch's CPU threads against the cores (an OpenMP team on every core is preempted by zinf's I/O
  and profiler threads and waits for its slowest member);
* the GPU and its PCIe link (``nvidia-smi``), with a pinned host-to-device copy where PyTorch
  sees CUDA.
"""

from __future__ import annotations

import enum
import math
import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from zinf.config import Config
from zinf.errors import ZinfError
from zinf.storage.fsinfo import FsInfo, filesystem_of, probe_o_direct

GiB = 1 << 30
MiB = 1 << 20

GOOD_FILESYSTEMS = {"xfs", "ext4"}  # the seed recommends xfs; ext4 is as good for large files
RAM_FILESYSTEMS = {"tmpfs", "ramfs"}
NETWORK_OR_FUSE = ("nfs", "nfs4", "cifs", "smb3", "fuse", "9p", "virtiofs", "ceph", "glusterfs", "lustre")
OVERLAY_FILESYSTEMS = {"overlay", "aufs"}
SLOW_DISK_GBps = 1.0  # below this (read or write), NVMe offload is I/O-bound for most models
SPACE_MARGIN = 1.10  # WARN when free space is within 10% of what the state needs
SPARE_FILES_BYTES = 256 * MiB  # the most the engine keeps as spare swap files (Engine._spare_bytes)
# Usable bytes/s of one PCIe lane by generation (after line coding), for the copy-speed check.
PCIE_LANE_GBps = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
PCIE_EFFICIENCY_FLOOR = 0.6  # a pinned copy below 60% of the link's rate suggests a bad link


class Status(str, enum.Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check. ``values`` holds its measurements (units in the key names)."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    values: dict = field(default_factory=dict)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.1f} GiB"


# ------------------------------------------------------------------------------------------------
# The swap directory and its filesystem


def check_path(path: Path) -> CheckResult:
    """The directory exists, is a directory, and a file can be created in it."""
    name = "path"
    if not path.exists():
        return CheckResult(name, Status.FAIL, f"{path} does not exist",
                           f"create it on the NVMe drive: mkdir -p {path}")
    if not path.is_dir():
        return CheckResult(name, Status.FAIL, f"{path} is a file, not a directory",
                           "point --path (and nvme_path) at a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".zinf-doctor-"):
            pass
    except OSError as e:
        return CheckResult(name, Status.FAIL, f"cannot create a file in {path} ({e.strerror or e})",
                           f"make it writable by this user: chown $USER {path}")
    return CheckResult(name, Status.PASS, f"{path} is a writable directory")


def check_filesystem(path: Path, fs: FsInfo | None = None) -> CheckResult:
    """The filesystem type and mount options (seed: ``mkfs.xfs``, ``mount -o noatime,discard``)."""
    fs = fs or filesystem_of(path)
    opts = set(fs.options)
    where = f"{fs.fstype} on {fs.device}, mounted at {fs.mount_point} ({','.join(fs.options)})"
    values = {"fstype": fs.fstype, "mount_point": fs.mount_point, "options": list(fs.options)}
    if fs.fstype in RAM_FILESYSTEMS:
        return CheckResult("filesystem", Status.WARN, f"{where}: this is RAM, not a disk; swap files here use DRAM",
                           "point nvme_path at a directory on an NVMe drive", values)
    if fs.fstype in OVERLAY_FILESYSTEMS:
        return CheckResult("filesystem", Status.WARN, f"{where}: a container's overlay layer, slow for large files",
                           "mount a host NVMe directory into the container (docker -v /nvme:/nvme) and use that", values)
    if fs.fstype.startswith(NETWORK_OR_FUSE):
        return CheckResult("filesystem", Status.WARN, f"{where}: a network or FUSE filesystem",
                           "use a local NVMe drive for nvme_path", values)
    problems, fixes = [], []
    if fs.fstype not in GOOD_FILESYSTEMS:
        problems.append(f"{fs.fstype} is untested for swap files (xfs or ext4 are)")
        fixes.append("format the drive as xfs (mkfs.xfs /dev/nvmeXnY)")
    if "noatime" not in opts:
        atime = next((o for o in ("relatime", "strictatime", "lazytime") if o in opts), "atime")
        problems.append(f"{atime} instead of noatime: the first read of every rewritten swap file also writes its inode")
        fixes.append(f"mount -o remount,noatime {fs.mount_point} (and add noatime in /etc/fstab)")
    trim = ("discard is on (online TRIM; if deletes stall writes, drop it and run fstrim.timer)" if "discard" in opts
            else "no discard option (run fstrim periodically: systemctl enable --now fstrim.timer)")
    status = Status.WARN if problems else Status.PASS
    detail = f"{where}; " + "; ".join(problems + [trim])
    return CheckResult("filesystem", status, detail, "; ".join(fixes), values)


def check_o_direct(path: Path) -> CheckResult:
    """A real 4 KiB ``O_DIRECT`` write in ``path`` (the probe zinf's NVMe store runs at start)."""
    try:
        ok = probe_o_direct(path)
    except OSError as e:
        return CheckResult("O_DIRECT", Status.FAIL, f"the probe write failed: {e.strerror or e}",
                           "make the directory writable and give it free space")
    if ok:
        return CheckResult("O_DIRECT", Status.PASS, "accepted: swap I/O bypasses the page cache", values={"o_direct": True})
    return CheckResult(
        "O_DIRECT", Status.WARN,
        f"refused by {filesystem_of(path).fstype}: zinf will use buffered I/O (page cache, extra copies, DRAM use)",
        "use an xfs or ext4 directory on an NVMe drive", {"o_direct": False},
    )


# ------------------------------------------------------------------------------------------------
# Space for the training state


def nvme_bytes_per_param(config: Config) -> float:
    """Bytes on NVMe per model parameter under ``config``, as the engine counts them: the param
    file in the compute dtype (when params are offloaded to NVMe; none of its own in fp32 when
    the master copy doubles as it) plus fp32 master, optimizer moments and gradient (when the
    optimizer state is)."""
    from zinf.optim import OptimizerSpec

    zero = config.zero_optimization
    params_on_nvme = zero.offload_param.device == "nvme"
    optim_on_nvme = zero.offload_optimizer.device == "nvme"
    dtype_bytes = config.compute_dtype.itemsize
    states = len(OptimizerSpec.from_config(config.optimizer).state_names)
    optim = 4 * (1 + states) + 4 if optim_on_nvme else 0
    same_store = config.param_nvme_path == config.optim_nvme_path
    param = 0 if (not params_on_nvme or (dtype_bytes == 4 and optim_on_nvme and same_store)) else dtype_bytes
    return float(param + optim)


def seed_layout_config() -> Config:
    """The seed article's first config: params and optimizer state on NVMe, defaults elsewhere."""
    from zinf.config import load_config

    return load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"},
                                              "offload_optimizer": {"device": "nvme"}}})


def check_free_space(path: Path, state_bytes: int | None = None, why: str = "") -> CheckResult:
    """Free space on ``path``'s filesystem against ``state_bytes`` of swap state (plus the spare
    files the engine keeps). Without ``state_bytes`` it reports the free space only."""
    usage = shutil.disk_usage(path)
    values = {"free_bytes": usage.free, "total_bytes": usage.total, "state_bytes": state_bytes}
    free = f"{_gib(usage.free)} free of {_gib(usage.total)}"
    if state_bytes is None:
        return CheckResult("free space", Status.PASS, f"{free} (give --params or --state-bytes to compare with a model)",
                           values=values)
    need_bytes = state_bytes + SPARE_FILES_BYTES
    values["need_bytes"] = need_bytes
    need = f"the state needs {_gib(need_bytes)}{f' ({why})' if why else ''}"
    if usage.total == 0:  # ramfs: no size, it grows until DRAM runs out
        return CheckResult("free space", Status.WARN, f"the filesystem reports no size (ramfs: bounded by DRAM); {need}",
                           "point nvme_path at a directory on an NVMe drive", values)
    if usage.free < need_bytes:
        return CheckResult("free space", Status.FAIL, f"{free}; {need}",
                           f"free {_gib(need_bytes - usage.free)} or point nvme_path at a larger drive", values)
    if usage.free < need_bytes * SPACE_MARGIN:
        return CheckResult("free space", Status.WARN, f"{free}; {need}: less than 10% to spare",
                           "free some space: a full disk stops training at the next write", values)
    return CheckResult("free space", Status.PASS, f"{free}; {need}", values=values)


# ------------------------------------------------------------------------------------------------
# Locked memory


def check_memlock(pinned_bytes: int, cuda: bool | None = None) -> CheckResult:
    """``ulimit -l`` (RLIMIT_MEMLOCK, soft limit) against the ``pinned_bytes`` of staging buffers
    zinf pins where CUDA is present (``cuda``: default, whether PyTorch sees it). CUDA's own
    pinned allocations are not counted against this limit, but mlock-based pinning (DeepSpeed's
    async_io, io_uring registered buffers) is, so a small limit is a WARN, not a FAIL."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    values = {"memlock_bytes": None if soft == resource.RLIM_INFINITY else soft, "pinned_bytes": pinned_bytes}
    if soft == resource.RLIM_INFINITY:
        return CheckResult("ulimit -l", Status.PASS, "unlimited", values=values)
    detail = f"{soft // 1024} KiB"
    if not cuda:
        return CheckResult("ulimit -l", Status.PASS, detail + "; no CUDA here, so zinf pins no memory", values=values)
    detail += f", zinf pins {pinned_bytes // MiB} MiB of staging buffers"
    if soft >= pinned_bytes:
        return CheckResult("ulimit -l", Status.PASS, detail, values=values)
    return CheckResult("ulimit -l", Status.WARN, detail + " (mlock-based pinning fails past the limit)",
                       "ulimit -l unlimited, or '* - memlock unlimited' in /etc/security/limits.conf "
                       "(docker run --ulimit memlock=-1)", values)


# ------------------------------------------------------------------------------------------------
# Bandwidth


def check_bandwidth(path: Path, aio=None, bytes_per_op: int = 64 * MiB) -> CheckResult:
    """A short measurement (about a second on a 1 GB/s disk): zinf's NVMe store with the config's
    aio settings, writing and reading 4 MiB fp32 shards, and the raw single-threaded ``O_DIRECT``
    loop on the same path. WARN below :data:`SLOW_DISK_GBps`."""
    from zinf import bench_io

    if aio is None:
        from zinf.config import AioConfig

        aio = AioConfig()
    setting = bench_io.AioSetting(aio.block_size, aio.queue_depth, aio.thread_count)
    load = bench_io.plan_workload((4 * MiB,), bytes_per_op)
    work = path / f".zinf-doctor-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        o_direct = probe_o_direct(work)
        zinf = bench_io.measure_point(work, setting, load, bench_io._Tensors(load))
        raw_read, raw_write = bench_io.measure_baseline("python", work, load, o_direct)
    except (OSError, ZinfError) as e:
        return CheckResult("bandwidth", Status.FAIL, f"the measurement failed: {e}", "check the disk and free space")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    values = {"read_GBps": zinf.read.GBps, "write_GBps": zinf.write.GBps,
              "raw_read_GBps": raw_read.GBps, "raw_write_GBps": raw_write.GBps, "o_direct": o_direct}
    detail = (f"zinf read {zinf.read.GBps:.2f} GB/s, write {zinf.write.GBps:.2f} GB/s "
              f"({setting.label}); raw single-threaded loop read {raw_read.GBps:.2f}, write {raw_write.GBps:.2f} GB/s "
              f"({bench_io.format_bytes(load.bytes_per_op)} each way)")
    if not o_direct:
        detail += "; buffered I/O: reads may come from the page cache"
    slowest = min(zinf.read.GBps, zinf.write.GBps)
    if slowest < SLOW_DISK_GBps:
        return CheckResult(
            "bandwidth", Status.WARN,
            detail + f"; below {SLOW_DISK_GBps:g} GB/s, a step with N GB of state on NVMe takes at least "
            f"{1 / max(slowest, 1e-9):.1f}*N s of I/O",
            f"run `zinf bench-io --path {path}` for the best aio settings; use a faster (or striped) NVMe drive",
            values,
        )
    return CheckResult("bandwidth", Status.PASS, detail, values=values)


# ------------------------------------------------------------------------------------------------
# PCIe links


_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _read(p: Path) -> str | None:
    try:
        return p.read_text().strip()
    except OSError:
        return None


def check_disk_link(path: Path, sys_root: Path = Path("/sys")) -> CheckResult:
    """The PCIe link of the disk holding ``path``, from sysfs (``current_link_speed`` and
    ``current_link_width`` of its PCI device: the LnkSta that ``lspci -vv`` shows). The seed:
    "use lspci -vv to check that the link is x4 Gen3/Gen4"."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    block = sys_root / "dev" / "block" / dev
    if not block.exists():
        return CheckResult("disk link", Status.SKIP, f"device {dev} has no block device in sysfs (overlay, network or virtual filesystem)")
    real = block.resolve()
    pci = [p for p in [real, *real.parents] if _PCI_ADDRESS.match(p.name)]
    disk = real.name
    if not pci:
        return CheckResult("disk link", Status.SKIP, f"{disk} is not on a PCI bus ({real})")
    # the nearest PCI device that reports a link (a virtio or RAID function may not)
    for dev_dir in pci:
        speed, width = _read(dev_dir / "current_link_speed"), _read(dev_dir / "current_link_width")
        if speed and width and not speed.lower().startswith("unknown"):
            break
    else:
        return CheckResult("disk link", Status.SKIP,
                           f"{disk} at PCI {pci[0].name} reports no PCIe link (a virtual disk, e.g. virtio)")
    max_speed, max_width = _read(dev_dir / "max_link_speed"), _read(dev_dir / "max_link_width")
    values = {"pci": dev_dir.name, "speed": speed, "width": width, "max_speed": max_speed, "max_width": max_width}
    detail = f"{disk} at PCI {dev_dir.name}: {speed} x{width} (max {max_speed} x{max_width})"
    if (max_width and width != max_width) or (max_speed and speed != max_speed):
        return CheckResult("disk link", Status.WARN, detail + ": the link runs below what the device supports",
                           "move the drive to a CPU-attached slot with all its lanes (check BIOS bifurcation)", values)
    return CheckResult("disk link", Status.PASS, detail, values=values)


_GPU_QUERY = "name,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"


def _int_or_none(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def parse_nvidia_smi(csv_text: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-gpu=<_GPU_QUERY> --format=csv,noheader,nounits``."""
    gpus = []
    for line in csv_text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 6:
            continue
        gpus.append({"name": cells[0], "bus_id": cells[1], "gen": _int_or_none(cells[2]),
                     "gen_max": _int_or_none(cells[3]), "width": _int_or_none(cells[4]),
                     "width_max": _int_or_none(cells[5])})
    return gpus


def _pinned_h2d_GBps(device_index: int, nbytes: int = 256 * MiB, repeats: int = 5) -> float | None:
    """Host-to-device copy rate from pinned memory (best of ``repeats``), or None without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        dev = torch.device("cuda", device_index)
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize(dev)
        best_s = math.inf
        for _ in range(repeats):
            start_s = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(dev)
            best_s = min(best_s, time.perf_counter() - start_s)
        return nbytes / best_s / 1e9
    except Exception:  # a broken CUDA setup is reported by nvidia-smi's line, not here
        return None


def _lspci_line(bus_id: str) -> str | None:
    if not shutil.which("lspci"):
        return None
    short = bus_id.lower()[-12:] if len(bus_id) > 12 else bus_id.lower()  # 00000000:4E:00.0 -> 0000:4e:00.0
    try:
        out = subprocess.run(["lspci", "-s", short], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0] if out else None


def check_gpu(nvidia_smi: str | None = None, measure_copy: bool = True) -> CheckResult:
    """The GPUs and their PCIe links from ``nvidia-smi``; with PyTorch's CUDA, a pinned
    host-to-device copy of 256 MiB per GPU against the link's rate. A GPU lowers its link speed
    when idle, so a low current generation is only a note unless the copy is slow too."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if not exe:
        return CheckResult("gpu", Status.SKIP, "skip: no NVIDIA GPU found (nvidia-smi is not on PATH)")
    try:
        done = subprocess.run([exe, f"--query-gpu={_GPU_QUERY}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return CheckResult("gpu", Status.WARN, f"nvidia-smi did not answer ({e})", "check the NVIDIA driver")
    gpus = parse_nvidia_smi(done.stdout) if done.returncode == 0 else []
    if not gpus:
        msg = (done.stderr or done.stdout).strip().splitlines()
        return CheckResult("gpu", Status.WARN, f"nvidia-smi found no GPU ({msg[0] if msg else done.returncode})",
                           "check the NVIDIA driver: nvidia-smi should list the GPU")
    status, parts, fixes = Status.PASS, [], []
    for i, g in enumerate(gpus):
        link = (f"PCIe Gen{g['gen']} x{g['width']} (max Gen{g['gen_max']} x{g['width_max']})"
                if g["gen"] is not None else "PCIe link not reported")
        text = f"GPU {i} {g['name']} at {g['bus_id']}: {link}"
        copy_GBps = _pinned_h2d_GBps(i) if measure_copy else None
        g["pinned_h2d_GBps"] = copy_GBps
        if copy_GBps is not None:
            text += f", pinned host->GPU copy {copy_GBps:.1f} GB/s"
            gen, width = g["gen_max"], g["width_max"]
            if gen in PCIE_LANE_GBps and width:
                link_GBps = PCIE_LANE_GBps[gen] * width
                text += f" ({copy_GBps / link_GBps:.0%} of Gen{gen} x{width}'s {link_GBps:.0f} GB/s)"
                if copy_GBps < PCIE_EFFICIENCY_FLOOR * link_GBps:
                    status = Status.WARN
                    fixes.append(f"GPU {i}: the copy is slow for its link; check the slot and the BIOS PCIe settings")
        if g["width"] and g["width_max"] and g["width"] < g["width_max"]:
            status = Status.WARN
            fixes.append(f"GPU {i}: only x{g['width']} of x{g['width_max']} lanes; reseat it in a full x16 slot")
        elif g["gen"] and g["gen_max"] and g["gen"] < g["gen_max"] and copy_GBps is None:
            text += " (a GPU lowers its link speed when idle; check again under load)"
        lspci = _lspci_line(g["bus_id"])
        if lspci:
            text += f" [lspci: {lspci}]"
        parts.append(text)
    return CheckResult("gpu", status, "; ".join(parts), "; ".join(fixes), {"gpus": gpus})


# ------------------------------------------------------------------------------------------------
# Everything


def check_config_paths(path: Path, config: Config) -> CheckResult:
    """Whether the config's swap directories are the one being checked."""
    zero = config.zero_optimization
    used = {role: Path(os.path.abspath(p)) for role, p, dev in (
        ("offload_param", config.param_nvme_path, zero.offload_param.device),
        ("offload_optimizer", config.optim_nvme_path, zero.offload_optimizer.device)) if dev == "nvme"}
    if not used:
        return CheckResult("config", Status.PASS, "valid; it keeps nothing on NVMe (no offload device is \"nvme\")")
    other = {role: p for role, p in used.items() if p != path}
    if other:
        return CheckResult("config", Status.WARN,
                           "valid; but " + ", ".join(f"{r}.nvme_path is {p}" for r, p in other.items())
                           + f", not the checked {path}",
                           "run zinf doctor --path on that directory too")
    return CheckResult("config", Status.PASS, f"valid; its nvme_path is {path}")


def run_checks(
    path: str | os.PathLike,
    *,
    config: Config | None = None,
    state_bytes: int | None = None,
    params: int | None = None,
    measure: bool = True,
) -> list[CheckResult]:
    """Every check, in the order of the module docstring. Checks that need a usable ``path`` are
    SKIPped when it is not. ``state_bytes`` (or ``params``, turned into bytes with ``config``, or
    the seed layout without one) is compared with the free space. ``measure=False`` leaves out
    the bandwidth measurement."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    results = []
    if config is not None:
        results.append(check_config_paths(path, config))
    first = check_path(path)
    results.append(first)
    needs_path = ["filesystem", "O_DIRECT", "free space", "bandwidth", "disk link"]
    if first.status is Status.FAIL:
        results += [CheckResult(n, Status.SKIP, "skip: needs a usable --path") for n in needs_path]
    else:
        results.append(check_filesystem(path))
        results.append(check_o_direct(path))
        why = ""
        if state_bytes is None and params is not None:
            layout = config or seed_layout_config()
            per_param = nvme_bytes_per_param(layout)
            state_bytes = int(params * per_param)
            why = f"{params:,} params x {per_param:g} bytes on NVMe" + ("" if config else ", the seed layout")
        results.append(check_free_space(path, state_bytes, why))
    cfg = config
    zcfg = cfg.zinf if cfg is not None else None
    pinned_bytes = (zcfg.staging_buffers * zcfg.staging_buffer_size) if zcfg else 4 * 4 * MiB
    results.append(check_memlock(pinned_bytes))
    if first.status is not Status.FAIL:
        if measure:
            results.append(check_bandwidth(path, cfg.aio if cfg is not None else None))
        else:
            results.append(CheckResult("bandwidth", Status.SKIP, "skip: not measured (--no-measure)"))
        results.append(check_disk_link(path))
    results.append(check_cpu_threads())
    results.append(check_gpu())
    return results


def check_cpu_threads(torch_threads: int | None = None, cores: int | None = None) -> CheckResult:
    """WARN when torch's intra-op threads (OpenMP) take every core this process may run on.

    zinf runs its own threads beside the training thread (NVMe requests, write-behind, the
    profiler's writer); a team on every core is then preempted and waits for its slowest member.
    Measured on the H200 machine's 16 cores (benchmarks/RESULTS.md): profiler on / off 1.095 with
    16 torch threads, 0.967 with 8, and 8 threads faster outright. It matters where the compute is
    on the CPU (CPU training, the optimizer phase of a CPU device); GPU compute does not use them."""
    import torch

    torch_threads = torch.get_num_threads() if torch_threads is None else torch_threads
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    values = {"torch_threads": torch_threads, "cores": cores}
    detail = f"torch uses {torch_threads} CPU thread(s) on {cores} core(s)"
    if cores > 2 and torch_threads >= cores:
        keep = max(1, cores - max(2, cores // 4))
        return CheckResult("cpu threads", Status.WARN, detail + ": zinf's I/O and profiler threads will preempt its OpenMP team",
                           f"leave cores to zinf: torch.set_num_threads({keep}) or OMP_NUM_THREADS={keep} "
                           "(matters where compute or the optimizer runs on the CPU)", values)
    return CheckResult("cpu threads", Status.PASS, detail, values=values)


def exit_code(results: list[CheckResult]) -> int:
    """0 when no check FAILed, else 1."""
    return 1 if any(r.status is Status.FAIL for r in results) else 0
