"""The cost of moving bytes to and from a tier: ``seconds = latency_s + nbytes / bandwidth_Bps``.

One :class:`TierCost` per (tier, op) - e.g. ``("nvme", "read")`` - and, where the I/O samples carry
their settings, one per :class:`IOSetting` (O_DIRECT, block size, queue depth, thread count) too.

Where the numbers come from, in order of preference (never from a spec sheet):

1. ``io_samples`` - the profiler's record of every whole-file read/write of a shard state during
   training (``profiler.queries.io_samples``). With at least :data:`MIN_SAMPLES` samples of a
   (tier, op) the model is fitted by robust regression (scikit-learn's ``HuberRegressor``) of
   seconds on bytes, so that the stalls and page-cache hits that make a few samples 3-10x off do
   not drag the line. The fit is done on ``bytes / median(bytes)`` and ``seconds /
   median(seconds)``, so both are O(1) and the solver converges; the coefficients are scaled back.
   The intercept (latency) is clamped to >= 0 by refitting through the origin, and the slope must be
   > 0. When the slope cannot be resolved - all requests about the same size, or so small that
   their time is all latency (a fitted slope less than 3 robust standard errors above 0) - the
   bandwidth is reported as a *lower bound* (``method="bandwidth_lower_bound"``): the larger of the
   95th percentile of per-request throughput ``bytes / seconds`` (``seconds >= bytes / bandwidth``
   for every request when the latency is >= 0) and ``1 / (slope + 3 se)`` (the bandwidths the data
   still exclude); the latency is the median of what is left of each request's time.
2. ``calibrations`` - ``zinf bench-io`` results (sustained GB/s per op and setting). Used for the
   ``nvme`` tier when a (tier, op) has fewer than :data:`MIN_SAMPLES` samples: the median GB/s of
   the rows of zinf's own I/O path (not the fio/dd raw baselines) from the newest bench-io run of
   the swap directory's disk, or of the rows of the one setting asked for. bench-io measures
   throughput on large transfers and says nothing about per-request latency, so the latency is the
   median of ``seconds - bytes / bandwidth`` over whatever few samples there are, and 0 (an
   optimistic value, said so in ``note``) when there are none. bench-io's GB/s is the aggregate of
   all its threads, so it is also optimistic for one request among several in flight.
3. Neither: :class:`CostModelError`, naming the (tier, op), what was found, and the fix.

Concurrency: the samples are per request, timed from the start of the request to its end, while
other requests (prefetch, the optimizer's read/write pipeline, a synchronous read on the training
thread) may be in flight. Each sample carries its ``concurrency``: the mean number of requests in
flight on the disk while it ran, itself included (:mod:`zinf.storage.inflight`). The model is then

    seconds = latency_s + nbytes / bandwidth_Bps + (concurrency - 1) * nbytes * shared_s_per_byte

fitted in two stages: ``shared_s_per_byte`` - what each other request in flight adds per byte - by a
Huber regression of seconds on ``nbytes * (concurrency - 1)`` (and ``nbytes`` where the sizes
vary), kept only when it is >= 0 and 3 robust standard errors above 0; then latency and bandwidth
as below from the times with the sharing taken out (each request "alone"). So ``bandwidth_Bps`` is
a request's bandwidth when it has the disk to itself, and :meth:`TierCost.seconds` predicts a
request at any concurrency (by default the samples' median, :attr:`TierCost.concurrency`). On this
development VM a synchronous write alone runs at ~3.5 GB/s and one of two in flight at ~1.6 GB/s;
without the concurrency term a placement that writes synchronously is over-charged 2x. Samples
without a concurrency (profiles recorded before it was measured) are fitted as before: the
bandwidth is then the per-request one under the run's own concurrency. Fitting per
:class:`IOSetting` keeps runs with different settings apart.

Units: seconds (``_s``), bytes (``_bytes``), bytes per second (``_Bps``), 10^9 bytes per second
(``_GBps``, as in :mod:`profiler.queries`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Iterable

import numpy as np
import pandas as pd
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import HuberRegressor

from zinf.errors import ZinfError

from profiler import queries  # the layer below: read through its public functions only

__all__ = [
    "CostModel",
    "TierCost",
    "IOSetting",
    "CostModelError",
    "fit_latency_bandwidth",
    "MIN_SAMPLES",
    "MAX_SAMPLES_PER_GROUP",
    "FIX_HINT",
]

MIN_SAMPLES = 8
"""Samples of one (tier, op) (or one setting of it) needed to fit it from ``io_samples``."""

MAX_SAMPLES_PER_GROUP = 20_000
"""A model keeps (and fits) at most this many of the newest samples per (tier, op), across refits."""

MIN_SIZE_RATIO = 2.0
"""The slope is fitted only when the largest request is at least this many times the smallest."""

HUBER_EPSILON = 1.35
"""HuberRegressor's epsilon: residuals beyond 1.35 robust standard deviations count linearly
(scikit-learn's default; 95% efficiency on Gaussian noise)."""

SLOPE_MIN_T = 3.0
"""The fitted slope must be this many (robust) standard errors above 0 for the bandwidth to count as measured."""

THROUGHPUT_QUANTILE = 0.95
"""Quantile of per-request throughput taken as the bandwidth lower bound when the slope is not identifiable."""

FIX_HINT = "run `zinf bench-io --path DIR` or train a few steps with profiling on"

SETTING_COLUMNS = ("o_direct", "block_size", "queue_depth", "thread_count")
SAMPLE_COLUMNS = ("tier", "op", "bytes", "seconds")
FRAME_COLUMNS = ["tier", "op", "pooled", *SETTING_COLUMNS, "latency_s", "bandwidth_GBps", "shared_s_per_byte", "concurrency", "n_samples",
                 "source", "method", "bytes_min", "bytes_max", "note"]


class CostModelError(ZinfError):
    """No I/O samples and no calibrations to build the cost of a tier from (or unusable input)."""


# ------------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class IOSetting:
    """The I/O settings a sample was taken with (None where the sample does not say)."""

    o_direct: bool | None = None
    """Whether the file was opened with O_DIRECT (page cache bypassed)."""
    block_size: int | None = None
    """Bytes per I/O request the backend splits a file transfer into."""
    queue_depth: int | None = None
    """Requests in flight per thread."""
    thread_count: int | None = None
    """I/O threads."""

    @classmethod
    def from_row(cls, row) -> "IOSetting":
        def get(name, conv):
            v = row.get(name) if hasattr(row, "get") else getattr(row, name, None)
            return None if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA else conv(v)

        return cls(get("o_direct", bool), get("block_size", int), get("queue_depth", int), get("thread_count", int))

    def matches(self, other: "IOSetting") -> bool:
        """Whether every field set in both agrees (None matches anything)."""
        return all(a is None or b is None or a == b for a, b in zip(self.astuple(), other.astuple()))

    def astuple(self) -> tuple:
        return (self.o_direct, self.block_size, self.queue_depth, self.thread_count)


@dataclass(frozen=True)
class TierCost:
    """The fitted cost of one (tier, op): ``seconds(nbytes) = latency_s + nbytes / bandwidth_Bps``."""

    tier: str
    """"nvme", "cpu" or "gpu"."""
    op: str
    """"read" or "write"."""
    latency_s: float
    """Fixed seconds per request (>= 0)."""
    bandwidth_Bps: float
    """Bytes per second once a request is under way (> 0); a lower bound when ``method`` says so."""
    n_samples: int
    """Rows of ``source`` the numbers come from."""
    source: str
    """"io_samples" or "calibrations"."""
    method: str
    """"huber", "huber_through_origin" (intercept would have been < 0), "bandwidth_lower_bound"
    (slope not identifiable from the sizes seen), "calibration_median"."""
    setting: IOSetting | None = None
    """The I/O setting this cost is for; None when pooled over every setting of the (tier, op)."""
    bytes_min: int | None = None
    """Smallest request the fit saw (predictions outside [bytes_min, bytes_max] are extrapolated)."""
    bytes_max: int | None = None
    """Largest request the fit saw."""
    note: str = ""
    """How the numbers were derived, where that is not obvious from ``method``."""
    shared_s_per_byte: float = 0.0
    """Seconds per byte each *other* request in flight adds to a request (the disk's sharing);
    0 when the samples do not resolve it (or carry no concurrency)."""
    concurrency: float = 1.0
    """Median requests in flight (itself included) over the samples: the default of :meth:`seconds`."""

    def seconds(self, nbytes: float, concurrency: float | None = None) -> float:
        """Predicted seconds of one request of ``nbytes`` bytes with ``concurrency`` requests in
        flight, itself included (default: the samples' median)."""
        return self.latency_s + float(nbytes) * self.s_per_byte(concurrency)

    def s_per_byte(self, concurrency: float | None = None) -> float:
        """Seconds per byte of a request with ``concurrency`` requests in flight (default: the samples' median)."""
        c = self.concurrency if concurrency is None else float(concurrency)
        return 1.0 / self.bandwidth_Bps + max(0.0, c - 1.0) * self.shared_s_per_byte

    @property
    def bandwidth_GBps(self) -> float:
        return self.bandwidth_Bps / 1e9


# -------------------------------------------------------------------------------- the fitting
def fit_latency_bandwidth(nbytes: Iterable[float], seconds: Iterable[float]) -> tuple[float, float, str]:
    """Fit ``seconds = latency_s + nbytes / bandwidth_Bps`` robustly; returns
    ``(latency_s, bandwidth_Bps, method)`` with latency >= 0 and bandwidth > 0.

    ``method`` is "huber", "huber_through_origin" or "bandwidth_lower_bound" (see the module
    docstring). Needs at least two samples with positive bytes and seconds.
    """
    b = np.fromiter(nbytes, dtype=np.float64)
    s = np.fromiter(seconds, dtype=np.float64)
    if b.shape != s.shape:
        raise CostModelError(f"{b.size} byte counts but {s.size} durations; pass one of each per I/O sample")
    keep = np.isfinite(b) & np.isfinite(s) & (b > 0) & (s > 0)
    b, s = b[keep], s[keep]
    if b.size < 2:
        raise CostModelError(f"cannot fit latency and bandwidth from {b.size} usable sample(s) (need >= 2 with bytes > 0 and seconds > 0)")
    # Throughput bound, valid whatever the sizes: latency >= 0 means seconds >= bytes / bandwidth.
    bandwidth_bound_Bps = float(np.quantile(b / s, THROUGHPUT_QUANTILE))
    if b.max() >= MIN_SIZE_RATIO * b.min():
        scale_b, scale_s = float(np.median(b)), float(np.median(s))
        x, y = b / scale_b, s / scale_s
        slope, intercept = _huber(x, y, fit_intercept=True)
        method = "huber"
        if slope > 0 and intercept < 0:
            slope, intercept = _huber(x, y, fit_intercept=False)
            method = "huber_through_origin"
        se = _slope_standard_error(x, y, slope, intercept, through_origin=method == "huber_through_origin")
        if slope > 0 and slope >= SLOPE_MIN_T * se:
            return max(0.0, intercept * scale_s), scale_b / (slope * scale_s), method
        # Unresolved: the data still exclude slopes above slope + 3 se, i.e. bandwidths below this.
        slope_upper = slope + SLOPE_MIN_T * se
        if math.isfinite(slope_upper) and slope_upper > 0:
            bandwidth_bound_Bps = max(bandwidth_bound_Bps, scale_b / (slope_upper * scale_s))
    latency_s = max(0.0, float(np.median(s - b / bandwidth_bound_Bps)))
    return latency_s, bandwidth_bound_Bps, "bandwidth_lower_bound"


def _slope_standard_error(x: np.ndarray, y: np.ndarray, slope: float, intercept: float, *, through_origin: bool) -> float:
    """A robust standard error of the fitted slope of ``y = intercept + slope x``: see
    :func:`_robust_standard_error`."""
    return _robust_standard_error(y - (intercept + slope * x), x, through_origin=through_origin)


def _robust_standard_error(residuals: np.ndarray, x: np.ndarray, *, through_origin: bool = False) -> float:
    """A robust standard error of a fitted coefficient of feature ``x``: least squares' ``sigma /
    sqrt(sum((x - mean x)^2))`` (``sum(x^2)`` through the origin) with ``sigma`` from the MAD of the
    fit's residuals, so the outliers the Huber loss discounted do not inflate it. ``inf`` when x
    does not vary."""
    sigma = 1.4826 * float(np.median(np.abs(residuals - np.median(residuals))))
    spread = float(np.sum(x**2) if through_origin else np.sum((x - x.mean()) ** 2))
    if spread <= 0:
        return math.inf
    return sigma / math.sqrt(spread)


def _huber(x: np.ndarray, y: np.ndarray, *, fit_intercept: bool) -> tuple[float, float]:
    """(slope, intercept) of a Huber fit of y on x (both 1-D, scaled to O(1))."""
    model = HuberRegressor(epsilon=HUBER_EPSILON, alpha=0.0, fit_intercept=fit_intercept, max_iter=1000)
    with warnings.catch_warnings():
        # L-BFGS may stop at max_iter on pathological data; the clamps below still apply
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x[:, None], y)
    return float(model.coef_[0]), float(model.intercept_) if fit_intercept else 0.0


