"""The install files agree with each other, so a conda user gets what pip users get."""

from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return set(project["dependencies"]) | set(extras["dev"]) | set(extras["docs"])


def _conda_pip_requirements() -> set[str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    return {r for r in pip if not r.startswith("-e")}


def test_environment_yml_lists_the_same_packages_as_pyproject():
    only_pyproject = _pyproject_requirements() - _conda_pip_requirements()
    only_conda = _conda_pip_requirements() - _pyproject_requirements()
    assert not only_pyproject and not only_conda, (only_pyproject, only_conda)


def test_environment_yml_uses_python_311():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "python=3.11" in env["dependencies"]


def test_deepspeed_is_pinned_to_the_version_the_course_is_checked_against():
    import deepspeed

    pins = [r for r in _pyproject_requirements() if r.startswith("deepspeed")]
    assert pins == ["deepspeed==0.19.8"]
    assert deepspeed.__version__ == "0.19.8"
    constraints = (ROOT / "constraints.txt").read_text().split()
    assert "torch==2.13.0" in constraints and "deepspeed==0.19.8" in constraints
