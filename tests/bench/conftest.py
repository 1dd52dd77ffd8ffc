"""What the bench tests share: one torch thread for a whole module."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def module_one_thread():
    """Tiny models in a whole module: a second intra-op thread only adds synchronisation cost."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
