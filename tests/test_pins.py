"""Tests of zinf.pins: the module-name pattern grammar, specificity, and error messages."""

from __future__ import annotations

import pytest

from zinf.config import PinConfig
from zinf.errors import ConfigError
from zinf.pins import PinSet, parse_pattern

BERT_MODULES = (
    ["embeddings", "embeddings.word_embeddings", "encoder", "encoder.layer"]
    + [f"encoder.layer.{i}" for i in range(12)]
    + [f"encoder.layer.{i}.attention.self.query" for i in range(12)]
)


def matches(pattern: str, module: str) -> bool:
    return PinSet.from_config({pattern: "cpu"}).tier_for(module) == "cpu"


@pytest.mark.parametrize(
    ("pattern", "module", "expected"),
    [
        ("encoder.layer[0-2]", "encoder.layer.0", True),
        ("encoder.layer[0-2]", "encoder.layer.2", True),
        ("encoder.layer[0-2]", "encoder.layer.3", False),
        ("encoder.layer[0-2]", "encoder.layer", False),  # the container itself is not in the range
        ("encoder.layer[0-2]", "encoder", False),
        ("encoder.layer[0-2]", "encoder.layer.1.attention.self.query", True),  # descendants
        ("encoder.layer[0-2]", "encoder.layer.10", False),  # whole components, not string prefixes
        ("encoder.layer[0-2]", "bert.encoder.layer.0", False),  # anchored at the root
        ("encoder.layer[0-2]", "encoder.layers.0", False),
        ("encoder.layer[3-]", "encoder.layer.3", True),
        ("encoder.layer[3-]", "encoder.layer.1000", True),
        ("encoder.layer[3-]", "encoder.layer.2", False),
        ("layers[-2]", "layers.0", True),
        ("layers[-2]", "layers.2", True),
        ("layers[-2]", "layers.3", False),
        ("layers[5]", "layers.5", True),
        ("layers[5]", "layers.4", False),
        ("layers[1,3,5]", "layers.3", True),
        ("layers[1,3,5]", "layers.4", False),
        ("layers[1,4-6,9-]", "layers.5", True),
        ("layers[1,4-6,9-]", "layers.7", False),
        ("layers[1,4-6,9-]", "layers.12", True),
        ("layers[0-2]", "layers.x", False),  # an index list only matches integers
        ("blocks[0-1].mlp", "blocks.1.mlp.fc1", True),
        ("blocks[0-1].mlp", "blocks.1.attn", False),
        ("[0-1]", "0", True),  # nn.Sequential root
        ("[0-1]", "2.linear", False),
        ("blocks.*.mlp", "blocks.7.mlp", True),
        ("blocks.*.mlp", "blocks.7.mlp.fc2", True),
        ("blocks.*.mlp", "blocks.7.attn", False),
        ("blocks.*.mlp", "blocks.mlp", False),  # * does not match an absent component
        ("*.experts.*", "moe.experts.3", True),
        ("*.experts.*", "layer.2.experts.3", False),  # * never crosses a dot
        ("*.experts.*", "moe.experts", False),
        ("block?.attn", "block1.attn", True),
        ("block?.attn", "block12.attn", False),
        ("h.*_proj", "h.q_proj", True),
        ("Encoder", "encoder", False),  # case-sensitive, like module names
        ("encoder.layer.0", "encoder.layer.0.output", True),  # plain names work too
    ],
)
def test_pattern_grammar(pattern, module, expected):
    assert matches(pattern, module) is expected


def test_seed_article_pins():
    pins = PinSet.from_config({"encoder.layer[0-2]": {"device": "cpu"}, "encoder.layer[3-]": {"device": "nvme"}})
    assert [pins.tier_for(f"encoder.layer.{i}") for i in range(12)] == ["cpu"] * 3 + ["nvme"] * 9
    assert pins.tier_for("embeddings.word_embeddings") is None
    assert pins.tier_for_param("embeddings.word_embeddings.weight") is None
    assert pins.tier_for_param("encoder.layer.1.attention.self.query.weight") == "cpu"
    assert pins.tier_for_param("encoder.layer.11.output.dense.bias") == "nvme"


def test_most_specific_pattern_wins_regardless_of_order():
    general_first = PinSet.from_config({"encoder": "nvme", "encoder.layer[0-1]": "cpu", "encoder.layer.0.attention": "gpu"})
    specific_first = PinSet.from_config({"encoder.layer.0.attention": "gpu", "encoder.layer[0-1]": "cpu", "encoder": "nvme"})
    for pins in (general_first, specific_first):
        assert pins.tier_for("encoder") == "nvme"
        assert pins.tier_for("encoder.layer.5") == "nvme"
        assert pins.tier_for("encoder.layer.1") == "cpu"
        assert pins.tier_for("encoder.layer.0.output") == "cpu"
        assert pins.tier_for("encoder.layer.0.attention.self") == "gpu"


