"""The zinf configuration: a DeepSpeed-compatible JSON config, validated by small pydantic models.

One model per component, each field documented by the docstring under it (what it does, and its
unit). The layout is DeepSpeed's, plus one ``"zinf"`` section for what DeepSpeed has no key for::

    {
      "train_batch_size": 1024,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "bf16": {"enabled": true},
      "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme",
                          "module_parameters": {"encoder.layer[0-2]": {"device": "cpu"}}},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}
      },
      "aio": {"block_size": 1048576, "queue_depth": 32, "thread_count": 4},
      "zinf": {"dram_budget": "64GiB", "placement": {"policy": "adaptive"}}
    }

:func:`load_config` is the one entry point. Whatever is wrong with the input, it raises a single
:class:`~zinf.errors.ConfigError` whose message names the dotted key path (and, for a misspelt key,
the closest valid one); a pydantic ``ValidationError`` never escapes it.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import types
import warnings
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from zinf.errors import ConfigError

__all__ = [
    "AioConfig",
    "AutotuneConfig",
    "Config",
    "ConfigError",
    "Device",
    "FP16Config",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "OptimizerParams",
    "PinConfig",
    "PlacementConfig",
    "PrecisionConfig",
    "ProfilerConfig",
    "Size",
    "ZeroConfig",
    "ZinfConfig",
    "ZinfConfigWarning",
    "load_config",
    "parse_size",
]


class ZinfConfigWarning(UserWarning):
    """The config is valid but some of it does nothing in zinf (e.g. multi-GPU DeepSpeed keys)."""


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_UNITS = {
    "": 1, "b": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_AMBIGUOUS_UNITS = {"k": "KiB", "m": "MiB", "g": "GiB", "t": "TiB",
                    "ki": "KiB", "mi": "MiB", "gi": "GiB", "ti": "TiB"}
_SIZE_RE = re.compile(r"(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*(?P<unit>[a-z]*)", re.I)
_SIZE_EXAMPLE = "a whole number, or a string such as '16GiB', '512MiB', '4KiB' or '2GB'"


def parse_size(value: Any) -> int:
    """Turn ``value`` into a non-negative whole number (of bytes, or of elements where a field says so).

    Accepts an int, a float with an integral value (``1e8``), or a string: a number with an
    optional unit, case-insensitive, optional space: ``"16GiB"``, ``"512 MiB"``, ``"1.5GiB"``,
    ``"2GB"``, ``"100"``. KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000.
    Raises :class:`ConfigError` naming the value otherwise.
    """
    if isinstance(value, bool):
        raise ConfigError(f"invalid size {value!r}: expected {_SIZE_EXAMPLE}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"invalid size {value!r}: must not be negative (expected {_SIZE_EXAMPLE})")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ConfigError(f"invalid size {value!r}: not a whole number (expected {_SIZE_EXAMPLE})")
        if value < 0:
            raise ConfigError(f"invalid size {value!r}: must not be negative (expected {_SIZE_EXAMPLE})")
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("-"):
            raise ConfigError(f"invalid size {value!r}: must not be negative (expected {_SIZE_EXAMPLE})")
        match = _SIZE_RE.fullmatch(text)
        if match is None:
            raise ConfigError(f"invalid size {value!r}: expected {_SIZE_EXAMPLE}")
        unit = match["unit"].lower()
        if unit in _AMBIGUOUS_UNITS:
            binary = _AMBIGUOUS_UNITS[unit]
            raise ConfigError(
                f"invalid size {value!r}: unit {match['unit']!r} is ambiguous; write "
                f"{binary!r} (powers of 1024) or {binary[0] + 'B'!r} (powers of 1000)"
            )
        if unit not in _UNITS:
            raise ConfigError(
                f"invalid size {value!r}: unknown unit {match['unit']!r} "
                "(use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
            )
        try:
            amount = Decimal(match["num"]) * _UNITS[unit]
        except InvalidOperation:  # pragma: no cover - the regex admits only decimal numbers
            raise ConfigError(f"invalid size {value!r}: expected {_SIZE_EXAMPLE}") from None
        if amount != amount.to_integral_value():
            raise ConfigError(
                f"invalid size {value!r}: does not come to a whole number ({amount}); "
                f"expected {_SIZE_EXAMPLE}"
            )
        return int(amount)
    raise ConfigError(f"invalid size {value!r}: expected {_SIZE_EXAMPLE}")


Size = Annotated[int, BeforeValidator(parse_size)]
"""A non-negative whole number given as an int, an integral float (``1e8``) or a string ``"16GiB"``."""

Device = Literal["none", "cpu", "nvme"]
"""Where an offloaded tensor class lives: "none" = not offloaded (stays on the compute device)."""


# --------------------------------------------------------------------------------------------
# Shared helpers for the models
# --------------------------------------------------------------------------------------------


def _fail(message: str) -> PydanticCustomError:
    """An error pydantic reports with ``message`` verbatim (``load_config`` adds the key path)."""
    return PydanticCustomError("zinf_config", "{message}", {"message": message})


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _path(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():
        raise _fail("must be a non-empty path")
    if isinstance(value, (str, os.PathLike)):
        return Path(value).expanduser()
    return value


def _merge_alias(data: Any, name: str, alias: str, *, equal_ok: bool) -> Any:
    """Refuse ``name`` and its alias ``alias`` given together (unless equal and ``equal_ok``)."""
    if isinstance(data, Mapping) and name in data and alias in data:
        if equal_ok and data[name] == data[alias]:
            return {k: v for k, v in data.items() if k != alias}
        raise _fail(f"give either {name!r} or its alias {alias!r}, not both")
    return data


LowerDevice = Annotated[Device, BeforeValidator(_lower)]
OptionalPath = Annotated[Path | None, BeforeValidator(_path)]


class _Section(BaseModel):
    """Base of every config model: unknown keys are errors; fields may be given by name or alias."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_attribute_docstrings=True)


