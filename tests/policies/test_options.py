"""Options: `key=value` strings or a dict into a policy's Options dataclass; every error names
the policy and lists its options with types and defaults."""

from dataclasses import dataclass, field

import pytest

from strata.policies import OptionError, PluginError, load_registry
from strata.policies.options import option_specs, parse_options

LFU_OPTIONS = "the options of policy 'lfu' are: decay: float = 0.95, max_admits: int = 4"


@dataclass(frozen=True)
class Mixed:
    eager: bool = False
    label: str = "x"
    scale: float = field(default=1.0, metadata={"help": "a factor"})


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def test_strings_and_dicts_parse_to_the_field_types(registry):
    policy = registry.create("lfu", ["decay=0.5", "max_admits = 2"])
    assert policy.options.decay == 0.5 and policy.options.max_admits == 2
    assert registry.create("lfu", {"decay": 1, "max_admits": "3"}).options.max_admits == 3
    assert registry.create("lfu").options.decay == 0.95
    parsed = parse_options("p", Mixed, ["eager=yes", "label=a=b", "scale=2"])
    assert parsed == Mixed(eager=True, label="a=b", scale=2.0)
    assert parse_options("p", Mixed, {"eager": False}).eager is False
    assert option_specs(Mixed)[2].help == "a factor"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (["colour=red"], f"policy 'lfu': unknown option 'colour'; {LFU_OPTIONS}"),
        (["max_admits=two"], f"policy 'lfu': option max_admits='two' is not an int; {LFU_OPTIONS}"),
        (["decay=fast"], "option decay='fast' is not a float"),
        ({"max_admits": 2.0}, "option max_admits=2.0 is not an int"),
        ({"max_admits": True}, "option max_admits=True is not an int"),
        (["decay"], f"policy 'lfu': option 'decay' is not key=value; {LFU_OPTIONS}"),
        (["decay=0.5", "decay=0.6"], "policy 'lfu': option 'decay' is given twice"),
        (["decay=2"], f"policy 'lfu': decay must be in (0, 1], got 2.0; {LFU_OPTIONS}"),
        (["max_admits=-1"], "policy 'lfu': max_admits must be >= 0, got -1"),
    ],
)
def test_bad_options_name_the_policy_and_list_its_options(registry, given, message):
    with pytest.raises(OptionError) as caught:
        registry.create("lfu", given)
    assert message in str(caught.value)


def test_a_policy_without_options_says_so(registry):
    with pytest.raises(OptionError, match="unknown option 'x'; policy 'static' takes no options"):
        registry.create("static", ["x=1"])


def test_a_bool_option_takes_only_bool_words():
    with pytest.raises(OptionError, match="option eager='maybe' is not a bool"):
        parse_options("p", Mixed, ["eager=maybe"])


def test_an_options_class_that_cannot_be_filled_is_the_plugin_s_error():
    @dataclass(frozen=True)
    class ListOption:
        sizes: list = field(default_factory=list)

    @dataclass(frozen=True)
    class NoDefault:
        size: int

    with pytest.raises(PluginError, match="option 'sizes' has type <class 'list'>"):
        option_specs(ListOption, "p")
    with pytest.raises(PluginError, match="option 'size' has no default"):
        option_specs(NoDefault, "p")
    with pytest.raises(PluginError, match="Options must be a dataclass"):
        option_specs(dict, "p")


def test_a_policy_made_directly_takes_a_dict_too():
    from strata.policies.builtin.lfu import Lfu

    assert Lfu({"decay": 0.5}).options.decay == 0.5
    assert Lfu(["max_admits=2"]).options.max_admits == 2
    assert Lfu().options == Lfu.Options()
    with pytest.raises(OptionError, match="policy 'lfu': unknown option 'x'"):
        Lfu({"x": 1})
    with pytest.raises(TypeError, match="Lfu takes a LfuOptions, a dict or key=value strings"):
        Lfu(0.5)
