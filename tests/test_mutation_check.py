"""tests/mutation_check.py checks its whole list before planting anything: a snippet found twice or not at all, a
planted file that does not compile, a guarding test that does not exist. (Whether each bug is caught is the
check's own run: `make mutation-check`.)"""

from __future__ import annotations

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