# --------------------------------------------------------------------------------------------
# Per-module placement pins
# --------------------------------------------------------------------------------------------


class PinConfig(_Section):
    """One value of ``module_parameters``: the tier that the matched modules' tensors are pinned to.

    May also be given as a bare string: ``{"encoder.layer[0-2]": "cpu"}``.
    """

    device: Annotated[Literal["none", "gpu", "cpu", "nvme"], BeforeValidator(_lower)]
    """Tier: "gpu" (or "none", DeepSpeed's word for not offloaded) = the compute device; "cpu" =
    DRAM; "nvme" = the swap files. "none" is normalised to "gpu"."""

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        return {"device": data} if isinstance(data, str) else data

    @field_validator("device")
    @classmethod
    def _none_is_gpu(cls, value: str) -> str:
        return "gpu" if value == "none" else value


PinMap = dict[str, PinConfig]


def _check_patterns(pins: dict[str, PinConfig]) -> dict[str, PinConfig]:
    from zinf.pins import parse_pattern  # zinf.pins imports this module

    for pattern in pins:
        parse_pattern(pattern)
    return pins


# --------------------------------------------------------------------------------------------
# Asynchronous I/O (DeepSpeed "aio")
# --------------------------------------------------------------------------------------------


class AioConfig(_Section):
    """How the NVMe swapper reads and writes (DeepSpeed's ``"aio"`` section)."""

    block_size: Size = Field(1 * MiB, ge=1)
    """Bytes per I/O request; larger requests are split into blocks of this size."""

    queue_depth: int = Field(8, ge=1)
    """Requests kept in flight per I/O thread."""

    thread_count: int = Field(
        4, ge=1, validation_alias=AliasChoices("thread_count", "intra_op_parallelism")
    )
    """I/O threads that serve one read or write. Also accepted as "intra_op_parallelism" (older
    DeepSpeed name); giving both with different values is an error."""

    single_submit: bool = False
    """Submit requests one at a time instead of in batches."""

    overlap_events: bool = True
    """Submit new requests while earlier ones complete, instead of waiting for a whole batch."""

    use_gds: bool = False
    """Use NVIDIA GPUDirect Storage (NVMe <-> GPU without a DRAM bounce) where available."""

    @model_validator(mode="before")
    @classmethod
    def _one_thread_count(cls, data: Any) -> Any:
        return _merge_alias(data, "thread_count", "intra_op_parallelism", equal_ok=True)


# --------------------------------------------------------------------------------------------
# ZeRO offload ("zero_optimization")
# --------------------------------------------------------------------------------------------


class OffloadParamConfig(_Section):
    """Where parameters live between uses (DeepSpeed's ``"offload_param"``)."""

    device: LowerDevice = "none"
    """"none" keeps parameters on the compute device, "cpu" in DRAM, "nvme" on the swap files
    (the placement planner may still move individual shards, within the budgets)."""

    nvme_path: OptionalPath = None
    """Directory for parameter swap files; unset = ``zinf.nvme_path``."""

    pin_memory: bool = False
    """Use page-locked DRAM for the staging buffers (faster host <-> GPU copies)."""

    buffer_count: int = Field(5, ge=1)
    """Staging buffers for parameters read from NVMe."""

    buffer_size: Size = Field(100_000_000, ge=1)
    """Size of each staging buffer, in elements (DeepSpeed semantics, not bytes)."""

    max_in_cpu: Size = 1_000_000_000
    """Parameter elements kept in DRAM at most when the device is "nvme"."""

    module_parameters: PinMap = Field(default_factory=dict)
    """Per-module pins, ``{"encoder.layer[0-2]": {"device": "cpu"}}``: module-name pattern ->
    tier, overriding the planner for those modules' parameters (see :mod:`zinf.pins`)."""

    @field_validator("module_parameters")
    @classmethod
    def _valid_patterns(cls, pins: PinMap) -> PinMap:
        return _check_patterns(pins)


class OffloadOptimizerConfig(_Section):
    """Where optimizer state (fp32 master weights, moments) lives (DeepSpeed's ``"offload_optimizer"``)."""

    device: LowerDevice = "none"
    """"none" keeps optimizer state on the compute device, "cpu" in DRAM, "nvme" on the swap files."""

    nvme_path: OptionalPath = None
    """Directory for optimizer-state swap files; unset = ``zinf.nvme_path``."""

    pin_memory: bool = False
    """Use page-locked DRAM for the optimizer state's staging buffers."""

    buffer_count: int = Field(4, ge=1)
    """Staging buffers for optimizer state read from NVMe."""

    pipeline_read: bool = True
    """Read the next optimizer group from NVMe while the current one is updated."""

    pipeline_write: bool = True
    """Write the updated optimizer group back to NVMe while the next one is updated."""

    fast_init: bool = False
    """Create the NVMe swap files without writing initial state through the swapper."""

    module_parameters: PinMap = Field(default_factory=dict)
    """Per-module pins for optimizer state, ``{"decoder.*": {"device": "nvme"}}`` (see :mod:`zinf.pins`)."""

    @field_validator("module_parameters")
    @classmethod
    def _valid_patterns(cls, pins: PinMap) -> PinMap:
        return _check_patterns(pins)