SHARING_MIN_SPREAD = 0.25
"""The samples' concurrency must span at least this much (5th to 95th percentile) for the sharing
term to be fitted: with every request at about the same concurrency it cannot be told from bandwidth."""


def fit_sharing(nbytes: np.ndarray, seconds: np.ndarray, concurrency: np.ndarray) -> tuple[float, np.ndarray, str]:
    """Stage one of the fit (module docstring): ``(shared_s_per_byte, seconds alone, note)``.

    ``shared_s_per_byte`` is the slope of seconds on ``nbytes * (concurrency - 1)`` (with ``nbytes``
    as a second feature where the sizes vary, so a size effect is not mistaken for sharing); it is
    0 unless the samples carry concurrencies that vary, the slope is positive and 3 robust standard
    errors above 0. "Seconds alone" are the samples' times less the sharing.
    """
    b = np.asarray(nbytes, dtype=np.float64)
    s = np.asarray(seconds, dtype=np.float64)
    c = np.asarray(concurrency, dtype=np.float64)
    measured = np.isfinite(c) & np.isfinite(b) & np.isfinite(s) & (b > 0) & (s > 0)
    if measured.sum() < MIN_SAMPLES:
        return 0.0, s, "" if not np.isfinite(c).any() else "too few samples with a concurrency to fit sharing"
    b_m, s_m, c_m = b[measured], s[measured], np.maximum(c[measured], 1.0)
    lo, hi = np.quantile(c_m, [0.05, 0.95])
    if hi - lo < SHARING_MIN_SPREAD:
        return 0.0, s, f"concurrency {np.median(c_m):.2f} in every sample: sharing not resolved"
    scale_b, scale_s = float(np.median(b_m)), float(np.median(s_m))
    shared_x = b_m * (c_m - 1.0) / scale_b
    y = s_m / scale_s
    sizes_vary = b_m.max() >= MIN_SIZE_RATIO * b_m.min()
    x = np.column_stack([shared_x, b_m / scale_b]) if sizes_vary else shared_x[:, None]
    model = HuberRegressor(epsilon=HUBER_EPSILON, alpha=0.0, fit_intercept=True, max_iter=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x, y)
    slope = float(model.coef_[0])
    se = _robust_standard_error(y - model.predict(x), shared_x)
    if not (slope > 0 and slope >= SLOPE_MIN_T * se):
        return 0.0, s, f"sharing not significant (slope {slope:.3g} +- {se:.2g}, scaled)"
    shared = slope * scale_s / scale_b
    alone = s - shared * b * np.where(np.isfinite(c), np.maximum(c, 1.0) - 1.0, 0.0)
    # a sample cannot take less than nothing: keep the fitted "alone" times positive
    alone = np.maximum(alone, 1e-3 * s)
    return shared, alone, f"sharing fitted from {int(measured.sum())} samples at concurrency {lo:.2f}-{hi:.2f}"


