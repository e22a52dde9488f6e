"""`make course` (tools/run_course.py): an instructor's table of seconds per notebook, without
a line of noise per notebook above it."""

import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def test_the_course_runner_prints_its_table_and_no_kernel_warnings(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    nbformat.write(nb, tmp_path / "00_tiny.ipynb")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/run_course.py"), str(tmp_path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "00_tiny.ipynb" in proc.stdout.splitlines()[-2] and " ok" in proc.stdout
    # ipykernel warns once per kernel whose channels are plain TCP: the runner encrypts them
    assert "without encryption" not in proc.stderr, proc.stderr
    ran = nbformat.read(tmp_path / "out/00_tiny.ipynb", as_version=4)
    assert ran.cells[0].outputs[0]["text"] == "42\n"
