"""Tests of zinf.storage on real files: aligned buffers, the I/O backend, shard files, the NVMe
store and filesystem probing. No mocks: O_DIRECT, tmpfs, ENOSPC, read-only filesystems and
crashes are the real thing (the mount-based ones are skipped where mounting is not allowed)."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import uuid
import warnings
import zlib
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from zinf.errors import CorruptShardError, StorageError
from zinf.storage import (
    ALIGN,
    HEADER_BYTES,
    MAGIC,
    NvmeStore,
    ShortTransferError,
    StagingPool,
    ThreadPoolBackend,
    aligned_empty,
    crc32_combine,
    filesystem_of,
    o_direct_supported,
    read_header,
    read_tensor_file,
    round_up,
    write_tensor_file,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module")
def backend():
    b = ThreadPoolBackend(block_size=64 << 10, queue_depth=8, thread_count=4)
    yield b
    b.close()


@pytest.fixture(scope="module")
def tmp_o_direct(tmp_path_factory) -> bool:
    """Whether the filesystem of pytest's tmp_path accepts O_DIRECT (ext4 / xfs do)."""
    return o_direct_supported(tmp_path_factory.getbasetemp())


@pytest.fixture
def shm_root():
    """A fresh directory on /dev/shm (tmpfs), removed afterwards."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("/dev/shm does not exist here")
    root = Path("/dev/shm") / f"zinf-test-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _quiet_store(root, **kwargs) -> NvmeStore:
    """An NvmeStore opened with its open-time warnings (O_DIRECT fallback) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return NvmeStore(root, **kwargs)


