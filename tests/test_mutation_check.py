"""tests/mutation_check.py checks its whole list before planting anything: a snippet found twice or not at all, a
planted file that does not compile, a guarding test that does not exist, a quick entry's test in the slow lane; and
only a failed assertion counts as a catch. (Whether each bug is caught is the check's own run: `make
mutation-check`.)"""

from __future__ import annotations

import json

from tests import mutation_check
from tests.mutation_check import Mutation, list_problems


def test_every_planted_bug_of_the_list_can_be_planted():
    assert list_problems(mutation_check.MUTATIONS) == []


def test_a_list_that_cannot_be_planted_is_refused_before_anything_is_planted(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mutation_check, "REPO", tmp_path)
    code = tmp_path / "code.py"
    code.write_text("x = 1\nx = 1\ny = 2\n")
    (tmp_path / "test_code.py").write_text("def test_y():\n    pass\n")

    def entry(original: str, planted: str = "z = 3\n", test: str = "test_code.py::test_y") -> Mutation:
        return Mutation("a bug", "code.py", original, planted, test)

    assert list_problems([entry("y = 2\n")]) == []
    assert list_problems([entry("x = 1\n")]) == [
        "'a bug': code.py holds its snippet 2 times, not once; update the entry"]
    assert "holds its snippet 0 times" in list_problems([entry("w = 0\n")])[0]
    assert "the planted code.py does not compile" in list_problems([entry("y = 2\n", "y = (\n")])[0]
    assert list_problems([entry("y = 2\n", test="test_code.py::test_w")]) == ["'a bug': no test test_code.py::test_w"]
    assert list_problems([entry("y = 2\n"), entry("y = 2\n")]) == ["'a bug' names two entries"]

    monkeypatch.setattr(mutation_check, "MUTATIONS", [entry("y = 2\n"), entry("x = 1\n")])
    assert mutation_check.main(["--quick"]) == 2  # a stale entry outside the chosen set counts too
    assert "holds its snippet 2 times" in capsys.readouterr().err
    assert code.read_text() == "x = 1\nx = 1\ny = 2\n"


PLANTED = '''
import pytest

from tests.rank_pool import RanksFailed


@pytest.fixture
def broken():
    raise RuntimeError("setup broke")


def test_assertion():
    assert 1 == 2


def test_did_not_raise():
    with pytest.raises(ValueError):
        pass


def test_rank_assertion():
    raise RanksFailed("f failed on 2 of 2 ranks", [True, False])  # a rank asserted, its peer lost the group


def test_crash():
    [][1]


def test_setup(broken):
    pass


def test_rank_crash():
    raise RanksFailed("f failed on 2 of 2 ranks", [False, False])


def test_passes():
    pass
'''


def test_only_a_failed_assertion_counts_as_a_catch(tmp_path):
    """The checker's verdict on what tests/mutation_outcomes.py records of real pytest runs: an assertion (a rank's
    too, and pytest.raises' DID NOT RAISE) is a catch; an exception in the call, a setup or collection error, a crashed
    rank and a pass are not."""
    import pytest

    from tests.mutation_outcomes import OutcomeRecorder

    (tmp_path / "test_planted.py").write_text(PLANTED)
    (tmp_path / "test_unimportable.py").write_text("import a_module_that_is_not_there\n\n\ndef test_x():\n    pass\n")
    records = tmp_path / "outcomes.jsonl"
    for file in ("test_planted.py", "test_unimportable.py"):
        pytest.main(["-q", "-p", "no:cacheprovider", "--import-mode=importlib", str(tmp_path / file)],
                    plugins=[OutcomeRecorder(records)])
    outcomes = [json.loads(line) for line in records.read_text().splitlines()]

    def judged(name: str) -> tuple[bool, str]:
        mine = [o for o in outcomes if o["test"].endswith(name)]
        return mutation_check.verdict(int(any(o["outcome"] == "failed" for o in mine)), "", mine)

    caught = {name: judged(name)[0] for name in ("::test_assertion", "::test_did_not_raise", "::test_rank_assertion",
                                                 "::test_crash", "::test_setup", "::test_rank_crash", "::test_passes",
                                                 "test_unimportable.py")}
    assert caught == {"::test_assertion": True, "::test_did_not_raise": True, "::test_rank_assertion": True,
                      "::test_crash": False, "::test_setup": False, "::test_rank_crash": False,
                      "::test_passes": False, "test_unimportable.py": False}
    assert judged("::test_crash")[1].startswith("ERROR, not an assertion: call error (IndexError)")
    assert judged("::test_setup")[1].startswith("ERROR, not an assertion: setup error (RuntimeError)")
    assert judged("test_unimportable.py")[1].startswith("ERROR, not an assertion: collect error")
    assert judged("::test_passes")[1] == "MISSED"
    assert mutation_check.verdict(None, "", [])[0] is False  # a hang is no catch either


def test_a_quick_entry_must_name_a_single_process_test(tmp_path, monkeypatch):
    monkeypatch.setattr(mutation_check, "REPO", tmp_path)
    (tmp_path / "code.py").write_text("y = 2\n")
    (tmp_path / "test_lanes.py").write_text("import pytest\n\n\n@pytest.mark.slow  # ranks\ndef test_ranks():\n"
                                            "    pass\n\n\ndef test_here():\n    pass\n")
    (tmp_path / "test_all_slow.py").write_text("import pytest\n\npytestmark = pytest.mark.slow\n\n\ndef test_z():\n"
                                               "    pass\n")

    def entry(test: str, quick: bool = True) -> Mutation:
        return Mutation(f"a bug for {test}", "code.py", "y = 2\n", "y = 3\n", test, quick=quick)

    assert list_problems([entry("test_lanes.py::test_here"), entry("test_lanes.py::test_ranks", quick=False)]) == []
    assert list_problems([entry("test_lanes.py::test_ranks")]) == [
        "'a bug for test_lanes.py::test_ranks': quick, but test_lanes.py::test_ranks is marked slow (ranks or "
        "processes)"]
    assert "is marked slow" in list_problems([entry("test_all_slow.py::test_z")])[0]
