"""Loaded by every pytest run in this repository, the notebooks' (``make notebooks``) included:
nbmake's kernel clients read a reply within a second of its arrival, not at the cell timeout
(tools/kernel_replies.py). The tests' own fixtures are in tests/conftest.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))

import kernel_replies  # noqa: E402

kernel_replies.install()
