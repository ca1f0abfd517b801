"""docs/config-reference.md is what qlora_fsdp/config/reference.py makes from the schema, and every key says what
it does (a comment in schema.py)."""

from qlora_fsdp.config.reference import PAGE, REGENERATE, missing_comments, render


def test_the_config_reference_is_current():
    assert PAGE.is_file() and PAGE.read_text() == render(), f"docs/config-reference.md is out of date: run {REGENERATE}"


def test_every_key_has_a_description():
    assert missing_comments() == [], "add a comment beside (or above) these fields in qlora_fsdp/config/schema.py"