# ------------------------------------------------------------------------------- the model
class CostModel:
    """Fitted costs per (tier, op) and per I/O setting, plus the samples they came from.

    Build it with :meth:`fit` (DataFrames) or :meth:`from_db` (a profile database); ask it with
    :meth:`cost` / :meth:`predict_s`; update it with :meth:`refit` as new samples arrive.
    """

    def __init__(self, costs: dict[tuple[str, str, IOSetting | None], TierCost], samples: pd.DataFrame,
                 calibrations: pd.DataFrame | None, missing: dict[tuple[str, str], str],
                 max_samples_per_group: int = MAX_SAMPLES_PER_GROUP):
        self._costs = costs
        self.samples = samples
        """The accumulated I/O samples the model was fitted from (capped per (tier, op))."""
        self.calibrations = calibrations
        """The calibration rows considered (None when none were given)."""
        self._missing = missing
        self.max_samples_per_group = max_samples_per_group

    # -- building ------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples_df: pd.DataFrame | None, calibrations_df: pd.DataFrame | None = None, *,
            max_samples_per_group: int = MAX_SAMPLES_PER_GROUP) -> "CostModel":
        """Fit from I/O samples (columns ``tier, op, bytes, seconds`` and optionally ``o_direct,
        block_size, queue_depth, thread_count``, as :func:`profiler.queries.io_samples` returns)
        and, for (tier, op)s with too few samples, calibration rows (``op, GBps`` and optionally
        ``bytes, block_size, queue_depth, thread_count``, as :func:`profiler.queries.calibrations`).

        Raises :class:`CostModelError` when neither gives any cost at all.
        """
        samples = _clean_samples(samples_df)
        samples = _cap(samples, max_samples_per_group)
        cal = _clean_calibrations(calibrations_df)
        costs: dict[tuple[str, str, IOSetting | None], TierCost] = {}
        missing: dict[tuple[str, str], str] = {}

        pairs = set(map(tuple, samples[["tier", "op"]].drop_duplicates().to_numpy())) if len(samples) else set()
        if cal is not None and len(cal):
            pairs |= {("nvme", op) for op in cal["op"].unique()}
        for tier, op in sorted(pairs):
            group = samples[(samples["tier"] == tier) & (samples["op"] == op)]
            pooled = _fit_group(tier, op, group, None, cal)
            if pooled is None:
                missing[(tier, op)] = _missing_reason(tier, op, len(group), cal)
                continue
            costs[(tier, op, None)] = pooled
            fitted_from_samples: list[IOSetting] = []
            for setting, part in _by_setting(group):
                if len(part) == len(group) and pooled.source == "io_samples":
                    fitted = replace(pooled, setting=setting)  # one setting only: the pooled fit is its fit
                else:
                    fitted = _fit_group(tier, op, part, setting, cal)
                if fitted is not None:
                    costs[(tier, op, setting)] = fitted
                    if fitted.source == "io_samples":
                        fitted_from_samples.append(setting)
            # settings only bench-io measured (or measured better than the few samples of them)
            for setting in _calibration_settings(tier, op, cal):
                if (tier, op, setting) in costs or any(setting.matches(s) for s in fitted_from_samples):
                    continue
                few = group[[setting.matches(IOSetting.from_row(r)) for r in group.to_dict("records")]] if len(group) else group
                fitted = _from_calibrations(tier, op, few, setting, cal)
                if fitted is not None:
                    costs[(tier, op, setting)] = fitted
        if not costs:
            n = len(samples)
            raise CostModelError(
                f"no I/O cost model can be built: {n} usable io_samples (need {MIN_SAMPLES} per tier and op) "
                f"and {0 if cal is None else len(cal)} calibrations rows; {FIX_HINT}"
            )
        return cls(costs, samples, cal, missing, max_samples_per_group)

    @classmethod
    def from_db(cls, url, run_id: int | None = None, *, calibration_path: str | None = None,
                max_samples_per_group: int = MAX_SAMPLES_PER_GROUP, first_step: int | None = None,
                last_step: int | None = None) -> "CostModel":
        """Fit from a profile database: the I/O samples of ``run_id`` (default: the newest run, or
        none when no run is recorded; from ``first_step`` on and up to ``last_step``, when given)
        and the calibrations of the run's swap disk.

        Calibrations are those whose ``path`` is ``calibration_path`` or, by default, the run's
        swap directory or a folder above it; when none match, every calibration row is used and
        each derived cost's ``note`` says so.
        """
        if run_id is None:
            run_id = queries.latest_run_id(url)
        samples = queries.io_samples(url, run_id, first_step=first_step, last_step=last_step) if run_id is not None else None
        swap_dir = queries.run_info(url, run_id).get("swap_dir") if run_id is not None else None
        cal = queries.calibrations(url)
        cal = _calibrations_for(cal, calibration_path or swap_dir)
        return cls.fit(samples, cal, max_samples_per_group=max_samples_per_group)

    def refit(self, new_samples_df: pd.DataFrame) -> "CostModel":
        """A new model fitted from the accumulated samples plus ``new_samples_df`` (the newest
        :attr:`max_samples_per_group` per (tier, op) kept) and the same calibrations."""
        new = _clean_samples(new_samples_df)
        both = pd.concat([self.samples, new], ignore_index=True) if len(new) else self.samples
        return type(self).fit(both, self.calibrations, max_samples_per_group=self.max_samples_per_group)

    # -- asking --------------------------------------------------------------------------
    def cost(self, tier: str, op: str, setting: IOSetting | None = None) -> TierCost:
        """The cost of ``op`` on ``tier``: for ``setting`` when it was fitted (fields left None
        match anything; the most samples wins), else pooled over every setting of the (tier, op)
        (check ``.setting`` of the result to tell). Raises :class:`CostModelError` when the (tier,
        op) has neither enough samples nor calibrations."""
        if setting is not None:
            candidates = [c for (t, o, s), c in self._costs.items() if t == tier and o == op and s is not None and s.matches(setting)]
            if candidates:  # measured in training beats bench-io; then the better-sampled one
                return max(candidates, key=lambda c: (c.source == "io_samples", c.n_samples))
        found = self._costs.get((tier, op, None))
        if found is None:
            reason = self._missing.get((tier, op)) or _missing_reason(tier, op, 0, self.calibrations)
            raise CostModelError(reason)
        return found

    def predict_s(self, tier: str, op: str, nbytes, setting: IOSetting | None = None, concurrency: float | None = None):
        """Predicted seconds of one request of ``nbytes`` (a number, or an array of them: then an
        array) with ``concurrency`` requests in flight, itself included (default: as in the samples)."""
        c = self.cost(tier, op, setting)
        if np.ndim(nbytes) == 0:
            return c.seconds(float(nbytes), concurrency)
        return c.latency_s + np.asarray(nbytes, dtype=np.float64) * c.s_per_byte(concurrency)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """The (tier, op)s that have a pooled cost."""
        return sorted((t, o) for (t, o, s) in self._costs if s is None)

    def costs(self) -> list[TierCost]:
        """Every fitted cost, pooled first, then per setting."""
        return sorted(self._costs.values(), key=lambda c: (c.tier, c.op, c.setting is not None, str(c.setting)))

    def to_frame(self) -> pd.DataFrame:
        """One row per fitted cost: ``tier, op, pooled, o_direct, block_size, queue_depth,
        thread_count, latency_s, bandwidth_GBps, shared_s_per_byte, concurrency, n_samples, source, method,
        bytes_min, bytes_max, note``."""
        rows = []
        for c in self.costs():
            s = c.setting or IOSetting()
            rows.append({
                "tier": c.tier, "op": c.op, "pooled": c.setting is None,
                "o_direct": s.o_direct, "block_size": s.block_size, "queue_depth": s.queue_depth, "thread_count": s.thread_count,
                "latency_s": c.latency_s, "bandwidth_GBps": c.bandwidth_GBps, "shared_s_per_byte": c.shared_s_per_byte,
                "concurrency": c.concurrency, "n_samples": c.n_samples,
                "source": c.source, "method": c.method, "bytes_min": c.bytes_min, "bytes_max": c.bytes_max, "note": c.note,
            })
        df = pd.DataFrame(rows, columns=FRAME_COLUMNS)
        for c in ("block_size", "queue_depth", "thread_count", "bytes_min", "bytes_max"):
            df[c] = df[c].astype("Int64")
        df["o_direct"] = df["o_direct"].astype("boolean")
        return df

    def __repr__(self) -> str:
        parts = [f"{c.tier}/{c.op}: {c.latency_s * 1e3:.3g} ms + B / {c.bandwidth_GBps:.3g} GB/s ({c.source}, n={c.n_samples})"
                 for c in self.costs() if c.setting is None]
        return "CostModel(" + "; ".join(parts) + ")"


