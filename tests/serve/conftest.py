"""Fixtures of the serve tests (the servers and models are in serving.py)."""

from __future__ import annotations

import pytest

from serving import save_chat_model, start_server
from specdecode.models.loading import load_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-serve")
    save_chat_model(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_loaded):
    live = start_server(tiny_loaded)
    yield live
    live.stop()
