"""Built-in models (a GPT, a mixture-of-experts GPT, a BERT-like encoder) and synthetic data.

    model, cfg = build_model("gpt", "tiny", n_layer=2)   # preset, then field overrides

Presets (parameter counts for vocab 256; median time of one plain-PyTorch fwd + bwd + AdamW step
at batch 8 x 64 tokens, fp32, on 2 pinned cores of a Xeon server, torch 2.11; a 2-core EPYC VM
is about the same when quiet, ~20 ms per million dense parameters):

=========  ===========================  ===========================  ===========================
preset     gpt                          moe (8 experts, top-1)       encoder (12 layers)
=========  ===========================  ===========================  ===========================
tiny       0.83 M, ~25 ms               0.58 M, ~20 ms               0.62 M, ~40 ms
small      6.4 M, ~0.12 s               6.8 M, ~70 ms                5.4 M, ~0.12 s
demo       14.6 M, ~0.3 s               35.9 M, ~0.23 s              14.9 M, ~0.24 s
=========  ===========================  ===========================  ===========================

"tiny" is for tests, "small" for quick experiments, "demo" for ``zinf demo``: its fp32 training
state (param + grad + Adam m and v = 16 bytes/param) is ~230 MB for the GPT, enough for offloading
to matter, while a step stays well under 0.5 s on 2 CPU cores. (A dense GPT step costs about
6 x params x tokens FLOPs, so 20 M parameters would already take ~0.3-0.45 s there.)

Every model follows zinf's rule: each parameter is used only inside the forward of the module that
directly owns it (``tests/test_models.py`` checks it mechanically for every model).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from zinf.errors import ConfigError
from zinf.models.encoder import EncoderClassifier, EncoderConfig
from zinf.models.gpt import GPT, GPTConfig
from zinf.models.moe import MoEConfig, MoETransformer

__all__ = [
    "GPT", "GPTConfig", "MoETransformer", "MoEConfig", "EncoderClassifier", "EncoderConfig",
    "PRESETS", "build_model", "freeze",
]

# name -> (model class, config class, {preset -> config fields that differ from the defaults})
PRESETS: dict[str, tuple[type[nn.Module], type, dict[str, dict]]] = {
    "gpt": (GPT, GPTConfig, {
        "tiny": {},  # the GPTConfig defaults: 4 layers x 128 wide
        "small": dict(n_layer=8, n_head=8, n_embd=256),
        "demo": dict(n_layer=6, n_head=7, n_embd=448),  # 7 heads of 64
    }),
    "moe": (MoETransformer, MoEConfig, {
        "tiny": dict(n_layer=2, n_head=4, n_embd=64),
        "small": dict(n_layer=6, n_head=4, n_embd=128),
        "demo": dict(n_layer=8, n_head=8, n_embd=256),
    }),
    "encoder": (EncoderClassifier, EncoderConfig, {
        "tiny": {},  # the EncoderConfig defaults: 12 layers x 64 wide
        "small": dict(hidden=192, n_head=4),
        "demo": dict(hidden=320, n_head=5),  # 5 heads of 64
    }),
}


def build_model(name: str, preset: str = "tiny", **overrides) -> tuple[nn.Module, object]:
    """Build a built-in model: ``name`` in "gpt", "moe", "encoder"; ``preset`` in "tiny", "small",
    "demo"; ``overrides`` replace config fields (e.g. ``router="fixed"``). Returns (model, config).
    Initialisation uses torch's global RNG: call ``torch.manual_seed`` first for a reproducible model."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model {name!r}; valid names: {', '.join(PRESETS)}")
    model_cls, cfg_cls, presets = PRESETS[name]
    if preset not in presets:
        raise ConfigError(f"unknown preset {preset!r} for model {name!r}; valid presets: {', '.join(presets)}")
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"unknown {cfg_cls.__name__} field(s) {', '.join(unknown)}; "
                          f"valid fields: {', '.join(sorted(fields))}")
    cfg = cfg_cls(**{**presets[preset], **overrides})
    return model_cls(cfg), cfg


def freeze(module: nn.Module, prefix: str) -> list[str]:
    """Set ``requires_grad=False`` on every parameter whose name starts with ``prefix`` (e.g.
    ``"blocks.0."``; a tied parameter matches under any of its names). Returns the names frozen;
    raises ConfigError when none matches, which is almost always a typo."""
    names = [n for n, p in module.named_parameters(remove_duplicate=False) if n.startswith(prefix)]
    if not names:
        tops = sorted({n.split(".")[0] for n, _ in module.named_parameters()})
        raise ConfigError(f"freeze: no parameter name starts with {prefix!r}; top-level names: {', '.join(tops)}")
    for n, p in module.named_parameters(remove_duplicate=False):
        if n.startswith(prefix):
            p.requires_grad_(False)
    return names