# -------------------------------------------------------------------------------- helpers
def _clean_samples(df: pd.DataFrame | None) -> pd.DataFrame:
    """The usable samples (bytes > 0, seconds > 0) with the columns the fit needs."""
    cols = [*SAMPLE_COLUMNS, *SETTING_COLUMNS, "concurrency"]
    if df is None or len(df) == 0:
        return pd.DataFrame({c: pd.Series(dtype="object") for c in cols})
    lacking = [c for c in SAMPLE_COLUMNS if c not in df.columns]
    if lacking:
        raise CostModelError(f"I/O samples frame lacks column(s) {', '.join(lacking)}; pass profiler.queries.io_samples(url, run_id)")
    out = df[[c for c in cols if c in df.columns]].copy()
    for c in SETTING_COLUMNS:
        if c not in out.columns:
            out[c] = None
    out["concurrency"] = pd.to_numeric(out["concurrency"], errors="coerce") if "concurrency" in out.columns else np.nan
    out["bytes"] = pd.to_numeric(out["bytes"], errors="coerce")
    out["seconds"] = pd.to_numeric(out["seconds"], errors="coerce")
    out = out[(out["bytes"] > 0) & (out["seconds"] > 0) & np.isfinite(out["seconds"])]
    return out[cols].reset_index(drop=True)