@contextmanager
def _mounted(fstype: str, target: Path, options: str):
    """Mount a fresh ``fstype`` at ``target`` (skipping the test where that is not allowed)."""
    target.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    proc = subprocess.run(
        ["mount", "-t", fstype, "-o", options, fstype, str(target)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here: {proc.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:  # a normal, buffered write, as damage would be
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _unaligned_like(t: torch.Tensor) -> torch.Tensor:
    """An empty contiguous tensor like ``t`` whose data does not start on a 4096 boundary."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = base[1:].view(t.shape)
    assert t.numel() == 0 or out.data_ptr() % ALIGN != 0
    return out


# ----------------------------------------------------------------------------------------------
# aligned.py


def test_aligned_empty_is_aligned_and_padded():
    for n in (0, 1, 4095, 4096, 4097, 1 << 20, 3 * 4096 + 5):
        buf = aligned_empty(n, pin=True)  # pin is a no-op without CUDA
        assert buf.dtype == torch.uint8 and buf.device.type == "cpu"
        assert buf.numel() == round_up(n)
        assert n == 0 or buf.data_ptr() % ALIGN == 0
    assert (
        round_up(0) == 0 and round_up(1) == 4096 and round_up(8192) == 8192 and round_up(5, 4) == 8
    )


def test_staging_pool_never_exceeds_count_under_concurrency():
    pool = StagingPool(8192, 3)
    assert pool.total_bytes == 3 * 8192
    held: set[int] = set()
    max_seen = 0
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker():
        nonlocal max_seen
        try:
            for _ in range(50):
                with pool.buffer() as buf:
                    with lock:
                        assert buf.data_ptr() not in held, "one buffer handed out twice"
                        held.add(buf.data_ptr())
                        max_seen = max(max_seen, len(held), pool.in_use)
                    buf.fill_(1)
                    time.sleep(0.0005)
                    with lock:
                        held.remove(buf.data_ptr())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert 1 <= max_seen <= 3
    assert pool.in_use == 0


def test_staging_pool_timeout_and_foreign_release():
    pool = StagingPool(4096, 2)
    a, b = pool.acquire(), pool.acquire()
    with pytest.raises(TimeoutError, match="staging buffer"):
        pool.acquire(timeout_s=0.05)
    with pytest.raises(ValueError):
        pool.release(aligned_empty(4096))
    pool.release(a)
    assert pool.in_use == 1
    pool.release(b)
    with pytest.raises(ValueError):
        pool.release(b)  # twice


# ----------------------------------------------------------------------------------------------
# io.py


@pytest.mark.parametrize(
    "block_size,queue_depth,thread_count",
    [(4096, 1, 1), (64 << 10, 2, 4), (1 << 20, 8, 4), (3 * 4096, 16, 3), (1000, 4, 2)],
)
def test_thread_pool_backend_reads_what_was_written_in_pieces(
    tmp_path, block_size, queue_depth, thread_count
):
    rng = random.Random(block_size)
    total_bytes = 3 * (1 << 20) + 12345
    payload = torch.randint(0, 256, (total_bytes,), dtype=torch.uint8)
    view = memoryview(payload.numpy())
    path = tmp_path / "pieces.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with ThreadPoolBackend(block_size, queue_depth, thread_count) as b:
            # Write in pieces of random sizes, all in flight at once.
            cuts = sorted({0, total_bytes, *(rng.randrange(total_bytes) for _ in range(20))})
            futures = [b.pwrite(fd, view[s:e], s) for s, e in zip(cuts, cuts[1:], strict=False)]
            assert sum(f.result() for f in futures) == total_bytes
            back = torch.zeros(total_bytes, dtype=torch.uint8)
            back_view = memoryview(back.numpy())
            assert b.pread(fd, back_view, 0).result() == total_bytes
            assert torch.equal(back, payload)
            # Several overlapping reads at odd offsets, concurrently.
            reads = []
            for _ in range(8):
                s = rng.randrange(total_bytes - 1)
                e = rng.randrange(s + 1, total_bytes + 1)
                dst = torch.zeros(e - s, dtype=torch.uint8)
                reads.append((s, e, dst, b.pread(fd, memoryview(dst.numpy()), s)))
            for s, e, dst, f in reads:
                assert f.result() == e - s
                assert torch.equal(dst, payload[s:e])
            assert b.pread(fd, memoryview(bytearray(0)), 0).result() == 0
    finally:
        os.close(fd)


def test_thread_pool_backend_errors_reach_the_future(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolBackend(4096, 4, 2) as b:
            with pytest.raises(ShortTransferError, match="end of file"):
                b.pread(fd, memoryview(bytearray(20000)), 0).result()
            bad_fd = os.open(path, os.O_RDONLY)
            os.close(bad_fd)
            with pytest.raises(OSError) as info:
                b.pread(bad_fd, memoryview(bytearray(8192)), 0).result()
            assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)
    b.close()  # twice is fine
    with pytest.raises(RuntimeError):
        b.pread(0, memoryview(bytearray(1)), 0)


# ----------------------------------------------------------------------------------------------
# shardfile.py


def test_crc32_combine_matches_zlib():
    rng = random.Random(0)
    for _ in range(20):
        a = rng.randbytes(rng.randrange(0, 5000))
        b = rng.randbytes(rng.randrange(0, 70000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def _tensor_cases():
    torch.manual_seed(0)
    return {
        "fp32_odd": torch.randn(1000, 37),
        "fp32_transposed": torch.randn(300, 501).t(),
        "bf16_odd": torch.randn(333).bfloat16(),
        "bf16_strided": torch.randn(3001).bfloat16()[::3],
        "int64_exact_blocks": torch.arange(3 * 4096, dtype=torch.int64),
        "int64_permuted": torch.arange(7 * 11 * 13, dtype=torch.int64)
        .view(7, 11, 13)
        .permute(2, 0, 1),
        "fp32_scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "bool": torch.rand(5000) > 0.5,
    }


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("case", list(_tensor_cases()))
def test_round_trip(tmp_path, backend, tmp_o_direct, o_direct, case):
    if o_direct and not tmp_o_direct:
        pytest.skip(f"{filesystem_of(tmp_path).fstype} at {tmp_path} refuses O_DIRECT")
    t = _tensor_cases()[case]
    path = tmp_path / "t.shard"
    nbytes = t.numel() * t.element_size()
    assert write_tensor_file(
        path, t, backend=backend, o_direct=o_direct, key=case
    ) == HEADER_BYTES + round_up(nbytes)
    assert path.stat().st_size == HEADER_BYTES + round_up(nbytes)

    header = read_header(path)
    assert (header.key, header.dtype, header.shape, header.nbytes) == (
        case,
        t.dtype,
        tuple(t.shape),
        nbytes,
    )
    raw = path.read_bytes()
    assert raw.startswith(MAGIC) and header.crc32 == zlib.crc32(
        raw[HEADER_BYTES : HEADER_BYTES + nbytes]
    )
    assert raw[HEADER_BYTES + nbytes :] == b"\0" * (round_up(nbytes) - nbytes)  # zero padding

    fresh = read_tensor_file(path, backend=backend, o_direct=o_direct)
    assert fresh.dtype == t.dtype and fresh.shape == t.shape and torch.equal(fresh, t)
    for out in (torch.empty(t.shape, dtype=t.dtype), _unaligned_like(t)):
        assert read_tensor_file(path, backend=backend, o_direct=o_direct, out=out, key=case) is out
        assert torch.equal(out, t)
    # From and into 4096-aligned memory (the engine's flat buffers): no staging copies.
    aligned_src = aligned_empty(nbytes)[:nbytes].view(t.dtype).view(t.shape).copy_(t)
    write_tensor_file(path, aligned_src, backend=backend, o_direct=o_direct, key=case)
    aligned_out = aligned_empty(nbytes)[:nbytes].view(t.dtype).view(t.shape)
    assert torch.equal(
        read_tensor_file(path, backend=backend, o_direct=o_direct, out=aligned_out), t
    )
    as_bytes = torch.empty(nbytes, dtype=torch.uint8)  # any dtype of the right size will do
    read_tensor_file(path, backend=backend, o_direct=o_direct, out=as_bytes)
    assert torch.equal(as_bytes, t.contiguous().reshape(-1).view(torch.uint8))



@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize(
    "nbytes", [(1 << 20) + 4096, (1 << 20) + 4100, 3 * (1 << 20) + 123, (1 << 20) - 8],
    ids=["two_pieces_aligned", "partial_last_block", "many_blocks_odd_tail", "under_one_call"],
)
def test_direct_transfer_header_with_first_block(tmp_path, backend, tmp_o_direct, o_direct, nbytes):
    """Aligned memory larger than one call: the header goes with the first block on the
    caller's thread while the backend moves the rest in 64 KiB pieces, and a payload that ends
    mid-block goes through the one-block tail buffer; bytes, padding and CRC must all be right."""
    if o_direct and not tmp_o_direct:
        pytest.skip("O_DIRECT refused here")
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    path = tmp_path / "direct.shard"
    src = aligned_empty(nbytes)[:nbytes]  # 4096-aligned, exactly the payload: no padding
    src.copy_(payload)
    write_tensor_file(path, src, backend=backend, o_direct=o_direct, key="d")
    raw = path.read_bytes()
    assert len(raw) == HEADER_BYTES + round_up(nbytes)
    assert raw[HEADER_BYTES : HEADER_BYTES + nbytes] == payload.numpy().tobytes()
    assert raw[HEADER_BYTES + nbytes :] == b"\0" * (round_up(nbytes) - nbytes)
    assert read_header(path).crc32 == zlib.crc32(payload.numpy().tobytes())
    out = aligned_empty(nbytes)[:nbytes]
    out.zero_()
    assert read_tensor_file(path, backend=backend, o_direct=o_direct, out=out, key="d") is out
    assert torch.equal(out, payload)
    _flip_byte(path, HEADER_BYTES + nbytes - 1)  # damage in the last (tail) block is caught
    with pytest.raises(CorruptShardError, match="checksum"):
        read_tensor_file(path, backend=backend, o_direct=o_direct, out=aligned_empty(nbytes)[:nbytes])

@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_round_trip_large_through_small_staging(tmp_path, backend, tmp_o_direct, o_direct):
    """Several checksum pieces, and unaligned memory streamed through a tiny staging buffer."""
    if o_direct and not tmp_o_direct:
        pytest.skip("O_DIRECT refused here")
    t = torch.randn((5 << 20) // 4 + 123)  # > one 4 MiB checksum piece, odd tail
    src = _unaligned_like(t)
    src.copy_(t)
    staging = aligned_empty(3 * 4096)
    path = tmp_path / "big.shard"
    write_tensor_file(
        path, src, backend=backend, o_direct=o_direct, staging=staging, fsync_dir=True
    )
    out = _unaligned_like(t)
    read_tensor_file(path, backend=backend, o_direct=o_direct, out=out, staging=staging)
    assert torch.equal(out, t)
    with pytest.raises(ValueError, match="staging"):
        write_tensor_file(
            path, t, backend=backend, o_direct=o_direct, staging=torch.empty(100, dtype=torch.uint8)
        )
    with pytest.raises(ValueError, match="out must be"):
        read_tensor_file(path, backend=backend, o_direct=o_direct, out=torch.empty(10))


def test_checksum_corruption_names_key_and_path(tmp_path):
    with _quiet_store(tmp_path / "swap") as store:
        t = torch.randn(10_000)
        store.write("layer3.exp_avg", t)
        path = store.path("layer3.exp_avg")
        _flip_byte(path, HEADER_BYTES + 12_345)
        with pytest.raises(CorruptShardError) as info:
            store.read("layer3.exp_avg")
        msg = str(info.value)
        assert "layer3.exp_avg" in msg and str(path) in msg
        assert "corrupt" in msg and "restore" in msg and "checksum" in msg
        # Without verification the damaged bytes come back as they are.
        back = read_tensor_file(path, backend=store._backend, o_direct=store.o_direct, verify=False)
        assert (back != t).sum() == 1


def test_truncated_bad_magic_and_missing_files(tmp_path, backend):
    t = torch.randn(5000)
    path = tmp_path / "x.shard"
    for cut_bytes in (HEADER_BYTES + 8192, 100):
        write_tensor_file(path, t, backend=backend, o_direct=False, key="x")
        os.truncate(path, cut_bytes)
        with pytest.raises(CorruptShardError, match="truncated") as info:
            read_tensor_file(path, backend=backend, o_direct=False, key="x")
        assert str(path) in str(info.value) and "'x'" in str(info.value)

    write_tensor_file(path, t, backend=backend, o_direct=False)
    _flip_byte(path, 0)
    with pytest.raises(CorruptShardError, match="bad magic"):
        read_tensor_file(path, backend=backend, o_direct=False)
    with pytest.raises(CorruptShardError, match="bad magic"):
        read_header(path)

    with pytest.raises(StorageError, match="does not exist"):
        read_tensor_file(tmp_path / "nope.shard", backend=backend, o_direct=False, key="nope")


def _crash_writer_script() -> str:
    # A zygote: imports torch once, then forks writer children that rewrite one key forever,
    # and SIGKILLs each at a random moment. Each child reports every version it completed.
    return r"""
import json, os, random, signal, sys, time
from pathlib import Path
import torch
from zinf.storage import ThreadPoolBackend, write_tensor_file

root, iterations, o_direct = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
rng = random.Random(int(sys.argv[4]))
numel_of = lambda v: 1000 + (v * 7919) % 400_000
results = []
for i in range(iterations):
    path = root / f"crash{i}.shard"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        backend = ThreadPoolBackend(1 << 18, 8, 4)
        v = 0
        while True:
            t = torch.full((numel_of(v),), float(v))
            write_tensor_file(path, t, backend=backend, o_direct=o_direct)
            os.write(w, v.to_bytes(4, "little"))
            v += 1
    os.close(w)
    data = os.read(r, 4)
    if len(data) < 4:
        sys.exit("writer died before its first write")
    time.sleep(rng.uniform(0.0, 0.06))
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    if not os.WIFSIGNALED(status):
        sys.exit(f"writer exited by itself (status {status})")
    done = [int.from_bytes(data[j:j + 4], "little") for j in range(0, len(data) // 4 * 4, 4)]
    results.append({"path": str(path), "last_done": done[-1]})
print(json.dumps(results))
"""


def test_sigkilled_writer_always_leaves_a_complete_version(tmp_path, backend, tmp_o_direct):
    script = tmp_path / "crash_writer.py"
    script.write_text(_crash_writer_script())
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "8", "1" if tmp_o_direct else "0", "1234"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 8
    for r in results:
        back = read_tensor_file(Path(r["path"]), backend=backend, o_direct=False)  # verifies crc
        v = int(back[0].item())
        assert v in (r["last_done"], r["last_done"] + 1)  # the last completed, or the one in flight
        assert back.numel() == 1000 + (v * 7919) % 400_000
        assert torch.all(back == float(v))


# ----------------------------------------------------------------------------------------------
# nvme.py


def test_store_operations(tmp_path, tmp_o_direct):
    events = []
    root = tmp_path / "deep" / "swap"  # parents are created
    with _quiet_store(
        root, run_name="t1", listener=lambda *e: events.append(e), staging_bytes=1 << 16
    ) as store:
        assert store.run_dir == root / "zinf-t1" and store.run_dir.is_dir()
        marker = json.loads((store.run_dir / "ZINF_SWAP").read_text())
        assert marker["pid"] == os.getpid() and "hostname" in marker and "started" in marker
        assert store.o_direct == tmp_o_direct
        assert store.staging_bytes_total == 4 * (1 << 16)

        a = torch.randn(1234, 5)
        b = torch.randn(64, 64).bfloat16().t()  # non-contiguous
        key_b = "layers.0/attn wq"  # a key that is not a valid file name as it stands
        assert store.write("a", a) == HEADER_BYTES + round_up(a.numel() * 4)
        assert store.write_async(key_b, b).result() > 0
        assert store.exists("a") and store.exists(key_b) and not store.exists("c")
        assert store.keys() == sorted(["a", key_b])
        assert store.nbytes("a") == a.numel() * 4 and store.nbytes(key_b) == b.numel() * 2
        assert store.path(key_b).parent == store.run_dir
        assert torch.equal(store.read("a"), a)
        out = _unaligned_like(b.contiguous())
        assert store.read_async(key_b, out).result() is out and torch.equal(out, b)
        assert store.bytes_written == (a.numel() * 4 + b.numel() * 2)
        assert store.bytes_read == store.bytes_written
        assert [(op, key, n) for op, key, n, _, _ in events] == [
            ("write", "a", a.numel() * 4),
            ("write", key_b, b.numel() * 2),
            ("read", "a", a.numel() * 4),
            ("read", key_b, b.numel() * 2),
        ]
        assert all(s >= 0 for *_, s, _ in events)
        assert all(c >= 1.0 for *_, c in events)  # one request at a time here: each ran alone
        assert all(c == pytest.approx(1.0, abs=0.05) for *_, c in events)

        store.write("a", torch.zeros(3))  # replace with another size
        assert store.nbytes("a") == 12 and torch.equal(store.read("a"), torch.zeros(3))
        store.delete("a")
        store.delete("a")  # idempotent
        assert not store.exists("a")
        with pytest.raises(StorageError, match="does not exist"):
            store.read("a")
        assert store.free_bytes() > 0
        store.check_space(1)
        with pytest.raises(
            StorageError,
            match=r"needs .* GiB free, has .*; free space or point nvme_path elsewhere",
        ):
            store.check_space(1 << 60)
        assert not list(store.run_dir.glob(".*tmp-*"))
    assert not (root / "zinf-t1").exists()  # close removed the run dir
    with pytest.raises(RuntimeError):
        store.read(key_b)


def test_store_recycles_retired_files_but_never_a_linked_one(tmp_path, backend):
    """Rewrites overwrite retired versions (no new files pile up), and a version hard-linked
    into a checkpoint keeps its bytes however often the key is rewritten."""
    with _quiet_store(tmp_path / "swap", thread_count=2, spare_bytes=64 << 20) as store:
        for v in range(4):
            store.write("w", torch.full((300_000,), float(v)))
        names = sorted(p.name for p in store.run_dir.iterdir() if p.suffix == ".shard")
        # the current version and at most per_length retired ones of its length
        assert 2 <= len(names) <= 1 + store._spares.per_length, names
        assert store.read("w").eq(3.0).all()

        checkpoint = tmp_path / "ckpt.bin"
        store.link_to("w", checkpoint)
        for v in range(4, 10):
            store.write("w", torch.full((300_000,), float(v)))
            assert store.read("w").eq(float(v)).all()
        saved = read_tensor_file(checkpoint, backend=backend, o_direct=False)  # verifies crc
        assert saved.eq(3.0).all()
        assert os.stat(checkpoint).st_nlink == 1  # the store let go of it

        # a deleted key's file is retired too, and reused by a write of the same length
        store.write("g", torch.ones(300_000))
        store.delete("g")
        assert not store.exists("g") and store.keys() == ["w"]
        held = store._spares.held_bytes
        store.write("h", torch.zeros(300_000))
        assert store._spares.held_bytes <= held
        assert store.read("h").eq(0.0).all()


def test_store_concurrent_different_keys(tmp_path):
    # pin_memory only takes effect where CUDA exists.
    with _quiet_store(
        tmp_path, thread_count=4, staging_count=2, staging_bytes=1 << 16, pin_memory=True
    ) as store:
        errors = []

        def worker(i):
            try:
                rng = torch.Generator().manual_seed(i)
                for j in range(6):
                    t = torch.randn(
                        int(torch.randint(1, 300_000, (1,), generator=rng)), generator=rng
                    )
                    if j % 2:
                        t = _unaligned_like(t).copy_(t)  # through the staging pool
                    store.write_async(f"k{i}", t).result() if j % 3 == 0 else store.write(
                        f"k{i}", t
                    )
                    assert torch.equal(store.read(f"k{i}"), t)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert store._staging.in_use == 0


def test_tmpfs_dev_shm(shm_root):
    """tmpfs refused O_DIRECT before Linux 6.6 and accepts it since; the store must agree with a
    probe either way, and warn exactly when it falls back."""
    shm_root.mkdir()
    supported = o_direct_supported(shm_root)
    assert filesystem_of(shm_root).fstype == "tmpfs"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = NvmeStore(shm_root)
    fallbacks = [w for w in caught if "O_DIRECT refused" in str(w.message)]
    assert store.o_direct == supported
    assert len(fallbacks) == (0 if supported else 1)
    with store:
        t = torch.randn(777).bfloat16()
        store.write("x", t)
        assert torch.equal(store.read("x"), t)


def test_o_direct_refused_falls_back_to_buffered(tmp_path):
    """ramfs refuses O_DIRECT on every kernel (as tmpfs did before 6.6)."""
    with _mounted("ramfs", tmp_path / "ramfs", "mode=755") as mnt:
        assert not o_direct_supported(mnt)
        with pytest.warns(
            UserWarning,
            match=r"O_DIRECT refused on ramfs at .*; using buffered I/O \(slower, uses page "
            r"cache\)",
        ) as caught:
            store = NvmeStore(mnt)
        assert sum("O_DIRECT" in str(w.message) for w in caught) == 1
        with store:
            assert store.o_direct is False
            t = torch.randn(100, 33)
            store.write("x", t)
            out = _unaligned_like(t)
            assert torch.equal(store.read("x", out), t)


def test_stale_run_dirs_are_cleaned_and_live_ones_kept(tmp_path):
    root = tmp_path / "swap"
    root.mkdir()

    def run_dir(name, *, lock=True):
        d = root / name
        d.mkdir()
        (d / "ZINF_SWAP").write_text(
            json.dumps({"pid": 999999, "hostname": "gone", "started": "x"})
        )
        if lock:
            (d / "owner.lock").touch()
        (d / "w.shard").write_bytes(b"old swap data")
        return d

    stale = run_dir("zinf-dead")
    stale_no_lock = run_dir("zinf-nolock", lock=False)
    live = run_dir("zinf-live")
    unmarked = root / "zinf-notmine"
    unmarked.mkdir()
    (unmarked / "data").write_text("keep")
    other = root / "other"
    other.mkdir()

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys; f = open(sys.argv[1], 'a'); "
            "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); "
            "print('locked', flush=True); sys.stdin.read()",
            str(live / "owner.lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = NvmeStore(root)
        with store:
            assert sorted(store.cleaned_dirs) == sorted([stale, stale_no_lock])
            assert not stale.exists() and not stale_no_lock.exists()
            assert live.exists() and (live / "w.shard").exists()
            assert (unmarked / "data").read_text() == "keep" and other.exists()
            removed = [str(w.message) for w in caught if "removed" in str(w.message)]
            assert len(removed) == 2 and any("zinf-dead" in m for m in removed)
            # A second store beside a live one leaves it alone, and a taken name is refused.
            with _quiet_store(root) as second:
                assert second.cleaned_dirs == [] and store.run_dir.exists()
            with pytest.raises(StorageError, match="in use by another run"):
                _quiet_store(root, run_name=store.run_dir.name.removeprefix("zinf-"))
            with pytest.raises(StorageError, match="in use by another run"):
                _quiet_store(root, run_name="live")
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
        holder.stdout.close()
    # Once its holder is gone, the formerly live dir is a leftover too; so is a kept dir.
    kept = _quiet_store(root, run_name="kept")
    assert kept.cleaned_dirs == [live]
    kept.close(remove=False)
    with pytest.warns(UserWarning, match="removed"):
        store = NvmeStore(root)
    assert store.cleaned_dirs == [root / "zinf-kept"]
    store.close()
    assert sorted(p.name for p in root.iterdir()) == ["other", "zinf-notmine"]


def test_bad_paths_fail_clearly_and_leave_nothing(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a dir")
    with pytest.raises(
        StorageError, match=r"is a file, not a directory; point nvme_path at a directory"
    ):
        NvmeStore(a_file)
    with pytest.raises(StorageError, match=r"cannot be created .*; create it or point nvme_path"):
        NvmeStore(a_file / "sub" / "deeper")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    with pytest.raises(StorageError, match="cannot be created"):
        NvmeStore("/proc/zinf-swap")  # procfs: nothing can be created there


def test_read_only_nvme_path(tmp_path):
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            with pytest.raises(StorageError, match="is not writable"):
                NvmeStore(ro)
            assert list(ro.iterdir()) == []
        finally:
            ro.chmod(0o755)
        return
    # root ignores permission bits, so use a read-only filesystem.
    with _mounted("tmpfs", tmp_path / "ro", "ro,size=1m") as ro:
        with pytest.raises(
            StorageError, match=r"nvme_path .* is not writable .*; fix its permissions"
        ):
            NvmeStore(ro)
        with pytest.raises(StorageError, match="cannot be created"):
            NvmeStore(ro / "sub")
        assert list(ro.iterdir()) == []


def test_full_disk_keeps_previous_version(tmp_path):
    with _mounted("tmpfs", tmp_path / "small", "size=1m") as small:
        with _quiet_store(small) as store:
            old = torch.randn(50_000)  # 200 kB
            store.write("w", old)
            with pytest.raises(
                StorageError, match=r"no space left .* free space or point nvme_path elsewhere"
            ) as info:
                store.write("w", torch.randn(1 << 20))  # 4 MiB > the 1 MiB filesystem
            assert info.value.errno == errno.ENOSPC and str(store.path("w")) in str(info.value)
            assert not list(store.run_dir.glob(".*tmp-*"))  # the temporary file is gone
            assert torch.equal(store.read("w"), old)


def test_full_nvme_path_fails_at_open_and_leaves_nothing(tmp_path):
    with _mounted("tmpfs", tmp_path / "tiny", "size=64k") as tiny:
        fd = os.open(tiny / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        try:  # fill the filesystem to the last block
            while os.write(fd, b"\0" * 4096) > 0:
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        with pytest.raises(
            StorageError, match=r"is full .*; free space or point nvme_path elsewhere"
        ):
            NvmeStore(tiny)
        assert [p.name for p in tiny.iterdir()] == ["filler"]


def test_link_to_hardlinks_and_copies_across_filesystems(tmp_path, shm_root):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    v1, v2 = torch.randn(3000), torch.randn(3000)
    with _quiet_store(tmp_path / "swap") as store:
        store.write("p", v1)
        dest = store.link_to("p", ckpt / "p.shard", fsync_dir=True)
        assert dest.stat().st_ino == store.path("p").stat().st_ino  # a hard link, no copy
        store.write("p", v2)  # a replacement, so the link keeps the old version
        assert torch.equal(read_tensor_file(dest, backend=store._backend, o_direct=False), v1)
        assert torch.equal(store.read("p"), v2)
        store.link_to("p", dest)  # replaces an existing destination
        assert torch.equal(read_tensor_file(dest, backend=store._backend, o_direct=False), v2)
        with pytest.raises(StorageError, match="no file"):
            store.link_to("missing", ckpt / "m.shard")

    with _quiet_store(shm_root) as shm_store:  # /dev/shm -> /tmp: EXDEV, so a checked copy
        shm_store.write("q", v1)
        dest = shm_store.link_to("q", ckpt / "q.shard")
        assert dest.stat().st_ino != shm_store.path("q").stat().st_ino
        assert read_header(dest).key == "q"
        assert torch.equal(read_tensor_file(dest, backend=shm_store._backend, o_direct=False), v1)
        _flip_byte(shm_store.path("q"), HEADER_BYTES + 5)
        with pytest.raises(CorruptShardError, match="'q'"):
            shm_store.link_to("q", ckpt / "q2.shard")
        assert not (ckpt / "q2.shard").exists() and not list(ckpt.glob(".*tmp-*"))


# ----------------------------------------------------------------------------------------------
# fsinfo.py


def test_filesystem_of(tmp_path):
    info = filesystem_of(tmp_path)
    assert str(tmp_path).startswith(info.mount_point) and info.fstype and info.options
    assert filesystem_of(tmp_path / "not" / "yet") == info  # resolved through existing parents
    if Path("/dev/shm").is_dir():
        shm = filesystem_of("/dev/shm")
        assert shm.fstype == "tmpfs" and shm.mount_point == "/dev/shm"
    assert filesystem_of("/").mount_point == "/"
    assert isinstance(o_direct_supported(tmp_path), bool)
    assert not list(tmp_path.iterdir())  # the probe cleans up after itself


def test_a_header_decoded_again_is_checked_as_the_first_time():
    """The second decode of a shard's header (the same bytes but its CRC's) skips the JSON parse;
    it returns what a full decode does, with this CRC, and still refuses the wrong key. Headers
    whose bytes differ anywhere else, or whose CRC is not digits, are decoded in full: a damaged
    one is refused even after its undamaged self was decoded."""
    from zinf.storage import shardfile

    path = Path("p.shard")
    good = shardfile.ShardHeader("layers.0.param", torch.float32, (64, 32), 64 * 32 * 4, 7)
    shardfile._checked_prefixes.clear()
    assert shardfile.ShardHeader.decode(good.encode(), path, "layers.0.param") == good
    assert len(shardfile._checked_prefixes) == 1  # (the full decode checked its prefix)
    for crc in (0, 123456789, 2**32 - 1):
        again = shardfile.ShardHeader.decode(replace(good, crc32=crc).encode(), path, "layers.0.param")
        assert again == replace(good, crc32=crc)
    with pytest.raises(CorruptShardError, match="it holds key 'layers.0.param'"):
        shardfile.ShardHeader.decode(good.encode(), path, "layers.1.param")
    raw = good.encode()
    # the shape no longer matches nbytes: a prefix never checked, refused by the full decode
    damaged = raw.replace(b"[64, 32]", b"[64, 33]")
    with pytest.raises(CorruptShardError, match="header says 8192 bytes"):
        shardfile.ShardHeader.decode(damaged, path, "layers.0.param")
    with pytest.raises(CorruptShardError, match="unreadable header"):
        shardfile.ShardHeader.decode(raw.replace(b'"crc32": 7}', b'"crc32": 7x'), path, "layers.0.param")
    assert len(shardfile._checked_prefixes) == 1
