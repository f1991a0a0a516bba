"""The README's settings table and quickstart stay true to the code."""

from pathlib import Path

from worker.settings import Settings
from worker.settings_table import markdown_table

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_settings_table_is_current():
    assert markdown_table() in README, "regenerate with: python -m worker.settings_table"


def test_every_worker_setting_is_documented():
    for name, field in Settings.model_fields.items():
        assert f"TRIAGE_{name.upper()}" in README
        assert field.description, f"{name} has no description"


def test_quickstart_commands_exist_in_makefile():
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert "make demo" in README and "make test" in README
    assert "\ndemo: venv" in makefile and "\ntest: venv" in makefile


def test_make_test_lower_tests_the_floor_of_the_declared_transformers_range():
    """`make test-lower` runs the suite on the lowest transformers pyproject admits: the range is tested, not hoped."""
    import re

    root = Path(__file__).resolve().parents[2]
    declared = re.search(r'"transformers>=([0-9.]+)', (root / "pyproject.toml").read_text())
    lowest = re.search(r"^LOWEST_TRANSFORMERS := ([0-9.]+)$", (root / "Makefile").read_text(), re.M)
    assert declared and lowest
    floor = declared.group(1)
    assert lowest.group(1) in (floor, floor + ".0", floor + ".0.0")
