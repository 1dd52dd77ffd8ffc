import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # for ``helpers``
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from specdecode.runtime import free_cores  # noqa: E402

# Threads that outnumber free cores stall at every OpenMP barrier on a busy 2-core machine.
torch.set_num_threads(free_cores())


@pytest.fixture
def one_thread():
    """Tiny models: a second intra-op thread only adds synchronisation cost."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
