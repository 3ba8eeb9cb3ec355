"""Tests of zinf.config: the seed article's snippets, error messages, sizes, batch arithmetic, files."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError

from zinf.config import (
    Config,
    ZeroConfig,
    ZinfConfigWarning,
    load_config,
    parse_size,
)
from zinf.errors import ConfigError
from zinf.pins import PinSet

SEED_1 = {
    "train_batch_size": 1024,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
    },
}
SEED_2 = {"aio": {"block_size": 1048576, "queue_depth": 32, "thread_count": 4}}
SEED_3 = {
    "zero_optimization": {
        "offload_params": {
            "device": "nvme",
            "nvme_path": "/nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
            "module_parameters": {
                "encoder.layer[0-2]": {"device": "cpu"},
                "encoder.layer[3-]": {"device": "nvme"},
            },
        }
    }
}


def config_error(source) -> str:
    """The message of the ConfigError that load_config raises for ``source`` (checked to be clean)."""
    with pytest.raises(ConfigError) as info:
        load_config(source)
    err = info.value
    assert not isinstance(err, ValidationError)
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    msg = str(err)
    assert "pydantic" not in msg and "Traceback" not in msg
    return msg


# -- the seed article ---------------------------------------------------------------------------


def test_seed_snippet_1_zero3_nvme():
    cfg = load_config(SEED_1)
    assert cfg.train_batch_size == 1024
    assert cfg.train_micro_batch_size_per_gpu == 1024
    assert cfg.gradient_accumulation_steps == 1
    zero = cfg.zero_optimization
    assert zero.stage == 3
    assert zero.offload_param.device == "nvme"
    assert zero.offload_optimizer.device == "nvme"
    assert cfg.param_nvme_path == Path("/local_nvme")
    assert cfg.optim_nvme_path == Path("/local_nvme")


def test_seed_snippet_2_aio():
    cfg = load_config(SEED_2)
    assert cfg.aio.block_size == 1048576
    assert cfg.aio.queue_depth == 32
    assert cfg.aio.thread_count == 4
    assert cfg.aio.single_submit is False and cfg.aio.overlap_events is True


def test_seed_snippet_3_offload_params_and_pins():
    cfg = load_config(SEED_3)
    op = cfg.zero_optimization.offload_param
    assert op.device == "nvme"
    assert op.nvme_path == Path("/nvme")
    assert op.pin_memory is True
    assert op.buffer_count == 5
    assert op.buffer_size == 100_000_000 and isinstance(op.buffer_size, int)
    assert op.max_in_cpu == 1_000_000_000 and isinstance(op.max_in_cpu, int)
    pins = PinSet.from_config(op.module_parameters)
    for i in range(3):
        assert pins.tier_for(f"encoder.layer.{i}") == "cpu"
    for i in range(3, 12):
        assert pins.tier_for(f"encoder.layer.{i}") == "nvme"
    assert pins.tier_for("embeddings.word_embeddings") is None
    assert pins.tier_for_param("encoder.layer.1.attention.self.query.weight") == "cpu"


def test_defaults():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.train_batch_size is None
    assert cfg.zero_optimization.stage == 3
    assert cfg.zero_optimization.offload_param.device == "none"
    assert cfg.zero_optimization.offload_param.buffer_size == 100_000_000
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 50_000_000
    assert cfg.aio.block_size == 1 << 20 and cfg.aio.queue_depth == 8 and cfg.aio.thread_count == 4
    assert cfg.optimizer.type == "AdamW"
    assert cfg.zinf.chunk_size == 4 << 20 and cfg.zinf.shard_min_bytes == 1 << 20
    assert cfg.zinf.placement.migration_bytes_per_step == 256 << 20
    assert cfg.zinf.profiler.db == "sqlite:///zinf-profile.db"
    assert cfg.param_nvme_path == Path("zinf-swap") == cfg.optim_nvme_path


def test_config_instance_is_returned_as_is():
    cfg = load_config(SEED_2)
    assert load_config(cfg) is cfg


def test_input_dict_is_not_modified():
    src = json.loads(json.dumps(SEED_3))
    load_config(src)
    assert src == json.loads(json.dumps(SEED_3))


# -- aliases ---------------------------------------------------------------------------------------


def test_intra_op_parallelism_is_thread_count():
    assert load_config({"aio": {"intra_op_parallelism": 7}}).aio.thread_count == 7
    assert load_config({"aio": {"thread_count": 3}}).aio.thread_count == 3
    assert load_config({"aio": {"thread_count": 2, "intra_op_parallelism": 2}}).aio.thread_count == 2


def test_thread_count_and_intra_op_parallelism_disagreeing():
    msg = config_error({"aio": {"thread_count": 2, "intra_op_parallelism": 3}})
    assert "'aio'" in msg and "thread_count" in msg and "intra_op_parallelism" in msg


def test_offload_param_and_offload_params_together():
    msg = config_error({"zero_optimization": {"offload_param": {}, "offload_params": {}}})
    assert "zero_optimization" in msg and "offload_params" in msg and "not both" in msg


def test_errors_under_alias_name_the_key_as_written():
    msg = config_error({"zero_optimization": {"offload_params": {"buffer_count": "many"}}})
    assert msg.startswith("config key 'zero_optimization.offload_params.buffer_count' must be an integer >= 1")


# -- unknown keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "path", "suggestion"),
    [
        ({"zero_optimisation": {}}, "zero_optimisation", "zero_optimization"),
        ({"train_batch_sise": 8}, "train_batch_sise", "train_batch_size"),
        ({"zero_optimization": {"offload_param": {"nvme_pth": "/x"}}},
         "zero_optimization.offload_param.nvme_pth", "nvme_path"),
        ({"zero_optimization": {"offload_optimizer": {"pipline_read": True}}},
         "zero_optimization.offload_optimizer.pipline_read", "pipeline_read"),
        ({"aio": {"queue_dpeth": 4}}, "aio.queue_dpeth", "queue_depth"),
        ({"aio": {"intra_op_paralelism": 4}}, "aio.intra_op_paralelism", "intra_op_parallelism"),
        ({"zinf": {"placement": {"replan_evry": 5}}}, "zinf.placement.replan_evry", "replan_every"),
        ({"optimizer": {"params": {"weight_dacay": 0.1}}}, "optimizer.params.weight_dacay", "weight_decay"),
        ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, "fp16.loss_scale_windw", "loss_scale_window"),
        ({"zero_optimization": {"offload_param": {"module_parameters": {"a.b": {"devize": "cpu"}}}}},
         'zero_optimization.offload_param.module_parameters["a.b"].devize', "device"),
    ],
)
def test_unknown_key_names_path_and_suggests(source, path, suggestion):
    msg = config_error(source)
    assert msg.startswith(f"unknown config key '{path}'; did you mean '{suggestion}'? (valid keys: "), msg
    assert "\n" not in msg  # one problem, one line


def test_unknown_key_lists_valid_keys_including_aliases():
    msg = config_error({"aio": {"zzz": 1}})
    assert "did you mean" not in msg
    assert "valid keys: block_size, queue_depth, thread_count, intra_op_parallelism" in msg


def test_unknown_top_level_section_with_no_close_match():
    msg = config_error({"scheduler_xyz_totally_different": {}})
    assert "unknown config key 'scheduler_xyz_totally_different'" in msg
    assert "zero_optimization" in msg  # valid keys are listed


def test_module_parameters_keys_are_patterns_not_config_keys():
    # A pattern that looks like a typo of a config key is still just a pattern.
    cfg = load_config({"zero_optimization": {"offload_param": {"module_parameters": {"nvme_pth": "cpu"}}}})
    assert cfg.zero_optimization.offload_param.module_parameters["nvme_pth"].device == "cpu"


# -- wrong types and values ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"aio": {"queue_depth": "deep"}}, "config key 'aio.queue_depth' must be an integer >= 1, got 'deep'"),
        ({"aio": {"queue_depth": 0}}, "config key 'aio.queue_depth' must be an integer >= 1, got 0"),
        ({"aio": {"thread_count": 2.5}}, "config key 'aio.thread_count' must be an integer >= 1, got 2.5"),
        ({"aio": {"use_gds": "maybe"}}, "config key 'aio.use_gds' must be true or false, got 'maybe'"),
        ({"zero_optimization": {"stage": 4}},
         "config key 'zero_optimization.stage' must be an integer between 0 and 3, got 4"),
        ({"zero_optimization": {"offload_param": {"device": "ssd"}}},
         "config key 'zero_optimization.offload_param.device' must be one of 'none', 'cpu', 'nvme', got 'ssd'"),
        ({"zinf": {"placement": {"policy": "adaptiv"}}},
         "config key 'zinf.placement.policy' must be one of 'static', 'adaptive', got 'adaptiv'; "
         "did you mean 'adaptive'?"),
        ({"gradient_clipping": -1}, "config key 'gradient_clipping' must be a number >= 0, got -1"),
        ({"optimizer": {"params": {"betas": [0.9]}}}, "config key 'optimizer.params.betas' must be a list of 2 numbers"),
        ({"zero_optimization": {"offload_param": {"nvme_path": 5}}},
         "config key 'zero_optimization.offload_param.nvme_path' must be a path (a string) or null, got 5"),
        ({"aio": 5}, "config section 'aio' must be an object (keys: block_size,"),
        ({"zero_optimization": {"offload_param": {"module_parameters": ["encoder"]}}},
         "config key 'zero_optimization.offload_param.module_parameters' must be an object mapping"),
        ({"zero_optimization": {"offload_param": {"module_parameters": {"encoder.layer[0]": {"device": "disk"}}}}},
         "config key 'zero_optimization.offload_param.module_parameters[\"encoder.layer[0]\"].device' must be "
         "one of 'none', 'gpu', 'cpu', 'nvme', got 'disk'"),
        ({"zinf": {"profiler": {"db": "profile.db"}}}, "config key 'zinf.profiler.db': must be a SQLAlchemy URL"),
        ({"zinf": {"nvme_path": ""}}, "config key 'zinf.nvme_path': must be a non-empty path"),
    ],
)
def test_wrong_value_messages(source, expected):
    msg = config_error(source)
    assert msg.startswith(expected), msg


def test_several_problems_are_reported_on_a_few_lines():
    msg = config_error({"aio": {"queue_depth": "deep", "thread_count": 0}, "zinf": {"chunk_size": "lots"}})
    lines = msg.splitlines()
    assert lines[0] == "3 problems in the config:"
    assert len(lines) == 4
    assert any("'aio.queue_depth'" in line for line in lines)
    assert any("'aio.thread_count'" in line for line in lines)
    assert any("'zinf.chunk_size'" in line for line in lines)


def test_case_insensitive_choices():
    cfg = load_config({"zero_optimization": {"offload_param": {"device": "NVMe"}}, "zinf": {"device": "CUDA"}})
    assert cfg.zero_optimization.offload_param.device == "nvme"
    assert cfg.zinf.device == "cuda"


def test_pin_values_none_means_gpu_and_strings_are_accepted():
    cfg = load_config({"zero_optimization": {"offload_optimizer": {"module_parameters": {
        "a": {"device": "none"}, "b": {"device": "GPU"}, "c": "nvme"}}}})
    pins = cfg.zero_optimization.offload_optimizer.module_parameters
    assert {k: v.device for k, v in pins.items()} == {"a": "gpu", "b": "gpu", "c": "nvme"}


def test_invalid_pin_pattern_is_reported_at_load():
    msg = config_error({"zero_optimization": {"offload_param": {"module_parameters": {"encoder.layer[3-1]": "cpu"}}}})
    assert "zero_optimization.offload_param.module_parameters" in msg
    assert "'encoder.layer[3-1]'" in msg and "encoder.layer[0-2]" in msg  # names it, shows an example


def test_offload_param_needs_stage_3():
    msg = config_error({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert "stage 3" in msg and "zero_optimization" in msg
    assert load_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})


def test_shard_min_bytes_must_fit_a_chunk():
    msg = config_error({"zinf": {"chunk_size": "1MiB", "shard_min_bytes": "2MiB"}})
    assert "shard_min_bytes" in msg and "chunk_size" in msg


def test_not_a_mapping():
    assert "must be a dict" in config_error(42)


# -- sizes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (100, 100),
        (0, 0),
        (1e8, 100_000_000),
        (1e9, 1_000_000_000),
        ("100", 100),
        ("16GiB", 16 * 2**30),
        ("512MiB", 512 * 2**20),
        ("4KiB", 4096),
        ("2GB", 2_000_000_000),
        ("1.5GiB", 3 * 2**29),
        ("512 mib", 512 * 2**20),
        ("1tib", 2**40),
        ("3TB", 3 * 10**12),
        ("7kb", 7000),
        ("10B", 10),
        ("1e8", 100_000_000),
        (" 8 MB ", 8_000_000),
    ],
)
def test_parse_size(value, expected):
    assert parse_size(value) == expected
    assert type(parse_size(value)) is int


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (-1, "negative"),
        ("-4MiB", "negative"),
        (-1e3, "negative"),
        ("junk", "'junk'"),
        ("", "invalid size"),
        ("4XB", "unknown unit"),
        ("16G", "ambiguous"),
        (1.5, "whole number"),
        ("1.5B", "whole number"),
        (float("inf"), "whole number"),
        (True, "invalid size"),
        (None, "invalid size"),
        ([4], "invalid size"),
    ],
)
def test_parse_size_rejects(value, needle):
    with pytest.raises(ConfigError) as info:
        parse_size(value)
    msg = str(info.value)
    assert needle in msg
    assert "16GiB" in msg or "GiB" in msg  # shows an example / the fix


def test_size_strings_in_config():
    cfg = load_config({
        "aio": {"block_size": "4MiB"},
        "zinf": {"dram_budget": "64GiB", "gpu_budget": "80GB", "chunk_size": "8MiB",
                 "placement": {"migration_bytes_per_step": "1GiB"}},
        "zero_optimization": {"stage3_prefetch_bucket_size": 5e7, "offload_param": {"buffer_size": "1e8"}},
    })
    assert cfg.aio.block_size == 4 * 2**20
    assert cfg.zinf.dram_budget == 64 * 2**30
    assert cfg.zinf.gpu_budget == 80 * 10**9
    assert cfg.zinf.chunk_size == 8 * 2**20
    assert cfg.zinf.placement.migration_bytes_per_step == 2**30
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 50_000_000
    assert cfg.zero_optimization.offload_param.buffer_size == 100_000_000


def test_bad_size_in_config_names_key_and_value():
    msg = config_error({"zinf": {"dram_budget": "lots"}})
    assert msg.startswith("config key 'zinf.dram_budget': invalid size 'lots'")
    assert "16GiB" in msg


def test_zero_block_size_rejected():
    msg = config_error({"aio": {"block_size": 0}})
    assert msg.startswith("config key 'aio.block_size' must be a size >= 1")


# -- batch arithmetic ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, (None, None, 1)),
        ({"train_batch_size": 32}, (32, 32, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, (4, 4, 1)),
        ({"gradient_accumulation_steps": 8}, (None, None, 8)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 8)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, (32, 16, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, (12, 4, 3)),
        ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
         (12, 4, 3)),
    ],
)
def test_batch_arithmetic(given, expected):
    cfg = load_config(given)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert got == expected
    assert isinstance(cfg.gradient_accumulation_steps, int) and cfg.gradient_accumulation_steps >= 1


@pytest.mark.parametrize(
    "given",
    [
        {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
        {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
        {"train_batch_size": 10, "gradient_accumulation_steps": 3},
    ],
)
def test_batch_contradiction_names_the_three_keys(given):
    msg = config_error(given)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert key in msg
    for value in given.values():
        assert f"={value}" in msg


def test_batch_sizes_must_be_positive():
    assert "must be an integer >= 1" in config_error({"train_batch_size": 0})


# -- precision -----------------------------------------------------------------------------------


def test_bf16_and_fp16_conflict():
    msg = config_error({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert "bf16" in msg and "fp16" in msg


def test_compute_dtype():
    import torch

    assert load_config({}).compute_dtype is torch.float32
    assert load_config({"bf16": {"enabled": True}}).compute_dtype is torch.bfloat16
    assert load_config({"bfloat16": {"enabled": True}}).compute_dtype is torch.bfloat16
    cfg = load_config({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}})
    assert cfg.compute_dtype is torch.float16
    assert cfg.fp16.initial_scale_power == 12 and cfg.fp16.hysteresis == 2 and cfg.fp16.min_loss_scale == 1


def test_bf16_has_no_loss_scale():
    assert "unknown config key 'bf16.loss_scale'" in config_error({"bf16": {"enabled": True, "loss_scale": 0}})


# -- optimizer -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "canonical"), [("adamw", "AdamW"), ("AdamW", "AdamW"), ("ADAM", "Adam"),
                                                    ("adam", "Adam"), ("sgd", "SGD"), ("SGD", "SGD")])
def test_optimizer_type_normalised(given, canonical):
    assert load_config({"optimizer": {"type": given}}).optimizer.type == canonical


def test_unknown_optimizer_type_lists_supported():
    msg = config_error({"optimizer": {"type": "Lamb"}})
    assert "optimizer.type" in msg and "'Lamb'" in msg
    assert "AdamW" in msg and "Adam" in msg and "SGD" in msg


def test_weight_decay_defaults_match_torch():
    assert load_config({}).optimizer.params.weight_decay == 0.01
    assert load_config({"optimizer": {"type": "AdamW"}}).optimizer.params.weight_decay == 0.01
    assert load_config({"optimizer": {"type": "Adam"}}).optimizer.params.weight_decay == 0.0
    assert load_config({"optimizer": {"type": "SGD"}}).optimizer.params.weight_decay == 0.0
    explicit = {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.0}}}
    assert load_config(explicit).optimizer.params.weight_decay == 0.0


def test_deepspeed_optimizer_params():
    cfg = load_config({"optimizer": {"type": "Adam", "params": {
        "lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "torch_adam": True, "adam_w_mode": True}}})
    assert cfg.optimizer.type == "AdamW"  # DeepSpeed: Adam + adam_w_mode = AdamW
    assert cfg.optimizer.params.betas == (0.8, 0.99)
    assert cfg.optimizer.torch_kwargs() == {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-6,
                                            "weight_decay": 0.01, "amsgrad": False}
    assert "adam_w_mode" in config_error({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})


def test_sgd_rules():
    cfg = load_config({"optimizer": {"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}})
    assert cfg.optimizer.torch_kwargs() == {"lr": 0.1, "momentum": 0.9, "dampening": 0.0,
                                            "weight_decay": 0.0, "nesterov": True}
    assert "nesterov" in config_error({"optimizer": {"type": "sgd", "params": {"nesterov": True}}})
    msg = config_error({"optimizer": {"type": "sgd", "params": {"momentum": 0.9, "dampening": 0.1, "nesterov": True}}})
    assert "dampening" in msg
    assert "lr must be > 0" in config_error({"optimizer": {"type": "sgd", "params": {"lr": 0}}})
    assert "betas" in config_error({"optimizer": {"type": "sgd", "params": {"betas": [0.9, 0.9]}}})
    assert "momentum" in config_error({"optimizer": {"type": "adamw", "params": {"momentum": 0.9}}})


def test_betas_range():
    msg = config_error({"optimizer": {"params": {"betas": [0.9, 1.5]}}})
    assert msg.startswith("config key 'optimizer.params.betas' must be a list of 2 numbers, each >= 0 and < 1")


# -- no-effect DeepSpeed keys --------------------------------------------------------------------


def test_no_effect_keys_warn_once():
    src = {"zero_optimization": {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e8,
                                 "stage3_gather_16bit_weights_on_model_save": True}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(src)
    ours = [w for w in caught if issubclass(w.category, ZinfConfigWarning)]
    assert len(ours) == 1
    text = str(ours[0].message)
    assert "accepted for DeepSpeed compatibility, no effect in zinf" in text
    for key in src["zero_optimization"]:
        assert key in text
    assert "round_robin_gradients" not in text
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000


def test_no_warning_without_no_effect_keys():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(SEED_1)
        load_config(SEED_3)


def test_every_no_effect_key_is_accepted():
    assert set(ZeroConfig.NO_EFFECT_KEYS) <= set(ZeroConfig.model_fields)
    values = {k: ZeroConfig.model_fields[k].default for k in ZeroConfig.NO_EFFECT_KEYS}
    with pytest.warns(ZinfConfigWarning):
        load_config({"zero_optimization": values})


# -- files ---------------------------------------------------------------------------------------


def test_load_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**SEED_1, **SEED_2}))
    for source in (path, str(path)):
        cfg = load_config(source)
        assert cfg.train_batch_size == 1024 and cfg.aio.queue_depth == 32


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.json"
    msg = config_error(path)
    assert str(path) in msg and "does not exist" in msg


def test_bad_json_gives_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "aio": {"queue_depth": 4,}\n}\n')
    msg = config_error(str(path))
    assert str(path) in msg
    assert "line 3" in msg and "column" in msg


def test_json_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert "must be a JSON object" in config_error(path)


def test_duplicate_json_keys_are_errors(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"aio": {"queue_depth": 4}, "aio": {"queue_depth": 8}}')
    assert "'aio' appears twice" in config_error(path)


def test_error_in_file_names_file_and_key(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"zero_optimization": {"offload_param": {"nvme_pth": "/x"}}}))
    msg = config_error(path)
    assert msg.startswith(f"config file '{path}': unknown config key 'zero_optimization.offload_param.nvme_pth'")
    assert "did you mean 'nvme_path'?" in msg


def test_directory_is_not_a_config(tmp_path):
    assert "directory" in config_error(tmp_path)


# -- derived values ------------------------------------------------------------------------------


def test_nvme_path_fallback():
    cfg = load_config({"zinf": {"nvme_path": "/scratch/swap"},
                       "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/fast"}}})
    assert cfg.param_nvme_path == Path("/scratch/swap")
    assert cfg.optim_nvme_path == Path("/fast")


def test_to_dict_is_json_and_round_trips():
    src = {**SEED_3, "train_batch_size": 64, "train_micro_batch_size_per_gpu": 16,
           "optimizer": {"type": "sgd", "params": {"lr": 0.5, "momentum": 0.9}},
           "zinf": {"placement": {"plan_file": "plans/plan.json"}, "dram_budget": "2GiB"}}
    cfg = load_config(src)
    data = cfg.to_dict()
    text = json.dumps(data)  # JSON-able
    assert data["zero_optimization"]["offload_param"]["nvme_path"] == "/nvme"
    assert data["zinf"]["placement"]["plan_file"] == "plans/plan.json"
    assert data["gradient_accumulation_steps"] == 4
    assert "overlap_comm" not in data["zero_optimization"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_config(json.loads(text))
    assert again == cfg
    assert load_config(load_config({}).to_dict()) == load_config({})
