"""``specdecode conformance``: a correct plugin passes, a broken one (wrong q) fails, bad requests are
one clear line. Plugins come in through ``register_method`` and through ``--plugin MODULE:ATTR``.

Kept fast: the tiny 5-token target, 3 new tokens, 1000-1500 samples per case (the broken plugin's
p-values are below 1e-40 already at 1000).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

import plugin_proposers
from specdecode import cli
from specdecode.errors import ConfigError
from specdecode.methods import REGISTRY, register_method, unregister_method
from specdecode.testing import default_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def registered():
    """Register the given specs for one test; unregister whatever the test added."""
    before = set(REGISTRY)
    yield lambda *specs: [register_method(s) for s in specs]
    for name in set(REGISTRY) - before:
        unregister_method(name)


def run(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(["conformance", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_correct_registered_plugin_passes(registered, capsys):
    registered(plugin_proposers.FIXED_Q)
    rc, out, err = run(capsys, "--method", "plugin-fixed-q", "--samples", "1500", "--alpha", "1e-3")
    assert rc == 0, out + err
    assert out.strip().splitlines()[-1] == "4 passed, 0 failed"
    assert "PASS" in out and "FAIL" not in out and "chain t=0.7 top_k=3" in out
    assert "trees not checked" in out  # the plugin declares no trees


def test_a_broken_registered_plugin_fails(registered, capsys):
    registered(plugin_proposers.WRONG_Q)
    rc, out, err = run(capsys, "--method", "plugin-wrong-q", "--samples", "1500", "--alpha", "1e-3")
    assert rc == 1, out + err
    last = out.strip().splitlines()[-1]
    assert last.endswith("failed") and not last.endswith(" 0 failed") and "FAIL" in out
    assert "1 passed, 3 failed" == last  # greedy identity holds whatever q says; every sampled case fails


@pytest.mark.parametrize("attr, rc", [("FixedQProposer", 0), ("WrongQProposer", 1)])
def test_plugin_classes_by_import_path(attr, rc, capsys):
    code, out, err = run(capsys, "--plugin", f"plugin_proposers:{attr}", "--samples", "1000", "--k", "2")
    assert code == rc, out + err
    assert out.strip().splitlines()[-1] == ("4 passed, 0 failed" if rc == 0 else "1 passed, 3 failed")


def resolve(ref: str):
    return cli.conformance_proposer(argparse.Namespace(method=None, plugin=ref), default_target())


def test_what_a_plugin_reference_may_name(registered):
    assert resolve("plugin_proposers:FixedQProposer").name == "fixed-q"  # a class, built with no arguments
    assert resolve("plugin_proposers:next_token_factory").name == "next-token"  # a factory given the target
    assert resolve("plugin_proposers:WRONG_Q").name == "wrong-q"  # a MethodSpec: registered, then built
    assert "plugin-wrong-q" in REGISTRY
    assert resolve("plugin_proposers:plugin-wrong-q").name == "wrong-q"  # a registered method's name
    for ref, needle in [
        ("no_such_plugin_module:X", "cannot import module 'no_such_plugin_module'"),
        ("plugin_proposers:Nope", "has no attribute 'Nope', and no method 'Nope' is registered"),
        ("plugin_proposers", "MODULE:ATTR"),
        ("plugin_proposers:__doc__", "is a str, not a MethodSpec"),
        ("plugin_proposers:build_fixed_q", "with the tiny target failed"),  # a builder is not a factory
    ]:
        with pytest.raises(ConfigError, match=needle):
            resolve(ref)


@pytest.mark.parametrize(
    "method, needle",
    [
        ("eagle", "method 'eagle' needs trained weights"),
        ("hybrid", "method 'hybrid' needs a trained drafter"),
        ("xtok", "method 'xtok' needs a draft model"),
        ("early-exit", "method 'early-exit' needs a real target model"),
        ("none", "there is no proposer to certify"),
        ("magic", "unknown method 'magic'"),
    ],
)
def test_methods_that_cannot_build_on_the_tiny_target_are_one_error_line(method, needle, capsys):
    rc, out, err = run(capsys, "--method", method)
    assert rc == 2 and err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1


def test_the_command_line_process():
    """The real process: exit status 2 and one line for a method needing weights."""
    here = Path(__file__).resolve().parent
    paths = [str(here.parent / "src"), str(here), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    proc = subprocess.run(
        [sys.executable, "-m", "specdecode.cli", "conformance", "--method", "medusa"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "error: method 'medusa' needs trained weights for a real target, so it cannot be "
        "built on the tiny conformance target; certify it in Python with "
        "specdecode.testing.certify(proposer, target=...)"
    )


def test_bad_numbers_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["conformance", "--method", "ngram", "--alpha", "2"])
    assert exit_.value.code == 2 and "--alpha: must be in (0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["conformance", "--method", "ngram", "--plugin", "a:b"])  # one or the other
    assert "not allowed with argument" in capsys.readouterr().err