class ZeroConfig(_Section):
    """The ``"zero_optimization"`` section. zinf always partitions like ZeRO stage 3 in one process."""

    NO_EFFECT_KEYS: ClassVar[tuple[str, ...]] = (
        "overlap_comm",
        "contiguous_gradients",
        "reduce_bucket_size",
        "reduce_scatter",
        "allgather_partitions",
        "allgather_bucket_size",
        "sub_group_size",
        "stage3_max_live_parameters",
        "stage3_gather_16bit_weights_on_model_save",
        "round_robin_gradients",
        "ignore_unused_parameters",
    )
    """DeepSpeed keys that are accepted but do nothing in a single process."""

    stage: int = Field(3, ge=0, le=3)
    """ZeRO stage (0..3). Offloading parameters needs stage 3, offloading the optimizer stage >= 1."""

    offload_param: OffloadParamConfig = Field(
        default_factory=OffloadParamConfig,
        validation_alias=AliasChoices("offload_param", "offload_params"),
    )
    """Parameter offload. Also accepted as "offload_params" (the seed article's spelling)."""

    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    """Optimizer-state offload."""

    stage3_prefetch_bucket_size: Size = 50_000_000
    """Parameter elements fetched ahead of their use (the prefetch window)."""

    stage3_param_persistence_threshold: Size = 100_000
    """Parameters with fewer elements than this stay on the compute device for the whole run."""

    # -- accepted for DeepSpeed compatibility, no effect in zinf (load_config warns when given) --

    overlap_comm: bool = False
    """No effect in zinf (DeepSpeed: overlap gradient reduction with backward)."""

    contiguous_gradients: bool = True
    """No effect in zinf (DeepSpeed: copy gradients into one contiguous buffer)."""

    reduce_bucket_size: Size = 500_000_000
    """No effect in zinf (DeepSpeed: elements reduced at a time)."""

    reduce_scatter: bool = True
    """No effect in zinf (DeepSpeed: reduce-scatter instead of all-reduce)."""

    allgather_partitions: bool = True
    """No effect in zinf (DeepSpeed: all-gather instead of broadcasts)."""

    allgather_bucket_size: Size = 500_000_000
    """No effect in zinf (DeepSpeed: elements all-gathered at a time)."""

    sub_group_size: Size = 1_000_000_000
    """No effect in zinf (DeepSpeed: elements per optimizer sub-group; zinf's groups are its shards)."""

    stage3_max_live_parameters: Size = 1_000_000_000
    """No effect in zinf (DeepSpeed: elements resident on GPU at most; zinf uses ``gpu_budget``)."""

    stage3_max_reuse_distance: Size = 1_000_000_000
    """Keep a released parameter shard materialised when the trace needs it again within this
    many elements of other fetches (and the prefetch window has room); 0 = always free."""

    stage3_gather_16bit_weights_on_model_save: bool = False
    """No effect in zinf (DeepSpeed: gather 16-bit weights on save; zinf saves shards)."""

    round_robin_gradients: bool = False
    """No effect in zinf (DeepSpeed: round-robin gradient copies across ranks)."""

    ignore_unused_parameters: bool = True
    """No effect in zinf (DeepSpeed: tolerate parameters without gradients)."""

    @model_validator(mode="before")
    @classmethod
    def _one_offload_param(cls, data: Any) -> Any:
        return _merge_alias(data, "offload_param", "offload_params", equal_ok=False)

    @model_validator(mode="after")
    def _offload_needs_stage(self) -> ZeroConfig:
        if self.offload_param.device != "none" and self.stage != 3:
            raise _fail(
                f"offload_param.device {self.offload_param.device!r} needs stage 3, got stage {self.stage}"
            )
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise _fail(
                f"offload_optimizer.device {self.offload_optimizer.device!r} needs stage 1, 2 or 3, "
                "got stage 0"
            )
        return self

    def no_effect_keys_given(self) -> list[str]:
        """The keys of :attr:`NO_EFFECT_KEYS` that the config gave explicitly."""
        return [key for key in self.NO_EFFECT_KEYS if key in self.model_fields_set]


# --------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------

OPTIMIZER_TYPES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
_ADAM_ONLY = ("betas", "eps", "amsgrad", "torch_adam", "adam_w_mode")
_SGD_ONLY = ("momentum", "dampening", "nesterov")


class OptimizerParams(_Section):
    """Optimizer hyper-parameters (``optimizer.params``), as the torch.optim constructor takes them."""

    lr: float = Field(1e-3, ge=0)
    """Learning rate."""

    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    """Adam/AdamW: decay rates of the first and second moment estimates, each in [0, 1)."""

    eps: float = Field(1e-8, ge=0)
    """Adam/AdamW: term added to the denominator for numerical stability."""

    weight_decay: float = Field(0.0, ge=0)
    """Weight decay (L2 penalty; decoupled for AdamW). Default 0.01 for AdamW (as
    torch.optim.AdamW), else 0."""

    momentum: float = Field(0.0, ge=0)
    """SGD: momentum factor."""

    dampening: float = 0.0
    """SGD: dampening for momentum."""

    nesterov: bool = False
    """SGD: use Nesterov momentum (needs momentum > 0 and dampening 0)."""

    amsgrad: bool = False
    """Adam/AdamW: use the AMSGrad variant."""

    torch_adam: bool = False
    """DeepSpeed key: use torch's Adam instead of a fused one. zinf always uses torch's; no effect."""

    adam_w_mode: bool | None = None
    """DeepSpeed key: decoupled weight decay. true turns type "Adam" into "AdamW"; false with
    "AdamW" is an error."""