def _cap(samples: pd.DataFrame, per_group: int) -> pd.DataFrame:
    """The newest (last) ``per_group`` rows of each (tier, op)."""
    if len(samples) == 0:
        return samples
    return samples.groupby(["tier", "op"], sort=False, group_keys=False).tail(per_group).reset_index(drop=True)


def _clean_calibrations(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """The calibration rows that describe zinf's own I/O path, keeping ``attrs`` (see
    :func:`_calibrations_for`):

    * rows with ``GBps > 0``;
    * not bench-io's raw baselines (``source`` "bench-io/<tool>" other than "bench-io/zinf": they
      measure the disk with fio/dd, not zinf's store);
    * of each ``path``, only the newest bench-io run (its ``created_at``), so an old disk or old
      settings do not vote.

    ``o_direct`` is decoded from ``source`` as bench-io stores it ("/buffered" appended without
    O_DIRECT) unless the frame has the column; ``block_size_bytes`` (``load_calibrations``'s name)
    is accepted for ``block_size``.
    """
    if df is None:
        return None
    if len(df) == 0:
        return df.iloc[0:0]
    if "op" not in df.columns or "GBps" not in df.columns:
        raise CostModelError("calibrations frame lacks column op or GBps; pass profiler.queries.calibrations(url)")
    out = df.copy()
    if "block_size" not in out.columns and "block_size_bytes" in out.columns:
        out["block_size"] = out["block_size_bytes"]
    for c in ("block_size", "queue_depth", "thread_count", "bytes", "path", "source", "created_at"):
        if c not in out.columns:
            out[c] = None
    out["GBps"] = pd.to_numeric(out["GBps"], errors="coerce")
    source = out["source"].fillna("").astype(str)
    bench = source.str.startswith("bench-io/")
    tool = source.str.removeprefix("bench-io/").str.removesuffix("/buffered")
    if "o_direct" not in out.columns:
        out["o_direct"] = pd.Series(~source.str.endswith("/buffered"), dtype="object").where(bench, None)
    keep = (out["GBps"] > 0) & ~(bench & (tool != "zinf"))
    out = out[keep]
    if out["created_at"].notna().any():
        newest = out.groupby(out["path"].astype(str))["created_at"].transform("max")
        out = out[out["created_at"].isna() | (out["created_at"] == newest)]
    out = out.reset_index(drop=True)
    out.attrs = dict(df.attrs)
    return out


def _calibrations_for(cal: pd.DataFrame, path: str | None) -> pd.DataFrame:
    """The calibration rows of ``path`` or a folder above it; all rows (marked) when none match."""
    if cal is None or len(cal) == 0 or path is None:
        return cal
    target = PurePosixPath(str(path))

    def covers(p) -> bool:
        try:
            return target == PurePosixPath(str(p)) or target.is_relative_to(PurePosixPath(str(p)))
        except (TypeError, ValueError):
            return False

    mine = cal[cal["path"].map(covers)]
    if len(mine):
        return mine.reset_index(drop=True)
    out = cal.copy()
    out.attrs["foreign_path"] = str(path)
    return out


def _by_setting(group: pd.DataFrame):
    """(IOSetting, rows) for each distinct setting of a group of samples."""
    if len(group) == 0:
        return []
    keys = group[list(SETTING_COLUMNS)].astype("object").where(group[list(SETTING_COLUMNS)].notna(), None)
    out = []
    for values, idx in keys.groupby(list(SETTING_COLUMNS), dropna=False, sort=True).groups.items():
        setting = IOSetting.from_row(dict(zip(SETTING_COLUMNS, values)))
        out.append((setting, group.loc[idx]))
    return out


def _calibration_settings(tier: str, op: str, cal: pd.DataFrame | None) -> list[IOSetting]:
    """The distinct settings of the calibration rows of ``op`` (the nvme tier only)."""
    if tier != "nvme" or cal is None or len(cal) == 0:
        return []
    rows = cal[cal["op"] == op]
    return sorted({IOSetting.from_row(r) for r in rows.to_dict("records")}, key=str)


def _fit_group(tier: str, op: str, group: pd.DataFrame, setting: IOSetting | None, cal: pd.DataFrame | None) -> TierCost | None:
    """The cost of one group of samples: from the samples when there are enough, else from the
    calibrations (nvme only); None when neither suffices."""
    b = group["bytes"].to_numpy(np.float64)
    s = group["seconds"].to_numpy(np.float64)
    if len(group) >= MIN_SAMPLES:
        c = pd.to_numeric(group["concurrency"], errors="coerce").to_numpy(np.float64)
        shared, alone_s, note = fit_sharing(b, s, c)
        latency_s, bandwidth_Bps, method = fit_latency_bandwidth(b, alone_s)
        measured = np.isfinite(c)
        typical = float(np.median(np.maximum(c[measured], 1.0))) if measured.any() else 1.0
        return TierCost(tier, op, latency_s, bandwidth_Bps, len(group), "io_samples", method, setting,
                        int(b.min()), int(b.max()), note, shared, typical)
    return _from_calibrations(tier, op, group, setting, cal)


def _from_calibrations(tier: str, op: str, group: pd.DataFrame, setting: IOSetting | None, cal: pd.DataFrame | None) -> TierCost | None:
    """The cost from the calibration rows of ``op`` (matching ``setting``), the latency from the few
    samples in ``group`` when there are any; None when no row matches."""
    if tier != "nvme" or cal is None or len(cal) == 0:
        return None
    b = group["bytes"].to_numpy(np.float64)
    s = group["seconds"].to_numpy(np.float64)
    rows = cal[cal["op"] == op]
    if setting is not None:
        rows = rows[[setting.matches(IOSetting.from_row(r)) for r in rows.to_dict("records")]]
    if len(rows) == 0:
        return None
    bandwidth_Bps = float(rows["GBps"].median()) * 1e9
    notes = [f"median of {len(rows)} bench-io row(s)"]
    if len(group):
        latency_s = max(0.0, float(np.median(s - b / bandwidth_Bps)))
        notes.append(f"latency from {len(group)} io_sample(s)")
    else:
        latency_s = 0.0
        notes.append("latency unknown (bench-io measures throughput only), taken as 0")
    if cal.attrs.get("foreign_path"):
        notes.append(f"no calibration of {cal.attrs['foreign_path']}: rows of other paths used")
    sizes = pd.to_numeric(rows["bytes"], errors="coerce").dropna()
    return TierCost(tier, op, latency_s, bandwidth_Bps, len(rows), "calibrations", "calibration_median", setting,
                    int(sizes.min()) if len(sizes) else None, int(sizes.max()) if len(sizes) else None, "; ".join(notes))


def _missing_reason(tier: str, op: str, n_samples: int, cal: pd.DataFrame | None) -> str:
    if tier != "nvme":
        where = "calibrations cover the nvme tier only"
    elif cal is None or len(cal) == 0:
        where = "no calibrations rows"
    else:
        where = f"no calibrations rows for op {op!r}"
    return (f"no I/O cost for tier {tier!r} op {op!r}: {n_samples} io_samples (need {MIN_SAMPLES}) and {where}; {FIX_HINT}")
