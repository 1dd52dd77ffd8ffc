"""Optional ``torch.compile`` for the native decoder, with a clean fallback to eager."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from specdecode.models.native import NativeCausalLM


def compiled_decoder(model: "NativeCausalLM") -> Callable[..., torch.Tensor] | None:
    """A compiled drop-in for ``native._decoder`` on ``model``, or None if it fails to compile.

    Compiles eagerly on small shapes (prefill, 1-token decode, a k-token verify) so a broken
    toolchain is found at load time; a later failure (a new shape that will not compile) switches
    that model back to eager for good instead of failing the request.
    """
    from specdecode.models import native

    try:
        compiled = torch.compile(native._decoder, dynamic=True)
        _warm_up(model, compiled)
    except Exception as exc:  # inductor raises many types (missing compiler, lowering errors)
        warnings.warn(f"torch.compile failed, using eager: {type(exc).__name__}: {exc}", stacklevel=2)
        return None
    state = {"fn": compiled}

    def run(*args: Any) -> torch.Tensor:
        try:
            return state["fn"](*args)
        except Exception as exc:
            if state["fn"] is native._decoder:
                raise
            warnings.warn(f"compiled forward failed, using eager from now on: {exc}", stacklevel=2)
            state["fn"] = native._decoder
            return native._decoder(*args)

    return run


def _warm_up(model: "NativeCausalLM", fn: Callable[..., torch.Tensor]) -> None:
    """Run prefill, decode and verify shapes through ``fn`` so compilation happens now."""
    saved = model._decoder
    model._decoder = fn
    try:
        cache = model.new_cache(16)
        for n in (7, 1, 4, 1):
            model.forward(torch.zeros(1, n, dtype=torch.long), cache)
    finally:
        model._decoder = saved