class OptimizerConfig(_Section):
    """The ``"optimizer"`` section: which torch optimizer updates the (offloaded) fp32 master weights."""

    type: str = "AdamW"
    """"AdamW", "Adam" or "SGD" (case-insensitive)."""

    params: OptimizerParams = Field(default_factory=OptimizerParams)
    """Hyper-parameters passed to the optimizer."""

    @field_validator("type", mode="before")
    @classmethod
    def _normalise_type(cls, value: Any) -> Any:
        supported = ", ".join(OPTIMIZER_TYPES.values())
        if not isinstance(value, str):
            raise _fail(f"must be one of {supported}, got {_show(value)}")
        canonical = OPTIMIZER_TYPES.get(value.strip().lower())
        if canonical is None:
            raise _fail(f"unsupported optimizer type {value!r}; supported: {supported}")
        return canonical

    @model_validator(mode="after")
    def _check_params(self) -> OptimizerConfig:
        p = self.params
        given = p.model_fields_set
        if p.adam_w_mode is True and self.type == "Adam":
            self.type = "AdamW"
        if p.adam_w_mode is False and self.type == "AdamW":
            raise _fail("type 'AdamW' contradicts params.adam_w_mode false; use type 'Adam'")
        wrong = [k for k in (_ADAM_ONLY if self.type == "SGD" else _SGD_ONLY) if k in given]
        if wrong:
            keys = ", ".join(f"params.{k}" for k in wrong)
            owner = "Adam and AdamW" if self.type == "SGD" else "SGD"
            raise _fail(f"{keys} apply only to {owner}, not to type {self.type!r}")
        if self.type == "SGD":
            if p.lr <= 0:
                raise _fail(f"params.lr must be > 0 for SGD, got {p.lr}")
            if p.nesterov and (p.momentum <= 0 or p.dampening != 0):
                raise _fail(
                    "params.nesterov needs params.momentum > 0 and params.dampening 0 "
                    f"(got momentum {p.momentum}, dampening {p.dampening})"
                )
        if self.type == "AdamW" and "weight_decay" not in given:
            self.params = p.model_copy(update={"weight_decay": 0.01})
        return self

    def torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the matching ``torch.optim`` constructor."""
        p = self.params
        if self.type == "SGD":
            return {"lr": p.lr, "momentum": p.momentum, "dampening": p.dampening,
                    "weight_decay": p.weight_decay, "nesterov": p.nesterov}
        return {"lr": p.lr, "betas": tuple(p.betas), "eps": p.eps,
                "weight_decay": p.weight_decay, "amsgrad": p.amsgrad}


# --------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------


class PrecisionConfig(_Section):
    """The ``"bf16"`` section: compute in bfloat16 (optimizer state stays fp32)."""

    enabled: bool = False
    """Compute (forward, backward, working parameter copies) in this precision."""


class FP16Config(PrecisionConfig):
    """The ``"fp16"`` section: compute in float16 with loss scaling."""

    loss_scale: float = Field(0.0, ge=0)
    """Static loss scale; 0 = dynamic loss scaling."""

    initial_scale_power: int = Field(16, ge=0, le=64)
    """Dynamic scaling starts at 2**initial_scale_power."""

    loss_scale_window: int = Field(1000, ge=1)
    """Steps without overflow before the dynamic scale is doubled."""

    hysteresis: int = Field(2, ge=1)
    """Overflows tolerated before the dynamic scale is halved."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every step without overflow."""

    min_loss_scale: float = Field(1.0, gt=0)
    """Lower bound of the dynamic loss scale."""

    auto_cast: bool = False
    """Cast the model's floating-point inputs to float16."""


# --------------------------------------------------------------------------------------------
# The "zinf" section
# --------------------------------------------------------------------------------------------


