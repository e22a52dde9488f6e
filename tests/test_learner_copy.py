"""Running the course leaves the course's files as pulled: `make lab` serves the learner's own,
git-ignored copy (tools/learner_copy.py), which an update never overwrites and which says when
an original changed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from learner_copy import update_copy  # noqa: E402


def test_make_lab_serves_an_ignored_copy_not_the_tutorials():
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "lab"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    lab = next(ln for ln in dry.splitlines() if "jupyter lab" in ln)
    served = lab.split("--notebook-dir ")[1].split()[0]
    assert served != "tutorials" and f"learner_copy.py tutorials {served}" in dry
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", f"{served}/00_setup.ipynb"], cwd=ROOT
    ).returncode
    assert ignored == 0, f"{served}/ is not git-ignored: a learner's outputs would show as changes"


def test_the_copy_keeps_the_learners_work_and_names_updated_originals(tmp_path):
    source, mine = tmp_path / "tutorials", tmp_path / "my_tutorials"
    (source / "scripts").mkdir(parents=True)
    (source / "00.ipynb").write_text("lesson v1")
    (source / "scripts" / "run.py").write_text("print(1)")
    assert update_copy(source, mine) == {"copied": ["00.ipynb", "scripts/run.py"], "changed": []}
    (mine / "00.ipynb").write_text("lesson v1 with my outputs")  # JupyterLab's autosave
    (source / "00.ipynb").write_text("lesson v2")  # git pull
    (source / "01.ipynb").write_text("a new lesson")
    assert update_copy(source, mine) == {"copied": ["01.ipynb"], "changed": ["00.ipynb"]}
    assert (mine / "00.ipynb").read_text() == "lesson v1 with my outputs"  # never overwritten
    (mine / "00.ipynb").unlink()  # what the message says to do to take the new version
    assert update_copy(source, mine)["copied"] == ["00.ipynb"]
    assert (mine / "00.ipynb").read_text() == "lesson v2"
    assert update_copy(source, mine) == {"copied": [], "changed": []}
