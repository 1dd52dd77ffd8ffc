"""A quantized model's tensors saved once in its GGUF's cache folder, so later loads skip
dequantizing and re-quantizing (about a minute for a 1.5B model on 2 cores)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specdecode.models import hugepages
from specdecode.models.quant import INT4_GROUP, QuantMatrix

FORMAT = 4  # bump when the stored layout changes (2: w4a8 tiles of 32 columns; 4: quantized embeddings)

Slots = dict[str, "torch.Tensor | QuantMatrix | None"]


def store_path(folder: Path, kind: str) -> Path:
    """Where ``kind``'s tensors live: the name holds what the packed layout may depend on."""
    tag = f"{FORMAT}-{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}-g{INT4_GROUP}"
    return Path(folder) / f"weights-{kind}-{tag.replace('+', '_')}.pt"


def save(slots: Slots, path: Path) -> None:
    """Write named tensors and quantized matrices (``None`` slots are left out) atomically."""
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, dict] = {}
    for name, value in slots.items():
        if isinstance(value, QuantMatrix):
            layout[name] = {"kind": value.kind, "shape": list(value.shape), "parts": len(value.tensors)}
            for i, t in enumerate(value.tensors):
                tensors[f"{name}.{i}"] = t
        elif value is not None:
            layout[name] = {"kind": "dense"}
            tensors[name] = value
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        torch.save({"layout": json.dumps(layout), "tensors": tensors}, tmp)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only cache only costs a re-quantization next time


def load(path: Path) -> Slots | None:
    """The slots saved at ``path``, or None when there is no readable store.

    Where huge pages are on (:mod:`hugepages`) the file is memory-mapped and each tensor copied
    into one huge-page arena, its file pages dropped as it is copied, so the peak is the model
    once. Otherwise ``torch.load`` without a memory map reads each tensor into its own aligned
    allocation (a memory-mapped safetensors file counted twice, and torch's int8 kernel crashed on
    one of its unaligned tensors). ``weights_only``
    refuses anything but tensors and plain containers.
    """
    if not path.exists():
        return None
    mapped = hugepages.available()  # read through a file mapping straight into huge pages
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
        layout, tensors = json.loads(data["layout"]), data["tensors"]
        arena = hugepages.Arena.sized_for(tensors.values())
        if arena is not None:
            tensors = {k: arena.take(t, drop_source=True) for k, t in tensors.items()}
        slots: Slots = {}
        for name, entry in layout.items():
            if entry["kind"] == "dense":
                slots[name] = tensors.pop(name)
            else:
                parts = tuple(tensors.pop(f"{name}.{i}") for i in range(entry["parts"]))
                slots[name] = QuantMatrix(entry["kind"], tuple(entry["shape"]), parts)
    except Exception:  # noqa: BLE001 - any unreadable store (truncated, another format) is re-made
        return None
    return slots
