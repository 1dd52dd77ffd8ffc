"""The method registry: built-ins, the plugin API, option checking, and its readers (API, CLI, bench)."""

from __future__ import annotations

import inspect

import pytest

import plugin_proposers
from specdecode import methods
from specdecode.api import make_proposer
from specdecode.errors import ConfigError
from specdecode.methods import MethodSpec, method_names, method_spec, register_method, unregister_method

BUILT_IN = ("auto", "none", "draft", "ngram", "suffix", "xtok", "lookahead", "early-exit", "eagle", "medusa", "hybrid")


@pytest.fixture
def plugin():
    """The fixed-q plugin registered for one test."""
    spec = register_method(plugin_proposers.FIXED_Q)
    yield spec
    unregister_method(spec.name)


def test_built_in_methods_and_the_older_names():
    assert method_names() == BUILT_IN and tuple(methods.REGISTRY) == BUILT_IN
    assert methods.METHODS == BUILT_IN
    assert tuple(methods.TRAINED) == ("eagle", "medusa", "draft")
    assert tuple(methods.COMPOSED) == ("hybrid",) and tuple(methods.TREE_ONLY) == ("lookahead",)
    assert tuple(methods.CONFIDENCE_METHODS) == ("draft", "eagle", "medusa", "hybrid")
    assert methods.FALLBACK == "ngram" and methods.TRAINED + methods.COMPOSED == ("eagle", "medusa", "draft", "hybrid")
    assert all(spec.description for spec in methods.REGISTRY.values())
    assert method_spec("xtok").needs_draft and method_spec("xtok").uses_draft and method_spec("draft").uses_draft
    assert method_spec("hybrid").uses_draft and not method_spec("hybrid").needs_draft  # a draft model, if given
    assert not any(method_spec(m).uses_draft for m in ("eagle", "medusa", "ngram"))


def test_registry_is_read_only():
    with pytest.raises(TypeError):
        methods.REGISTRY["mine"] = method_spec("ngram")  # type: ignore[index]


def test_register_a_plugin(plugin):
    assert method_names()[-1] == "plugin-fixed-q" and "plugin-fixed-q" in methods.METHODS
    with pytest.raises(ConfigError, match="already registered"):
        register_method(plugin_proposers.FIXED_Q)
    with pytest.raises(ConfigError, match="already registered"):
        register_method(MethodSpec("ngram", "plugin_proposers:build_fixed_q"))
    replaced = register_method(
        MethodSpec("plugin-fixed-q", "plugin_proposers:build_fixed_q", {"peak"}, confidence=True), replace=True
    )
    assert method_spec("plugin-fixed-q") is replaced and "plugin-fixed-q" in methods.CONFIDENCE_METHODS


def test_unregister():
    register_method(MethodSpec("plugin-tmp", "plugin_proposers:build_fixed_q"))
    unregister_method("plugin-tmp")
    assert "plugin-tmp" not in method_names()
    with pytest.raises(ConfigError, match="unknown method 'plugin-tmp'"):
        unregister_method("plugin-tmp")


@pytest.mark.parametrize(
    "name, builder, options, needle",
    [
        ("Mine", "m:f", (), "lower-case"),
        ("a+tree", "m:f", (), "lower-case"),
        ("mine", "no_colon", (), "'module:function'"),
        ("mine", "m:", (), "'module:function'"),
        ("mine", "m:f", "peak", "set of names"),
    ],
)
def test_malformed_specs_are_refused(name, builder, options, needle):
    with pytest.raises(ConfigError, match=needle):
        MethodSpec(name, builder, options)
    with pytest.raises(ConfigError, match="takes a MethodSpec"):
        register_method("ngram")  # type: ignore[arg-type]


def test_make_proposer_dispatches_through_the_registry(plugin):
    from helpers import MarkovLM
    from specdecode.models.loading import LoadedModel

    assert make_proposer("ngram", None, max_ngram=2).max_ngram == 2
    assert make_proposer("lookahead", None, window=3).window_size == 3
    assert make_proposer("none", None) is None
    target = LoadedModel(model=MarkovLM(5, seed=0), tokenizer=None, source="tiny")
    proposer = make_proposer("plugin-fixed-q", target, peak=0.6)
    assert proposer.name == "fixed-q" and float(proposer.q[0]) == pytest.approx(0.6)


@pytest.mark.parametrize(
    "method, options, needle",
    [
        (
            "ngram",
            {"max_ngrm": 2},
            r"method 'ngram' does not take option 'max_ngrm' \(did you mean 'max_ngram'\?\); "
            r"it accepts: max_ngram, min_ngram",
        ),
        ("suffix", {"depth": 3, "use_corpus": False}, r"'depth'.*it accepts: corpus, count_depth, max_depth"),
        ("lookahead", {"windows": 3}, r"'windows'.*it accepts: max_per_key, ngram, window"),
        ("none", {"k": 3}, r"method 'none' does not take option 'k'; it accepts: none"),
        ("hybrid", {"min_mach": 2}, r"method 'hybrid' does not take option 'min_mach'.*min_match"),
        (
            "eagle",
            {"confidence": 0.3, "brnch": 2},
            r"options 'brnch', 'confidence'.*it accepts: branch, confidence_threshold, path",
        ),
    ],
)
def test_a_misspelt_option_is_a_config_error_naming_it(method, options, needle):
    with pytest.raises(ConfigError, match=needle):
        make_proposer(method, None, **options)


