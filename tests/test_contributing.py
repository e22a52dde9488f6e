"""CONTRIBUTING.md's recipes name files that exist: every backticked path, every ``gas_lab.``
module it runs, and every placeholder (``NN``, ``<name>``) that stands for existing files."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "CONTRIBUTING.md").read_text()
SUFFIXES = (".py", ".md", ".json", ".ipynb", ".txt", ".toml")


def _named() -> list[str]:
    spans = re.findall(r"`([^`\n]+)`", TEXT)
    words = [w for s in spans for w in s.split()]
    return [w.strip("(),;:") for w in words]


def test_every_path_it_names_exists():
    paths = [w for w in _named() if "/" in w and w.endswith(SUFFIXES)]
    assert len(paths) > 30  # the recipes name their files (else this proves nothing)
    missing = []
    for path in paths:
        pattern = path.replace("NN", "[0-9][0-9]").replace("<name>", "*")
        if not list(ROOT.glob(pattern)):
            missing.append(path)
    assert not missing, f"CONTRIBUTING.md names files that do not exist: {missing}"


def test_every_module_it_runs_exists():
    modules = [w for w in _named() if re.fullmatch(r"gas_lab(\.\w+)+", w)]
    assert modules
    for module in modules:
        base = ROOT / Path(*module.split("."))
        assert base.with_suffix(".py").is_file() or (base / "__init__.py").is_file(), module


def test_every_recipe_ends_with_its_tests():
    """Each recipe ends with the tests that tell you what you forgot: those test files exist
    (above), and every recipe has some."""
    recipes = re.split(r"^## ", TEXT, flags=re.M)[1:]
    for recipe in recipes:
        if recipe.startswith("Commits"):
            continue
        assert "Tests:" in recipe, recipe.splitlines()[0]