class PlacementConfig(_Section):
    """How shards are assigned to GPU / DRAM / NVMe."""

    policy: Annotated[Literal["static", "adaptive"], BeforeValidator(_lower)] = "static"
    """"static": plan once from sizes and budgets; "adaptive": re-plan from measured access times."""

    replan_every: int = Field(20, ge=1)
    """Steps between re-plans (adaptive policy)."""

    migration_bytes_per_step: Size = 256 * MiB
    """Bytes of shards moved between tiers per step at most, when a new plan differs."""

    plan_file: OptionalPath = None
    """A saved plan (``plan.json``, written by ``zinf plan`` or ``zinf report``) whose placement the
    run starts from, instead of the one ``offload_param``/``offload_optimizer`` devices and
    ``max_in_cpu`` describe. It must name exactly this model's shards (same shard settings and
    precision as the profiled run); ``module_parameters`` pins must agree with it, and the
    placement must fit ``dram_budget`` (checked at ``initialize``). The adaptive policy re-plans
    from there. Relative paths start at the working directory, like ``nvme_path``."""

    adopt_margin: float = Field(1.5, ge=0)
    """Adaptive: a plan is adopted only when its predicted gain over the next few re-plan periods
    exceeds its migration time times this (0: any predicted gain)."""

    min_gain_fraction: float = Field(0.05, ge=0, lt=1)
    """Adaptive: predicted gains below this fraction of the step time are ignored as noise. 5%,
    as ``revert_fraction``: a plan predicted to gain less could be wrong by all of its gain and
    still not be told apart from noise (nor reverted) once it lands (the dense GPT's first plans
    predicted 2-3% gains that measured as losses)."""

    warm_band: float = Field(0.15, ge=0, lt=1)
    """Adaptive: homes whose value per byte is within this fraction of the plan's DRAM threshold
    stay where they are (hysteresis against ping-pong), unless together they are worth more than
    this fraction of the step (as after a routing change: then the plan is taken whole)."""

    plan_lag_steps: int | None = Field(None, ge=0)
    """Adaptive: plans are made in a child process while training goes on; a plan due after step
    k is taken up at the first step end that finds it made, at the latest after step k + this
    (at most ``replan_every`` - 1; training waits for it there). 0: plan between steps on the
    training thread, the step waiting for it. null (default): 4 where the process may use at
    least 4 CPUs, else 0 (the planning process needs a CPU that training does not use)."""

    revert_fraction: float | None = Field(0.05, ge=0)
    """Adaptive: a plan whose placement, once landed, measures slower than the placement it
    replaced by more than this fraction - and by more than the steps' noise, on a machine whose
    steps vary by more - is reverted, and no similar plan is adopted until the accesses change
    (null: never revert)."""

    trial_band: float = Field(0.10, ge=0, lt=1)
    """Adaptive: a plan in an engine mode that has not run yet (which overlap buffers the budget
    leaves it: prefetch window, write-behind, optimizer read-ahead, updates during backward),
    predicted within this fraction of the step of the best plan and of the placement in force
    (either way), is tried once (not at the first plan) - adopted, measured, and reverted unless
    it measured faster - since the model's calibration of a mode that never ran is borrowed from
    the one in force, and errs across modes by this much (on the H100's dense GPT at 30%: 2-11%).
    Only within ``trial_periods`` re-plan periods of the first plan (measured and reverted within
    them too); after them a plan in a mode that never ran must clear ``min_gain_fraction`` plus
    this band. 0: never try."""

    trial_periods: int = Field(3, ge=0)
    """Adaptive: the re-plan periods after the first plan in which untried engine modes are tried
    (see ``trial_band``; a trial starts while two periods are left of them, one without
    ``trial_confirm_z``): exploring ends before the steady state, where a trial that measured
    slower would move homes there and back. A plan reverted within them (no trial) starts them
    again. 0: no trials."""

    trial_confirm_z: float | None = Field(3.0, gt=0)
    """Adaptive: a trial measured faster than the placement before it by less than this many
    times the steps' noise is confirmed before it is kept: that placement is measured again
    after it (its moves there and back), and the trial is kept only if faster than that too - a
    slow phase of a shared machine just before a trial otherwise keeps a slower placement.
    Once kept, a trial judged again over all its steps is reverted only when slower beyond the
    noise, like any plan. null: judge a trial on the steps before it alone."""


class ProfilerConfig(_Section):
    """The profiler that records per-step and per-shard timings to a database."""

    enabled: bool = False
    """Record a profile of the run."""

    db: str = "sqlite:///zinf-profile.db"
    """SQLAlchemy database URL the profile is written to."""

    detail: Annotated[Literal["step", "shard"], BeforeValidator(_lower)] = "shard"
    """"step": one row per step; "shard": also one row per shard access and per I/O."""

    window_steps: int = Field(1, ge=1)
    """Steps aggregated into one recorded sample."""

    flush_interval_s: float = Field(0.5, ge=0)
    """Seconds between commits of pending rows: a killed process loses at most the steps that
    ended in the last interval, plus the step under way."""

    heartbeat_s: float = Field(5.0, gt=0)
    """Seconds between updates of ``runs.last_heartbeat`` while a run lives (readers on other
    hosts call a run crashed when its heartbeat is much older)."""

    @field_validator("db")
    @classmethod
    def _url(cls, value: str) -> str:
        if not re.match(r"[A-Za-z][A-Za-z0-9+.\-]*://", value):
            raise _fail(f"must be a SQLAlchemy URL such as 'sqlite:///zinf-profile.db', got {value!r}")
        return value


class AutotuneConfig(_Section):
    """In-training tuning of the I/O settings (``aio`` block size, queue depth, thread count) and
    of the parameter prefetch window: a few short trials early in training, each measured through
    the profiler (``tuning_trials``); the fastest is kept (see ``planner/tuning.py``)."""

    enabled: bool = False
    """Tune while training (needs the profiler: it is turned on unless ``zinf.profiler.enabled``
    is false, which is an error). Only runs where some state lives on NVMe have anything to tune."""

    trials: int = Field(4, ge=1)
    """Settings tried besides the configured one (each changes one setting of the best so far)."""

    steps_per_trial: int = Field(3, ge=1)
    """Optimizer steps measured per trial (their median step time is the trial's); each trial
    also runs one settle step before them and one step while it is judged, so a trial costs
    ``steps_per_trial + 2`` steps."""

    start_step: int = Field(2, ge=1)
    """Optimizer steps run before the first trial (the first records the prefetch trace; early
    steps also warm the swap files up)."""

    min_gain: float = Field(0.05, ge=0, lt=1)
    """A trial replaces the best setting so far only when its step is faster by more than this
    fraction (so noise does not move the configured setting)."""


