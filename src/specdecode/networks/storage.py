"""Where trained drafters live and how their files are read and written.

A drafter folder holds ``model.safetensors`` (the module's own tensors, its config in the
metadata) and ``card.json`` (how it was trained, what it measured). Drafters shipped with the
package sit under ``specdecode/drafters/<target>/<kind>/``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from specdecode.errors import ModelLoadError

DRAFTERS_DIR = Path(__file__).resolve().parent.parent / "drafters"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "card.json"


def drafter_name(source: str | Path) -> str:
    """The drafter folder name of a model folder, without the cache's hash and the file's
    quantization: 'SmolLM2-135M-Instruct.Q4_1-<hash>' -> 'smollm2-135m-instruct',
    'qwen2.5-coder-1.5b-instruct-q4_k_m-<hash>' -> 'qwen2.5-coder-1.5b-instruct'."""
    name = re.sub(r"-[0-9a-f]{12}$", "", Path(str(source)).name)  # the cache folder's hash
    return re.sub(r"[.-](i?q\d\w*|f16|f32|bf16)(-[0-9a-f]+)?$", "", name, flags=re.IGNORECASE).lower()


def shipped_head_dir(source: str | Path, kind: str = "eagle") -> Path:
    """The folder of the ``kind`` drafter shipped for the target loaded from ``source``."""
    return DRAFTERS_DIR / drafter_name(source) / kind


def save_head(head: nn.Module, folder: str | Path, card: dict, dtype: torch.dtype = torch.float16) -> Path:
    """Write the head's own tensors (``dtype``) and its JSON card into ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"config": json.dumps(asdict(head.cfg))})
    digest = hashlib.sha256((folder / WEIGHTS_FILE).read_bytes()).hexdigest()
    card = dict(card, config=asdict(head.cfg), weights_sha256=digest, weights_dtype=str(dtype).replace("torch.", ""))
    (folder / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    return folder


def load_head(folder: str | Path, kind: type[nn.Module] | None = None) -> tuple[nn.Module, dict]:
    """The drafter (float32, eval mode) and its card from a folder written by :func:`save_head`.

    ``kind`` is the module class (default :class:`EagleHead`); its ``config_class`` parses the
    stored config.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    if kind is None:
        from specdecode.networks.eagle_head import EagleHead

        kind = EagleHead
    folder = Path(folder)
    path = folder / WEIGHTS_FILE
    if not path.exists():
        raise ModelLoadError(f"no trained {kind.__name__} at {folder} (missing {WEIGHTS_FILE})")
    with safe_open(str(path), "pt") as f:
        cfg = kind.config_class(**json.loads(f.metadata()["config"]))
    head = kind(cfg)
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    head.load_state_dict(tensors)
    card_path = folder / CARD_FILE
    card = json.loads(card_path.read_text()) if card_path.exists() else {}
    return head.eval(), card
