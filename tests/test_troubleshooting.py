"""docs/instructor/troubleshooting.md shows what a learner sees: the rendered error
(``_render_traceback_``, what IPython shows and tests/test_kernel.py pins in a real kernel), not
``str(error)``, the full report behind ``print(cluster.last_error)``.

Each example is rebuilt here from the same inputs; the page must hold its rendered lines
(wrapped as prose is wrapped: whitespace does not count).
"""

import re
from pathlib import Path

import pytest

from gas_lab.runtime.rank_errors import RankError, RankInterrupt, RankStallError
from gas_lab.runtime.rank_state import RankState

PAGE = Path(__file__).resolve().parents[1] / "docs" / "instructor" / "troubleshooting.md"


def _tb(where: str, line: str, exc: str) -> str:
    return f"Traceback (most recent call last):\n  {where}\n    {line}\n{exc}\n"


STOPPED = _tb(
    "Cell In[12], line 20, in train", "loss = model(x).pow(2).mean()", "KeyboardInterrupt"
)
BUSY = {
    r: RankState("computing", f"computing in train line 20 ({c}% CPU)")
    for r, c in ((0, 98), (1, 97))
}
IN_ALL_REDUCE = "rank 0 was waiting in a collective (all_reduce, called from train line 6)"
EXAMPLES = {
    "a rank raises": RankError(
        {1: _tb("Cell In[7], line 4, in <module>", 'raise ValueError("boom")', "ValueError: boom")},
        [],
        False,
        ranks=[0, 1],
    ),
    "a rank dies": RankError(
        {0: _tb("Cell In[9], line 6, in train", "dist.all_reduce(grad)", "RuntimeError: ...")},
        [],
        True,
        died={1: "killed by signal SIGSEGV"},
        crash={1: "Fatal Python error: Segmentation fault\n..."},
        what="train",
        ranks=[0, 1],
    ),
    "a collective stalls": RankStallError([0], [1], 60),
    "a rank is busy": RankStallError([0, 1], [], 60, BUSY, False, {0: STOPPED, 1: STOPPED}),
    "interrupted": RankInterrupt(
        "Interrupted: the work on ranks [0, 1] stopped after 0.5 s (each got a "
        "KeyboardInterrupt); the ranks keep their variables.",
        False,
        0.5,
        {0: STOPPED, 1: STOPPED},
    ),
    "interrupted in a collective": RankInterrupt(
        f"Interrupted: {IN_ALL_REDUCE} and cannot be stopped there, so the ranks were restarted "
        "(0.8 s); variables on the ranks are lost.",
        True,
        0.8,
    ),
}  # fmt: skip


def _flat(text: str) -> str:
    return " ".join(text.split())


def _blocks() -> list[str]:
    return re.findall(r"```text\n(.*?)```", PAGE.read_text(), re.DOTALL)


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_page_shows_what_renders(name):
    """The runtime's line of each example, and the rank's own report above it where the example
    has one (a stall's and a collective's sampled stack are pinned in test_kernel.py instead)."""
    rendered = EXAMPLES[name]._render_traceback_()
    page = _flat(PAGE.read_text())
    assert _flat(rendered[-1]) in page, f"{name}: the page lacks {rendered[-1]!r}"
    own = rendered[: rendered.index("")]
    if own and not own[0].startswith("rank 0:"):  # a bare state: the page shows the stack
        assert _flat("\n".join(own)) in page, f"{name}: the page lacks {own!r}"


def test_no_example_is_the_full_report():
    """``str(error)`` starts with the class name as Python prints an exception: a learner sees
    that only after ``print(cluster.last_error)``, so no example opens with it."""
    names = ("RankError", "RankStallError", "RankInterrupt", "LoneCollectiveError")
    for block in _blocks():
        assert not block.startswith(tuple(f"{n}:" for n in names)), block