class ZinfConfig(_Section):
    """The ``"zinf"`` section: budgets, sharding and placement (no DeepSpeed equivalent)."""

    dram_budget: Size | None = None
    """Bytes of DRAM zinf may use for parameters, optimizer state and buffers; unset = the
    engine decides from the free memory."""

    gpu_budget: Size | None = None
    """Bytes of GPU memory zinf may use for resident shards; unset = the engine decides from the
    free memory."""

    device: Annotated[Literal["auto", "cpu", "cuda"], BeforeValidator(_lower)] = "auto"
    """Compute device: "auto" = CUDA if available, else CPU."""

    nvme_path: Annotated[Path, BeforeValidator(_path)] = Path("zinf-swap")
    """Swap directory used when an offload section names no ``nvme_path``."""

    chunk_size: Size = Field(4 * MiB, ge=1)
    """Bytes per chunk: small parameters are packed into chunks up to this size."""

    shard_min_bytes: Size = Field(1 * MiB, ge=1)
    """Bytes: a parameter at least this big is a shard of its own (must be <= chunk_size)."""

    staging_buffer_size: Size = Field(4 * MiB, ge=4096)
    """Bytes of one page-aligned staging buffer of the NVMe store (a multiple of 4096). Unaligned
    tensors move to and from NVMe through these, one window at a time."""

    staging_buffers: int = Field(4, ge=1)
    """Number of staging buffers; with ``staging_buffer_size`` they count against ``dram_budget``."""

    fused_optimizer: bool | None = None
    """Run Adam/AdamW updates with torch's fused CPU kernel (one vectorised pass, several times
    faster than the op-by-op arithmetic). None = on when the compute device is CUDA, off on the
    CPU, where the op-by-op arithmetic matches ``torch.optim``'s default CPU path bit for bit
    (the fused kernel differs from it by an ulp here and there)."""

    overlap_optimizer: bool = True
    """With ``gradient_clipping`` off, update each NVMe-resident shard as soon as its gradient is
    final, during backward, instead of writing the gradient to NVMe and reading it back in the
    optimizer phase (saves 8 bytes of NVMe traffic a parameter, and overlaps the update with
    backward). With clipping on, the global norm needs every gradient first, so this is off."""

    prefetch_hints: bool = True
    """Read ahead the parameters of the modules the model announces with ``zinf.will_use(modules)``
    (the MoE layer announces the experts its router picked), before the reads the recorded trace
    only guesses. False: ignore the announcements (e.g. to measure what they buy)."""

    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """Placement policy."""

    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig)
    """Profiler."""

    autotune: AutotuneConfig = Field(default_factory=AutotuneConfig)
    """In-training tuning of the I/O settings and the prefetch window."""

    run_name: str | None = None
    """Name of the run in the profile database and checkpoints; unset = generated."""

    @model_validator(mode="after")
    def _shard_fits_chunk(self) -> ZinfConfig:
        if self.shard_min_bytes > self.chunk_size:
            raise _fail(
                f"shard_min_bytes ({self.shard_min_bytes}) must be <= chunk_size ({self.chunk_size}): "
                "a parameter too small for its own shard must fit in a chunk"
            )
        return self


# --------------------------------------------------------------------------------------------
# Top level
# --------------------------------------------------------------------------------------------


