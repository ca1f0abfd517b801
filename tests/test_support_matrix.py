"""The support matrix (tests/support_matrix.py, `make support-matrix`) cannot go stale: its record covers every
causal LM of the installed transformers, no family differs or fails by default, the gate's checked set holds every
family the matrix finds exact, docs/model-families.md's table is the record's, and one family of the record is
judged again here (and one the gate refuses is refused in one line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.families import CHECKED_FAMILIES
from tests import support_matrix as matrix
from tests.helpers import run_ranks, tiny_config

RECORD = json.loads(matrix.RECORD.read_text())
ROWS = RECORD["families"]
REGENERATE = "run `make support-matrix` (or `python -m tests.support_matrix MODEL_TYPE` for one family)"


def test_the_record_covers_every_causal_lm_of_the_installed_transformers():
    assert RECORD["transformers"] == transformers.__version__, REGENERATE
    assert set(ROWS) == set(matrix.causal_lm_families()), REGENERATE
    assert {name: row["class"] for name, row in ROWS.items()} == matrix.causal_lm_families()


def test_no_family_differs_or_fails_by_default_and_every_exact_one_is_checked():
    assert [name for name, row in ROWS.items() if row["default"] in matrix.JUDGED_FAILURES] == []
    assert sorted({name for name, row in ROWS.items() if row["status"] == "exact"} - CHECKED_FAMILIES) == [], (
        "the gate refuses a family the matrix finds exact: add it to qlora_fsdp.families.CHECKED_FAMILIES")
    defaults = {name: matrix.by_default(name, row) for name, row in ROWS.items()}
    assert {name: row["default"] for name, row in ROWS.items()} == defaults, (
        "CHECKED_FAMILIES changed: `python -m tests.support_matrix --defaults`")
    assert matrix.counts(ROWS)["exact"] >= 60  # the figure docs/model-families.md reports, not a handful


def test_the_docs_table_is_the_records():
    assert matrix.docs_table(RECORD) in matrix.DOCS.read_text(), REGENERATE


def _judged(info, model_type: str, work: Path) -> dict:
    return matrix.judge(model_type, work)


@pytest.mark.slow  # a pool rank
def test_a_family_judged_again_gives_its_record(tmp_path):
    row = run_ranks(_judged, 1, "llama", tmp_path / "llama", tmp_dir=tmp_path)[0]
    assert row["status"] == ROWS["llama"]["status"] == "exact"
    assert row["ours"] == pytest.approx(ROWS["llama"]["ours"], abs=2e-6)


def test_a_family_not_checked_is_refused_at_load_in_one_line_unless_asked_for(tmp_path):
    from qlora_fsdp.loading.checkpoint import load_hf_config

    unchecked = sorted(name for name, row in ROWS.items() if name not in CHECKED_FAMILIES
                       and row["status"] != "not built")[0]
    model_dir = matrix.tiny_model(unchecked, tmp_path / unchecked)
    with pytest.raises(ModelLoadError, match=r"model\.unchecked_family=true") as refused:
        load_hf_config(tiny_config(model_dir))
    assert "\n" not in str(refused.value) and str(refused.value).startswith(f"{unchecked}: ")
    cfg = tiny_config(model_dir, model={"unchecked_family": True})
    assert load_hf_config(cfg).model_type == unchecked  # past the gate
