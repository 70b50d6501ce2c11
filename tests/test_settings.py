"""The package's environment variables: read in one place (`settings.py`), each in the docs."""

import pathlib
import re

from tinyloop_jax import settings

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_variable_the_code_names_is_listed_and_documented():
    """Every `TINYLOOP_*` name in the package's source is in `settings.VARIABLES`, and every
    listed one has its row in docs/reference.md; `model/` reads no environment and no /proc."""
    named = set()
    for path in (ROOT / "tinyloop_jax").rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r"\bTINYLOOP_[A-Z0-9_]+\b", text))
        if path.parent.name == "model":
            assert "os.environ" not in text and "/proc" not in text, path
    assert named <= set(settings.VARIABLES), named - set(settings.VARIABLES)
    doc = (ROOT / "docs" / "reference.md").read_text()
    for name, (default, _) in settings.VARIABLES.items():
        assert f"| `{name}` | {settings.cell(default)} |" in doc, name


def test_a_variable_reads_its_default_and_refuses_unknown_names(monkeypatch):
    monkeypatch.delenv("TINYLOOP_PAGED_KERNEL", raising=False)
    assert settings.get("TINYLOOP_PAGED_KERNEL") == "auto"
    monkeypatch.setenv("TINYLOOP_PAGED_KERNEL", "xla")
    assert settings.get("TINYLOOP_PAGED_KERNEL") == "xla"
    try:
        settings.get("TINYLOOP_NO_SUCH")
    except KeyError as e:
        assert "TINYLOOP_NO_SUCH" in str(e)
    else:
        raise AssertionError("an unknown variable was read")