class Config(_Section):
    """A whole zinf (DeepSpeed-compatible) config. Build one with :func:`load_config`."""

    train_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step (= micro batch * gradient accumulation steps; one process)."""

    train_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    """Samples per forward/backward."""

    gradient_accumulation_steps: int | None = Field(None, ge=1)
    """Forward/backward passes per optimizer step. Always an int >= 1 after validation."""

    gradient_clipping: float = Field(0.0, ge=0)
    """Clip the global gradient L2 norm to this value; 0 = off."""

    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer."""

    bf16: PrecisionConfig = Field(
        default_factory=PrecisionConfig, validation_alias=AliasChoices("bf16", "bfloat16")
    )
    """bfloat16 compute. Also accepted as "bfloat16" (DeepSpeed alias)."""

    fp16: FP16Config = Field(default_factory=FP16Config)
    """float16 compute with loss scaling."""

    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO partitioning and offload."""

    aio: AioConfig = Field(default_factory=AioConfig)
    """NVMe I/O."""

    steps_per_print: int = Field(10, ge=1)
    """Optimizer steps between progress log lines."""

    wall_clock_breakdown: bool = False
    """Log the time of forward, backward and optimizer step separately."""

    zinf: ZinfConfig = Field(default_factory=ZinfConfig)
    """zinf's own settings."""

    @model_validator(mode="before")
    @classmethod
    def _one_bf16(cls, data: Any) -> Any:
        return _merge_alias(data, "bf16", "bfloat16", equal_ok=False)

    @model_validator(mode="after")
    def _one_precision(self) -> Config:
        if self.bf16.enabled and self.fp16.enabled:
            raise _fail("bf16.enabled and fp16.enabled are both true; enable at most one")
        return self

    @model_validator(mode="after")
    def _batch_arithmetic(self) -> Config:
        tbs = self.train_batch_size
        micro = self.train_micro_batch_size_per_gpu
        gas = self.gradient_accumulation_steps

        def given() -> str:
            show = lambda v: "not given" if v is None else str(v)  # noqa: E731
            return (f"train_batch_size={show(tbs)}, train_micro_batch_size_per_gpu={show(micro)}, "
                    f"gradient_accumulation_steps={show(gas)}")

        if tbs is not None and micro is not None and gas is not None:
            if tbs != micro * gas:
                raise _fail(
                    "batch sizes contradict: train_batch_size must equal train_micro_batch_size_per_gpu "
                    f"* gradient_accumulation_steps (one process), but {given()} "
                    f"({micro} * {gas} = {micro * gas})"
                )
        elif tbs is not None and micro is not None:
            if tbs % micro:
                raise _fail(f"batch sizes contradict: train_batch_size is not a multiple of "
                            f"train_micro_batch_size_per_gpu ({given()})")
            gas = tbs // micro
        elif tbs is not None and gas is not None:
            if tbs % gas:
                raise _fail(f"batch sizes contradict: train_batch_size is not a multiple of "
                            f"gradient_accumulation_steps ({given()})")
            micro = tbs // gas
        elif micro is not None and gas is not None:
            tbs = micro * gas
        elif tbs is not None:
            micro, gas = tbs, 1
        elif micro is not None:
            tbs, gas = micro, 1
        self.train_batch_size = tbs
        self.train_micro_batch_size_per_gpu = micro
        self.gradient_accumulation_steps = gas if gas is not None else 1
        return self

    # -- derived values the engine reads --

    @property
    def param_nvme_path(self) -> Path:
        """Directory for parameter swap files."""
        return self.zero_optimization.offload_param.nvme_path or self.zinf.nvme_path

    @property
    def optim_nvme_path(self) -> Path:
        """Directory for optimizer-state swap files."""
        return self.zero_optimization.offload_optimizer.nvme_path or self.zinf.nvme_path

    @property
    def compute_dtype(self) -> Any:
        """``torch.bfloat16`` / ``torch.float16`` if bf16 / fp16 is enabled, else ``torch.float32``."""
        import torch

        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as a JSON-able dict (paths as str).

        ``load_config`` of it gives an equal Config. The no-effect ZeRO keys appear only if they
        were given, and only the optimizer params that apply to the optimizer type.
        """
        data = self.model_dump(mode="json")
        params = data["optimizer"]["params"]
        not_applying = _ADAM_ONLY if self.optimizer.type == "SGD" else _SGD_ONLY
        for key in (*not_applying, "torch_adam", "adam_w_mode"):
            params.pop(key, None)
        zero = data["zero_optimization"]
        for key in ZeroConfig.NO_EFFECT_KEYS:
            if key not in self.zero_optimization.model_fields_set:
                zero.pop(key, None)
        return data


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_config(source: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None) -> Config:
    """Build a validated :class:`Config`.

    ``None`` -> defaults; a dict -> validated; a str or path -> a JSON file (a str that starts with
    "{" is taken as JSON text); a Config -> returned as is. Raises :class:`ConfigError` (one
    message naming the key path) on any problem; warns :class:`ZinfConfigWarning` once when
    DeepSpeed keys that have no effect in zinf are given.
    """
    if isinstance(source, Config):
        return source
    where = ""
    if source is None:
        data: Any = {}
    elif isinstance(source, Mapping):
        data = source
    elif isinstance(source, str) and source.lstrip().startswith("{"):
        data = _parse_json(source, "config text")
        where = "config text: "
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        data = _read_json_file(path)
        where = f"config file '{path}': "
    else:
        raise ConfigError(
            f"config must be a dict, a path to a JSON file, a Config or None, got {type(source).__name__}"
        )
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}the config must be a JSON object, got {_json_kind(data)}")
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(where + _explain(exc, data)) from None
    ignored = config.zero_optimization.no_effect_keys_given()
    if ignored:
        warnings.warn(
            "zero_optimization keys accepted for DeepSpeed compatibility, no effect in zinf: "
            + ", ".join(ignored),
            ZinfConfigWarning,
            stacklevel=2,
        )
    return config


def _read_json_file(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file '{path}' is a directory, not a JSON file") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"cannot read config file '{path}': {reason}") from None
    return _parse_json(text, f"config file '{path}'")


def _parse_json(text: str, what: str) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"{what}: key {key!r} appears twice in one JSON object")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{what} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None


# -- turning a pydantic ValidationError into one readable message ----------------------------

_MAX_LINES = 8


def _explain(exc: ValidationError, data: Any) -> str:
    errors = exc.errors(include_url=False)
    # A misspelt required key shows up twice (unknown + missing); report only the unknown one.
    unknown_in = {tuple(e["loc"][:-1]) for e in errors if e["type"] == "extra_forbidden"}
    lines: list[str] = []
    for err in errors:
        if err["type"] == "missing" and tuple(err["loc"][:-1]) in unknown_in:
            continue
        line = _explain_one(err, data)
        if line not in lines:
            lines.append(line)
    if len(lines) == 1:
        return lines[0]
    shown = lines[:_MAX_LINES]
    more = f"\n  (and {len(lines) - _MAX_LINES} more)" if len(lines) > _MAX_LINES else ""
    return f"{len(lines)} problems in the config:\n  " + "\n  ".join(shown) + more


class _Where:
    """What an error location ``loc`` points at, found by walking the model tree from Config."""

    def __init__(self, loc: tuple[Any, ...]) -> None:
        self.segments: list[str] = []
        self.unknown_in: type[BaseModel] | None = None  # loc's last key is not a field of this model
        self.unknown_key: str = ""
        self.field: Any = None  # FieldInfo of the deepest field reached
        self.field_depth = 0  # len of the loc prefix that reaches that field
        self.section: type[BaseModel] | None = None  # loc points at a whole model
        cur: Any = Config
        for i, elem in enumerate(loc):
            if _is_model(cur):
                name = _field_named(cur, elem)
                if name is None:
                    self.unknown_in, self.unknown_key = cur, str(elem)
                    self.segments.append(str(elem))
                    return
                self.field = cur.model_fields[name]
                self.field_depth = i + 1
                self.segments.append(str(elem))
                cur = _container(self.field.annotation)
            elif isinstance(cur, tuple):  # inside a dict: elem is a user key (a pin pattern)
                self.segments[-1] += f'["{elem}"]'
                self.field_depth = i + 1
                cur = _container(cur[1])
            else:  # a tuple index or a pydantic union tag: report the field as a whole
                break
        else:
            if _is_model(cur):
                self.section = cur

    @property
    def path(self) -> str:
        return ".".join(self.segments)


def _explain_one(err: Mapping[str, Any], data: Any) -> str:
    where = _Where(tuple(err["loc"]))
    path, kind = where.path, err["type"]
    if where.unknown_in is not None:
        return _unknown_key(path, where.unknown_key, where.unknown_in)
    if kind == "missing" and where.field_depth == len(err["loc"]):
        return f"config key '{path}' is required"
    if kind in ("zinf_config", "value_error", "assertion_error"):
        message = err["ctx"]["message"] if kind == "zinf_config" else str(err["ctx"]["error"])
        if not path:
            return message
        noun = "section" if where.section is not None else "key"
        return f"config {noun} '{path}': {message}"
    value = _raw_value(data, err["loc"][: where.field_depth], err.get("input"))
    if where.section is not None:
        keys = ", ".join(_valid_keys(where.section))
        return f"config section '{path}' must be an object (keys: {keys}), got {_show(value)}"
    expected = _describe_field(where.field) if where.field is not None else "valid"
    line = f"config key '{path}' must be {expected}, got {_show(value)}"
    options = _literal_options(where.field.annotation) if where.field is not None else []
    if options and isinstance(value, str):
        close = difflib.get_close_matches(value.lower(), options, n=1, cutoff=0.6)
        if close:
            line += f"; did you mean {close[0]!r}?"
    return line


def _unknown_key(path: str, key: str, model: type[BaseModel]) -> str:
    keys = _valid_keys(model)
    lowered = {k.lower(): k for k in keys}
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6) or [
        lowered[m] for m in difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)
    ]
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown config key '{path}'{hint} (valid keys: {', '.join(keys)})"


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _strip(tp: Any) -> Any:
    """``Annotated[X, ...]`` -> X; ``X | None`` -> X."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            rest = [a for a in get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp
            tp = rest[0]
        else:
            return tp