def test_index_segment_counts_as_a_component():
    # "encoder.layer[1]" (3 components) beats "encoder.*" (2 components).
    pins = PinSet.from_config({"encoder.layer[1]": "cpu", "encoder.*": "nvme"})
    assert pins.tier_for("encoder.layer.1") == "cpu"
    assert pins.tier_for("encoder.layer") == "nvme"


def test_ties_go_to_the_later_pattern():
    pins = PinSet.from_config({"blocks.*.mlp": "cpu", "blocks[0-3].mlp": "nvme"})
    assert pins.tier_for("blocks.2.mlp") == "nvme"
    assert pins.tier_for("blocks.9.mlp") == "cpu"
    reversed_pins = PinSet.from_config({"blocks[0-3].mlp": "nvme", "blocks.*.mlp": "cpu"})
    assert reversed_pins.tier_for("blocks.2.mlp") == "cpu"
    match = reversed_pins.match("blocks.2.mlp.fc1")
    assert match is not None and match.pattern == "blocks.*.mlp"


def test_values_may_be_pinconfig_dict_or_string_and_none_means_gpu():
    pins = PinSet.from_config({"a": PinConfig(device="nvme"), "b": {"device": "CPU"}, "c": "none", "d": "gpu"})
    assert [pins.tier_for(m) for m in "abcd"] == ["nvme", "cpu", "gpu", "gpu"]
    assert len(pins) == 4 and bool(pins)
    assert not PinSet.from_config({}) and PinSet.from_config(None).tier_for("a") is None


@pytest.mark.parametrize("value", ["disk", {"device": "ssd"}, {"devices": "cpu"}, 3, None])
def test_invalid_pin_value(value):
    with pytest.raises(ConfigError) as info:
        PinSet.from_config({"encoder.layer[0]": value})
    assert "'encoder.layer[0]'" in str(info.value) and "nvme" in str(info.value)


@pytest.mark.parametrize(
    ("pattern", "needle"),
    [
        ("encoder.layer[0-2", "without a matching ']'"),
        ("encoder.layer0-2]", "without a matching '['"),
        ("encoder.layer[[0]]", "nested"),
        ("encoder.layer[3-1]", "start > end"),
        ("encoder.layer[]", "not N, N-M"),
        ("encoder.layer[a]", "not N, N-M"),
        ("encoder.layer[1,]", "not N, N-M"),
        ("encoder.layer[-]", "bare '-'"),
        ("encoder.layer[0.5]", "inside an index list"),
        ("encoder.layer[0]x", "after its index list"),
        ("encoder..layer", "empty segment"),
        (".encoder", "empty segment"),
        ("encoder.", "empty segment"),
        ("", "non-empty"),
        ("encoder layer", "whitespace"),
    ],
)
def test_invalid_patterns_name_the_pattern_and_show_an_example(pattern, needle):
    with pytest.raises(ConfigError) as info:
        PinSet.from_config({pattern: "cpu"})
    msg = str(info.value)
    assert f"invalid module pattern {pattern!r}" in msg
    assert needle in msg, msg
    assert "encoder.layer[0-2]" in msg  # a valid example
    with pytest.raises(ConfigError):
        parse_pattern(pattern)


def test_patterns_matching_nothing():
    pins = PinSet.from_config({
        "encoder.layer[0-2]": "cpu",
        "encoder.layer[12-]": "nvme",  # BERT-base has 12 layers: 0..11
        "embedings": "gpu",  # typo
        "encoder.layer.*.attention": "cpu",
    })
    assert pins.patterns_matching_nothing(BERT_MODULES) == ["encoder.layer[12-]", "embedings"]
    assert pins.patterns_matching_nothing([]) == [p.pattern for p in pins]
    # A match on a descendant of a listed module counts too (e.g. only leaf names given).
    assert PinSet.from_config({"encoder.layer[1]": "cpu"}).patterns_matching_nothing(
        ["encoder.layer.1.attention.self.query"]) == []


def test_root_and_top_level_params():
    pins = PinSet.from_config({"*": "cpu"})
    assert pins.tier_for("") is None  # the root module is matched by no pattern
    assert pins.tier_for_param("bias") is None  # a parameter of the root module
    assert pins.tier_for_param("head.weight") == "cpu"


def test_parse_pattern_tokens():
    assert parse_pattern("encoder.layer[0-2,5,7-]") == ("encoder", "layer", ((0, 2), (5, 5), (7, None)))
    assert parse_pattern("[-3]") == (((0, 3),),)
    assert parse_pattern("blocks.*.mlp") == ("blocks", "*", "mlp")
