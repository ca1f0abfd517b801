import os

import pytest

from tests.helpers import build_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """The embedded default exactly as `make tiny-model` builds it (4 layers)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("demo") / "tiny-llama", layers=4)