def _container(tp: Any) -> Any:
    """The model class, or ("dict", value type), that ``tp`` holds; None for a leaf."""
    tp = _strip(tp)
    if _is_model(tp):
        return tp
    if get_origin(tp) is dict:
        return ("dict", get_args(tp)[1])
    return None


def _field_names_and_aliases(model: type[BaseModel]) -> list[tuple[str, list[str]]]:
    out = []
    for name, info in model.model_fields.items():
        alias = info.validation_alias
        keys = [str(c) for c in alias.choices] if isinstance(alias, AliasChoices) else [name]
        if name not in keys:
            keys.insert(0, name)
        out.append((name, keys))
    return out


def _field_named(model: type[BaseModel], key: Any) -> str | None:
    for name, keys in _field_names_and_aliases(model):
        if key in keys:
            return name
    return None


def _valid_keys(model: type[BaseModel]) -> list[str]:
    return [k for _, keys in _field_names_and_aliases(model) for k in keys]


def _literal_options(tp: Any) -> list[str]:
    tp = _strip(tp)
    return [str(a) for a in get_args(tp)] if get_origin(tp) is Literal else []


def _constraints(metadata: list[Any]) -> str:
    lo = hi = None
    lo_op = hi_op = ""
    for m in metadata:
        if isinstance(m, annotated_types.Ge):
            lo, lo_op = m.ge, ">="
        elif isinstance(m, annotated_types.Gt):
            lo, lo_op = m.gt, ">"
        elif isinstance(m, annotated_types.Le):
            hi, hi_op = m.le, "<="
        elif isinstance(m, annotated_types.Lt):
            hi, hi_op = m.lt, "<"
    if lo is not None and hi is not None and (lo_op, hi_op) == (">=", "<="):
        return f" between {lo} and {hi}"
    parts = [f"{op} {v}" for op, v in ((lo_op, lo), (hi_op, hi)) if v is not None]
    return (" " + " and ".join(parts)) if parts else ""


def _describe_type(tp: Any, metadata: list[Any]) -> str:
    if get_origin(tp) is Annotated:
        base, *extra = get_args(tp)
        return _describe_type(base, [*extra, *metadata])
    if any(isinstance(m, BeforeValidator) and m.func is parse_size for m in metadata):
        return f"a size{_constraints(metadata)}: {_SIZE_EXAMPLE}"
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        rest = [a for a in args if a is not type(None)]
        text = " or ".join(_describe_type(a, metadata) for a in rest)
        return text + (" or null" if len(rest) < len(args) else "")
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is tuple:
        items = get_args(tp)
        if items and all(_strip(i) is float for i in items):
            return f"a list of {len(items)} numbers{_constraints_of_items(items)}"
        return f"a list of {len(items)} values"
    if origin is dict:
        if _is_model(get_args(tp)[1]) and get_args(tp)[1] is PinConfig:
            return 'an object mapping module-name patterns to {"device": ...}'
        return "an object"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer" + _constraints(metadata)
    if tp is float:
        return "a number" + _constraints(metadata)
    if tp is str:
        return "a string"
    if tp is Path:
        return "a path (a string)"
    if _is_model(tp):
        return "an object"
    return "a valid value"


def _constraints_of_items(items: tuple[Any, ...]) -> str:
    texts = set()
    for item in items:
        metadata = []
        for m in get_args(item)[1:] if get_origin(item) is Annotated else ():
            metadata.extend(getattr(m, "metadata", [m]))
        texts.add(_constraints(metadata))
    return f", each{texts.pop()}" if len(texts) == 1 and "" not in texts else ""


def _describe_field(info: Any) -> str:
    return _describe_type(info.annotation, list(info.metadata))


def _raw_value(data: Any, loc: tuple[Any, ...], fallback: Any) -> Any:
    for key in loc:
        if isinstance(data, Mapping) and key in data:
            data = data[key]
        else:
            return fallback
    return data


def _json_kind(value: Any) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


def _show(value: Any) -> str:
    """A short rendering of a user value: strings quoted Python-style, the rest as JSON."""
    if isinstance(value, str):
        text = repr(value)
    else:
        try:
            text = json.dumps(value, default=str)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
