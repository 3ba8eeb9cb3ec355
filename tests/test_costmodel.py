"""The planner's I/O cost model, fitted from a real profile: a small GPT trained for a few steps with
its params and optimizer state on NVMe files under tmp_path, the profiler recording into SQLite.

Synthetic frames are used only where the truth must be known (recovering a and bandwidth through
outliers) or where the input must be degenerate on purpose.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

import zinf
from zinf.errors import ZinfError
from zinf.models import build_model

from conftest import gpt_batches, placement_config
from planner import CostModel, CostModelError, IOSetting, TierCost, fit_latency_bandwidth
from planner.costmodel import FIX_HINT, MIN_SAMPLES
from profiler import queries
from profiler.recorder import record_calibration

N_STEPS = 5


# shards from 28 KiB packed chunks up to 1 MiB weights: a size range wide enough to fit a slope
WIDE_SIZES = {"chunk_size": "1MiB", "shard_min_bytes": "64KiB"}


def train_profiled(workdir, steps: int = N_STEPS, shards: dict = WIDE_SIZES, **model_overrides) -> str:
    """Train the built-in GPT for ``steps`` steps with params and optimizer state on NVMe files in
    ``workdir`` (``shards``: the zinf chunk settings) and the profiler on; returns the profile
    database URL."""
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny", **model_overrides)
    config = placement_config("nvme", workdir)
    url = f"sqlite:///{workdir / 'profile.db'}"
    config["zinf"] = {**shards, "profiler": {"enabled": True, "db": url}}
    data = gpt_batches(cfg)
    with zinf.initialize(model, config) as engine:
        for step in range(steps):
            x, y = data.get(step)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
    return url


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    work = tmp_path_factory.mktemp("costmodel")
    url = train_profiled(work, n_layer=2, n_embd=256)
    run_id = queries.latest_run_id(url)
    return url, run_id, queries.io_samples(url, run_id)


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg
    return msg


# ------------------------------------------------------------------------- real samples
def test_fit_from_a_real_run(profile):
    url, run_id, samples = profile
    assert len(queries.steps(url, run_id)) == N_STEPS
    assert set(samples["op"]) == {"read", "write"} and set(samples["tier"]) == {"nvme"}
    model = CostModel.from_db(url, run_id)
    assert model.pairs == [("nvme", "read"), ("nvme", "write")]
    for op in ("read", "write"):
        mine = samples[samples["op"] == op]
        c = model.cost("nvme", op)
        assert isinstance(c, TierCost) and c.setting is None
        assert (c.source, c.n_samples) == ("io_samples", len(mine))
        assert c.bandwidth_Bps > 0 and c.latency_s >= 0
        assert (c.bytes_min, c.bytes_max) == (mine["bytes"].min(), mine["bytes"].max())
        assert c.bytes_max >= 4 * c.bytes_min  # the run really spans sizes, so a slope is fitted
        # whether the slope is resolved (>= 3 robust standard errors) depends on how noisy this
        # machine's disk is right now: on a loaded one the bandwidth is honestly a lower bound
        assert c.method in ("huber", "huber_through_origin", "bandwidth_lower_bound")
        # predictions against the measured median of every request size the run made
        by_size = mine.groupby("bytes")["seconds"].agg(["median", "size"])
        predicted = model.predict_s("nvme", op, by_size.index.to_numpy())
        rel = np.abs(predicted / by_size["median"].to_numpy() - 1)
        assert np.median(rel) < 0.5, pd.DataFrame({"predicted_s": predicted, **by_size}, index=by_size.index)
        well_sampled = by_size["size"].to_numpy() >= 20
        assert np.all(rel[well_sampled] < 2.0)  # no well-sampled size off by more than a factor of 3
        # the run used one I/O setting: its per-setting cost is the pooled fit, labelled with it
        (setting,) = {IOSetting.from_row(r) for r in mine.to_dict("records")}
        assert setting.o_direct is not None and setting.block_size > 0
        assert model.cost("nvme", op, setting) == TierCost(**{**c.__dict__, "setting": setting})
        # alone on the disk a request runs at the fitted bandwidth; by default at the samples' concurrency
        assert model.predict_s("nvme", op, 1 << 20, concurrency=1) == pytest.approx(c.latency_s + (1 << 20) / c.bandwidth_Bps)
        assert model.predict_s("nvme", op, 1 << 20) == pytest.approx(
            c.latency_s + (1 << 20) * (1 / c.bandwidth_Bps + (c.concurrency - 1) * c.shared_s_per_byte))
        assert mine["concurrency"].notna().all() and (mine["concurrency"] >= 1).all()
        assert c.concurrency == pytest.approx(mine["concurrency"].median())


def test_to_frame_has_units(profile):
    url, run_id, _ = profile
    df = CostModel.from_db(url, run_id).to_frame()
    assert {"tier", "op", "pooled", "o_direct", "block_size", "queue_depth", "thread_count", "latency_s",
            "bandwidth_GBps", "shared_s_per_byte", "concurrency", "n_samples", "source", "method", "bytes_min",
            "bytes_max", "note"} == set(df.columns)
    pooled = df[df["pooled"]].set_index("op")
    assert list(pooled.index) == ["read", "write"]
    assert (pooled["bandwidth_GBps"] > 0).all() and (pooled["latency_s"] >= 0).all()
    assert df["block_size"].dtype == "Int64"


def test_refit_accumulates_and_caps(profile):
    _, _, samples = profile
    half = len(samples) // 2
    first = CostModel.fit(samples.iloc[:half])
    both = first.refit(samples.iloc[half:])
    assert both.cost("nvme", "read").n_samples == int((samples["op"] == "read").sum())
    assert len(both.samples) == len(samples)
    capped = CostModel.fit(samples.iloc[:half], max_samples_per_group=40).refit(samples.iloc[half:])
    for op in ("read", "write"):
        assert capped.cost("nvme", op).n_samples == 40
        newest = samples[samples["op"] == op].tail(40)
        kept = capped.samples[capped.samples["op"] == op]
        assert kept["seconds"].tolist() == newest["seconds"].tolist()  # the newest are kept


# ------------------------------------------------------------------- known truth, outliers
def synthetic(n=400, latency_s=2e-3, bandwidth_Bps=1.5e9, outliers=0.10, seed=0, **setting) -> pd.DataFrame:
    """Requests of 64 KiB-8 MiB (log-uniform) costing ``latency_s + bytes / bandwidth_Bps`` with 5%
    lognormal noise, and a fraction of ``outliers`` 3-10x slower (stalls behind other I/O)."""
    rng = np.random.default_rng(seed)
    nbytes = np.exp(rng.uniform(np.log(64 << 10), np.log(8 << 20), n)).round()
    seconds = (latency_s + nbytes / bandwidth_Bps) * rng.lognormal(0.0, 0.05, n)
    bad = rng.random(n) < outliers
    seconds[bad] *= rng.uniform(3.0, 10.0, bad.sum())
    return pd.DataFrame({"tier": "nvme", "op": "read", "bytes": nbytes.astype("int64"), "seconds": seconds, **setting})


def test_robust_fit_recovers_latency_and_bandwidth_through_outliers():
    df = synthetic()
    c = CostModel.fit(df).cost("nvme", "read")
    assert c.method == "huber"
    assert c.latency_s == pytest.approx(2e-3, rel=0.05)
    assert c.bandwidth_Bps == pytest.approx(1.5e9, rel=0.05)
    # plain least squares on the same samples is dragged off by the 10% outliers
    slope, intercept = np.polyfit(df["bytes"], df["seconds"], 1)
    assert abs(intercept / 2e-3 - 1) > 0.2 or abs(1 / slope / 1.5e9 - 1) > 0.1


def test_degenerate_samples_keep_latency_nonnegative_and_bandwidth_positive():
    rng = np.random.default_rng(1)
    sizes = rng.integers(16 << 10, 256 << 10, 200).astype(float)
    # all latency, no size dependence: the slope is not identifiable -> a bandwidth lower bound
    flat = 1e-3 * rng.lognormal(0.0, 0.05, 200)
    lat, bw, method = fit_latency_bandwidth(sizes, flat)
    assert method == "bandwidth_lower_bound" and bw > 0 and lat >= 0
    assert np.all(sizes / bw <= np.quantile(flat, 0.999))  # consistent with seconds >= bytes / bandwidth
    assert np.median(np.abs((lat + sizes / bw) / flat - 1)) < 0.1
    # throughput falls with size faster than linear: the intercept would be < 0 -> through the origin
    big = np.linspace(1 << 20, 64 << 20, 100)
    convex = big / 1e9 + (big / (64 << 20)) ** 2 * 0.05
    lat, bw, method = fit_latency_bandwidth(big, convex)
    assert method == "huber_through_origin" and lat == 0.0 and bw > 0
    # every request the same size
    lat, bw, method = fit_latency_bandwidth(np.full(50, 1 << 20), 1e-3 + np.full(50, 1 << 20) / 1e9)
    assert method == "bandwidth_lower_bound" and bw > 0 and lat >= 0
    assert lat + (1 << 20) / bw == pytest.approx(1e-3 + (1 << 20) / 1e9, rel=1e-6)


def shared_disk(n=600, latency_s=0.5e-3, bandwidth_Bps=3.0e9, shared_s_per_byte=1 / 3.0e9, seed=4, sizes=True):
    """Requests at concurrency 1-3 on a disk that each other request in flight slows by
    ``shared_s_per_byte`` (1 / bandwidth: a disk shared equally), 5% noise, 5% outliers."""
    rng = np.random.default_rng(seed)
    nbytes = np.exp(rng.uniform(np.log(256 << 10), np.log(4 << 20), n)).round() if sizes else np.full(n, 768 << 10)
    conc = rng.uniform(1.0, 3.0, n)
    seconds = (latency_s + nbytes / bandwidth_Bps + (conc - 1) * nbytes * shared_s_per_byte) * rng.lognormal(0, 0.05, n)
    bad = rng.random(n) < 0.05
    seconds[bad] *= rng.uniform(3.0, 6.0, bad.sum())
    return pd.DataFrame({"tier": "nvme", "op": "write", "bytes": nbytes.astype("int64"), "seconds": seconds,
                         "concurrency": conc})


@pytest.mark.parametrize("sizes", [True, False], ids=["sizes-vary", "one-size"])
def test_sharing_of_the_disk_is_fitted_from_the_concurrency(sizes):
    df = shared_disk(sizes=sizes)
    c = CostModel.fit(df).cost("nvme", "write")
    assert c.shared_s_per_byte == pytest.approx(1 / 3.0e9, rel=0.15)
    size = 1 << 20 if sizes else 768 << 10  # one size only: latency and bandwidth are known only together
    assert c.seconds(size, concurrency=1) == pytest.approx(0.5e-3 + size / 3.0e9, rel=0.1)
    assert c.seconds(size, concurrency=3) == pytest.approx(0.5e-3 + 3 * size / 3.0e9, rel=0.1)
    assert c.concurrency == pytest.approx(2.0, abs=0.1)
    # the same samples without their concurrency: the old per-request fit, which cannot tell
    # a request alone from one among three (it predicts the middle for both)
    blind = CostModel.fit(df.drop(columns="concurrency")).cost("nvme", "write")
    assert blind.shared_s_per_byte == 0.0 and blind.concurrency == 1.0
    alone = 0.5e-3 + size / 3.0e9
    assert blind.seconds(size, concurrency=1) > 1.3 * alone


def test_sharing_is_left_out_when_the_concurrency_does_not_vary_or_does_not_matter():
    df = shared_disk()
    df["concurrency"] = 2.0  # every request beside one other: sharing cannot be told from bandwidth
    c = CostModel.fit(df).cost("nvme", "write")
    assert c.shared_s_per_byte == 0.0 and "not resolved" in c.note
    assert c.seconds(1 << 20) == pytest.approx(0.5e-3 + 2 * (1 << 20) / 3.0e9, rel=0.1)  # per request as measured
    flat = shared_disk(shared_s_per_byte=0.0)  # a disk with room for all of them: no slow-down
    c = CostModel.fit(flat).cost("nvme", "write")
    assert c.shared_s_per_byte < 0.05 / 3.0e9
    assert c.bandwidth_Bps == pytest.approx(3.0e9, rel=0.1)


def test_costs_per_io_setting():
    one = synthetic(bandwidth_Bps=0.8e9, seed=2, o_direct=True, block_size=1 << 20, queue_depth=8, thread_count=1)
    four = synthetic(bandwidth_Bps=2.4e9, seed=3, o_direct=True, block_size=1 << 20, queue_depth=8, thread_count=4)
    model = CostModel.fit(pd.concat([one, four], ignore_index=True))
    c1 = model.cost("nvme", "read", IOSetting(thread_count=1))
    c4 = model.cost("nvme", "read", IOSetting(o_direct=True, thread_count=4))
    assert (c1.setting.thread_count, c4.setting.thread_count) == (1, 4)
    assert c1.bandwidth_Bps == pytest.approx(0.8e9, rel=0.1) and c4.bandwidth_Bps == pytest.approx(2.4e9, rel=0.1)
    assert c1.n_samples == len(one) and c4.n_samples == len(four)
    # a setting never measured: the pooled cost, which says so by having no setting
    assert model.cost("nvme", "read", IOSetting(thread_count=16)).setting is None
    assert len(model.to_frame()) == 3


# ------------------------------------------------------------------ calibrations, errors
def calibration_rows(path: str, created_at: float = 2e9) -> list[dict]:
    """Rows shaped as ``zinf bench-io`` writes them (``zinf.bench_io.BenchReport.calibration_rows``):
    zinf's store per op and setting, then the raw baseline's two rows. Fixed test values, not a
    measurement; the raw baseline is made 10x faster so that using it by mistake would show."""
    rows = []
    common = {"path": path, "fstype": "ext4", "created_at": created_at}
    for op, gbps, raw in (("read", [1.2, 1.4, 1.6], 14.0), ("write", [1.8, 2.0, 2.4], 20.0)):
        for threads, g in zip((1, 4, 8), gbps):
            rows.append({**common, "op": op, "block_size": 1 << 20, "queue_depth": 8, "thread_count": threads,
                         "bytes": 1 << 30, "GBps": g, "raw_baseline_GBps": raw, "source": "bench-io/zinf"})
        rows.append({**common, "op": op, "block_size": 1 << 20, "queue_depth": 1, "thread_count": 1,
                     "bytes": 1 << 30, "GBps": raw, "source": "bench-io/dd"})
    return rows


def test_calibration_fallback_when_samples_are_few(profile, tmp_path):
    url, run_id, samples = profile
    cal_url = f"sqlite:///{tmp_path / 'cal.db'}"
    old_run = [{**r, "GBps": r["GBps"] / 10} for r in calibration_rows("/mnt/nvme", created_at=1e9)]
    assert record_calibration(cal_url, old_run + calibration_rows("/mnt/nvme")) == 16
    cal = queries.calibrations(cal_url)
    few_writes = samples[samples["op"] == "write"].head(3)
    model = CostModel.fit(pd.concat([samples[samples["op"] == "read"], few_writes]), cal)
    assert model.cost("nvme", "read").source == "io_samples"  # enough samples: the calibrations are not used
    w = model.cost("nvme", "write")
    assert (w.source, w.method, w.n_samples) == ("calibrations", "calibration_median", 3)
    assert w.bandwidth_GBps == pytest.approx(2.0)  # median of the newest run's three zinf write rows
    assert w.setting is None and "median of 3 bench-io row(s)" in w.note
    expected_latency = max(0.0, float(np.median(few_writes["seconds"] - few_writes["bytes"] / 2.0e9)))
    assert w.latency_s == pytest.approx(expected_latency)
    assert "latency from 3 io_sample(s)" in w.note
    # per setting: the calibration row of that thread count (bench-io used O_DIRECT: no "/buffered")
    w8 = model.cost("nvme", "write", IOSetting(o_direct=True, thread_count=8))
    assert (w8.bandwidth_GBps, w8.setting.thread_count, w8.setting.o_direct) == (pytest.approx(2.4), 8, True)


def test_calibrations_only_database(tmp_path):
    url = f"sqlite:///{tmp_path / 'cal.db'}"
    record_calibration(url, calibration_rows("/mnt/a") + [{**r, "GBps": r["GBps"] * 10} for r in calibration_rows("/mnt/b")])
    model = CostModel.from_db(url, calibration_path="/mnt/a/zinf-run-1")  # no run recorded: calibrations only
    r = model.cost("nvme", "read")
    assert (r.source, r.latency_s, r.n_samples) == ("calibrations", 0.0, 3)
    assert r.bandwidth_GBps == pytest.approx(1.4)  # /mnt/a's rows only
    assert "latency unknown" in r.note
    unmatched = CostModel.from_db(url, calibration_path="/somewhere/else").cost("nvme", "read")
    assert unmatched.n_samples == 6 and "other paths" in unmatched.note


def test_calibrations_from_a_real_bench_io_run(profile, tmp_path):
    """``zinf bench-io --quick`` measures tmp_path's disk; with too few samples of a direction the
    model takes that direction's bandwidth from zinf's rows of it, never from the raw baseline."""
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    url = f"sqlite:///{tmp_path / 'bench.db'}"
    proc = subprocess.run([sys.executable, "-c", "from zinf.cli import main; main()", "bench-io", "--path", str(bench_dir),
                           "--quick", "--db", url], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cal = queries.calibrations(url)
    zinf_rows = cal[cal["source"].str.startswith("bench-io/zinf") & (cal["op"] == "read")]
    assert len(zinf_rows) >= 2 and len(cal[~cal["source"].str.startswith("bench-io/zinf")]) == 2  # + the baseline's
    _, _, samples = profile
    model = CostModel.fit(pd.concat([samples[samples["op"] == "write"], samples[samples["op"] == "read"].head(2)]), cal)
    r = model.cost("nvme", "read")
    assert (r.source, r.n_samples) == ("calibrations", len(zinf_rows))
    assert r.bandwidth_GBps == pytest.approx(zinf_rows["GBps"].median())
    assert r.latency_s >= 0 and "latency from 2 io_sample(s)" in r.note
    assert model.cost("nvme", "write").source == "io_samples"
    # every setting bench-io swept has its own cost, O_DIRECT decoded from the stored source
    swept = model.to_frame().query("op == 'read' and source == 'calibrations' and not pooled")
    assert len(swept) == len(zinf_rows) and (swept["n_samples"] == 1).all()


def test_clear_error_when_nothing_is_measured(tmp_path, profile):
    with pytest.raises(CostModelError) as e:
        CostModel.fit(pd.DataFrame(columns=["tier", "op", "bytes", "seconds"]))
    msg = one_line(e)
    assert "zinf bench-io --path DIR" in msg and "profiling on" in msg and str(MIN_SAMPLES) in msg
    assert isinstance(e.value, ZinfError) and FIX_HINT in msg
    # too few samples and no calibrations
    _, _, samples = profile
    with pytest.raises(CostModelError) as e:
        CostModel.fit(samples.head(MIN_SAMPLES - 1))
    assert FIX_HINT in one_line(e)
    # a database with no run and no calibration
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    record_calibration(empty, [])  # creates the schema, writes nothing
    with pytest.raises(CostModelError) as e:
        CostModel.from_db(empty)
    assert FIX_HINT in one_line(e)
    # a fitted model asked for a tier it never saw
    model = CostModel.fit(samples)
    with pytest.raises(CostModelError) as e:
        model.cost("cpu", "read")
    msg = one_line(e)
    assert "'cpu'" in msg and "'read'" in msg and FIX_HINT in msg
    # a frame that is not I/O samples
    with pytest.raises(CostModelError, match="io_samples"):
        CostModel.fit(pd.DataFrame({"bytes": [1], "seconds": [1.0]}))
