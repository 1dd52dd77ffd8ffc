"""The package's import rules, read from the source with ``ast`` (function-level imports included).

core -> (nothing of ours) ; models -> core ; networks -> core, models ; proposers -> core, models,
networks ; engine ; entry points (api, cli, bench, train, ...) on top. Runtime code never imports
``specdecode.train``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "specdecode"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every ``specdecode`` module a file imports, at any depth (``from a import b`` also yields
    ``a.b``: b may be a submodule)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base != "specdecode":
                out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in out if m == "specdecode" or m.startswith("specdecode.")}


MODULES = {module_name(p): imported(p) for p in sorted(PACKAGE.rglob("*.py"))}


def within(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def offenders(layer: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """Imports of ``layer``'s modules that leave ``allowed`` (the layer itself always allowed)."""
    bad = {}
    for module, deps in MODULES.items():
        if within(module, layer):
            wrong = sorted(d for d in deps if not within(d, layer, *allowed) and d != "specdecode")
            if wrong:
                bad[module] = wrong
    return bad


def test_the_scan_sees_the_package():
    assert {
        "specdecode.core.verify",
        "specdecode.models.native",
        "specdecode.networks.eagle_head",
        "specdecode.proposers.eagle",
        "specdecode.api",
        "specdecode.train.trainer",
    } <= set(MODULES)
    assert "specdecode.networks.storage" in MODULES["specdecode.proposers.eagle"]


def test_errors_is_a_leaf():
    assert offenders("specdecode.errors", ()) == {}


def test_core_imports_nothing_of_ours():
    # Adjusted: core may raise specdecode.errors.ConfigError (bad sampling settings) -- errors is a
    # leaf importing nothing (test_errors_is_a_leaf), so core still depends on no other layer.
    assert offenders("specdecode.core", ("specdecode.errors",)) == {}


def test_models_import_only_core_and_errors():
    assert offenders("specdecode.models", ("specdecode.core", "specdecode.errors")) == {}


def test_networks_import_only_core_models_and_errors():
    assert offenders("specdecode.networks", ("specdecode.core", "specdecode.models", "specdecode.errors")) == {}


def test_only_entry_points_import_train():
    allowed = ("specdecode.train", "specdecode.cli", "specdecode.bench")
    bad = {
        m: sorted(d for d in deps if within(d, "specdecode.train"))
        for m, deps in MODULES.items()
        if not within(m, *allowed)
    }
    assert {m: d for m, d in bad.items() if d} == {}


@pytest.mark.parametrize("layer", ["specdecode.proposers"])
def test_proposers_never_import_entry_points_or_the_engine(layer):
    forbidden = (
        "specdecode.engine",
        "specdecode.api",
        "specdecode.cli",
        "specdecode.bench",
        "specdecode.serve",
        "specdecode.builders",
        "specdecode.testing",
    )
    bad = {m: sorted(d for d in deps if within(d, *forbidden)) for m, deps in MODULES.items() if within(m, layer)}
    assert {m: d for m, d in bad.items() if d} == {}


def test_methods_is_light():
    """The CLI reads the method registry before torch: methods.py imports only the stdlib and errors."""
    tree = ast.parse((PACKAGE / "methods.py").read_text(encoding="utf-8"))
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            top.add(node.module if node.module.startswith("specdecode") else node.module.split(".")[0])
    assert {m for m in top if m not in sys.stdlib_module_names} == {"specdecode.errors"}, top
    assert offenders("specdecode.methods", ("specdecode.errors",)) == {}