def test_unknown_method_and_unimportable_builder():
    with pytest.raises(ConfigError, match="unknown method 'magic'; choose one of auto, none"):
        make_proposer("magic", None)
    register_method(MethodSpec("plugin-missing", "no_such_module_xyz:build"))
    try:
        with pytest.raises(ConfigError, match="cannot import its builder 'no_such_module_xyz:build'"):
            make_proposer("plugin-missing", None)
    finally:
        unregister_method("plugin-missing")


def test_built_in_options_match_the_proposers():
    """Each built-in's declared options are exactly its proposer's keyword parameters, plus what
    the builder itself consumes."""
    from specdecode.proposers.draft_model import DraftModelProposer
    from specdecode.proposers.eagle import EagleProposer
    from specdecode.proposers.early_exit import EarlyExitProposer
    from specdecode.proposers.lookahead import LookaheadProposer
    from specdecode.proposers.medusa import MedusaProposer
    from specdecode.proposers.ngram import NgramProposer
    from specdecode.proposers.suffix import SuffixProposer
    from specdecode.proposers.xtok import CrossTokenizerProposer

    def keywords(cls, skip=()):
        params = inspect.signature(cls.__init__).parameters.values()
        return {p.name for p in params if p.default is not p.empty and p.name not in skip}

    draft_model = keywords(DraftModelProposer)
    expected = {
        "ngram": keywords(NgramProposer),
        "suffix": keywords(SuffixProposer),
        "lookahead": keywords(LookaheadProposer),
        "draft": draft_model | {"dtype", "vocab"},  # vocab: the builder cuts the draft's head
        "xtok": keywords(CrossTokenizerProposer) | {"dtype"},
        # the rest of its options go to DraftModelProposer, but for a window: it reads the target's cache
        # and its head is the target's own, whole: no context columns to add
        "early-exit": keywords(EarlyExitProposer) | draft_model - {"prompt_window", "context_vocab"},
        "eagle": keywords(EagleProposer, skip={"head"}),
        "medusa": keywords(MedusaProposer, skip={"heads"}),
        "none": set(),
    }
    expected["hybrid"] = (
        {"min_match", "max_ngram", "lookup", "drafter"} | expected["eagle"] | expected["medusa"] | expected["draft"]
    )
    for name, options in expected.items():
        assert method_spec(name).options == options, name
    assert method_spec("auto").options is None  # forwarded to the method auto picks


def test_built_in_builders_are_runtime_code():
    for spec in methods.REGISTRY.values():
        assert spec.builder.startswith("specdecode.builders:")
        spec.load_builder()


def test_cli_and_bench_accept_a_plugin_registered_first(plugin):
    from specdecode import cli
    from specdecode.bench.runner import _methods

    args = cli.build_parser().parse_args(["generate", "hi", "--method", "plugin-fixed-q"])
    assert args.method == "plugin-fixed-q"
    assert _methods("none,plugin-fixed-q,plugin-fixed-q+tree") == ["none", "plugin-fixed-q", "plugin-fixed-q+tree"]
    with pytest.raises(ConfigError, match="chains stop on confidence"):
        _methods("plugin-fixed-q+conf")
    with pytest.raises(ConfigError, match="unknown method 'plugin-wrong-q'"):
        _methods("plugin-wrong-q")


def test_bench_needs_a_draft_for_methods_that_need_one():
    from specdecode.bench.runner import parse_options

    with pytest.raises(ConfigError, match="'xtok' needs a draft model"):
        parse_options(["--out", "x", "--methods", "none,xtok"])


def test_the_generator_runs_a_registered_plugin(tmp_path):
    from helpers import save_tiny_llama
    from specdecode.api import SpeculativeGenerator

    save_tiny_llama(tmp_path / "tiny")
    register_method(MethodSpec("plugin-next", "plugin_proposers:build_next_token", description="next tokens"))
    try:
        gen = SpeculativeGenerator(str(tmp_path / "tiny"), method="plugin-next", k=3)
        out = gen.generate([5, 6, 7, 5, 6], max_new_tokens=12)
        plain = SpeculativeGenerator(gen.target, method="none").generate([5, 6, 7, 5, 6], max_new_tokens=12)
        assert out.stats["method"] == "next-token" and out.token_ids == plain.token_ids
        with pytest.raises(ConfigError, match="'plugin-next' does not take option 'depth'"):
            SpeculativeGenerator(gen.target, method="plugin-next", depth=2)
    finally:
        unregister_method("plugin-next")
