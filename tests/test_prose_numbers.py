"""A number a lesson's markdown states is a number its code checks (issue 11, part 5).

The rule every lesson follows: a measured number (an error, a ratio, bytes, seconds) reaches the
learner only in output printed by the code that asserts it. A markdown cell keeps words and
bounds, so every number token in it must be a literal of that notebook's code cells: a bound an
assertion uses (``1e-6``), a constant (``GAS = 4``), a config value (``"lr": 0.1``), or an
expression of literals (``2**16``). Formatting does not matter: ``1e-6`` = ``0.000001`` =
``$10^{-6}$``, ``1,024`` = ``1024``, ``33%`` = ``33`` or ``0.33``, ``4x`` = ``4``.

Not checked, because they are structure, not measurements (and each is checked otherwise):

- headings, ordered-list markers, fenced code blocks (commands and code shown to the reader),
  link targets, and labels such as "Exercise 2", "Pitfall 1", "Step 3", "(2)";
- lesson numbers (``lesson 04``, ``**01**``, ``lessons 02–06``): the notebook must exist;
- ``section N``: N must be a numbered heading of the notebook (of lesson NN in "lesson NN,
  section N"), and the reference must carry the heading's title, ``section 9 (*The same code as
  a script*)``, so a renumbering cannot leave a reference pointing at the wrong section;
- the pinned DeepSpeed version (``0.19.8``): it must equal pyproject.toml's pin;
- the objectives' time estimate ``(≈ 25 minutes)``: it must equal the learner minutes of
  docs/instructor/agenda.md, and per-objective ``(5 min)`` must not add up to more.

Two more rules: a ratio in words ("seven times", "five orders of magnitude", "11-fold" is
digits and checked above) is a number in disguise and is refused; and "bit for bit",
"bit-for-bit", "to the last bit" and "exactly equal" claim equality, so they need an equality
assertion (``==`` in an ``assert``, ``torch.equal``, ``.equal(``) in one of the two code cells
before or after the markdown cell that says it (a plot cell often sits in between).

Run ``python tests/test_prose_numbers.py [-v] [FOLDER]`` to print, per lesson, the number tokens
its markdown states and how many of them are unchecked (``-v``: each one).
"""

from __future__ import annotations

import ast
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from lesson_size import STATED_MINUTES  # noqa: E402

# The lessons (00_..09_) and the appendices (A1_..), held to the same rules.
NOTEBOOK_GLOBS = ("[0-9][0-9]_*.ipynb", "A[0-9]_*.ipynb")


def notebooks_in(folder: Path) -> list[Path]:
    return sorted(p for pattern in NOTEBOOK_GLOBS for p in folder.glob(pattern))


LESSONS = notebooks_in(ROOT / "tutorials")

# A number token: 1,024 / 1024 / 0.5 / 1e-6 / 33% / 4x / 3rd / 1B (a multiplier) ...; not part
# of an identifier (fp32, bf16, lesson00, tensor_backward_stage0) nor of a name like ZeRO-1.
NUMBER = re.compile(
    r"(?<![\w.\-/])(?<![A-Za-z]-)"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?!\d)|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
    r"(?P<suffix>%|x\b|×|st\b|nd\b|rd\b|th\b|[kMB]\b)?"
    r"(?![\w.]\w)"
)
MULTIPLIER = {"k": 1e3, "M": 1e6, "B": 1e9}
VERSION = re.compile(r"(?<![\w.])\d+\.\d+\.\d+(?![\w.]\w)")
LESSON_REF = re.compile(
    r"(?:\b[Ll]essons?|\*\*)\s*(?P<refs>0\d(?:\*\*)?(?:\s*(?:[-–/,]|and|or|to)\s*0\d)*)"
)
SECTION_REF = re.compile(r"\b[Ss]ections?\s+(?P<n>\d+)(?=(?P<rest>[\s\S]{0,120}))")
OTHER_LESSON = re.compile(r"[Ll]esson\s+(0\d)(?:'s|,)?\s*$")  # "lesson 08, section 6"
SECTION_RANGE = re.compile(r"\b[Ss]ections\s+(?P<a>\d+)\s*[-–]\s*(?P<b>\d+)")
LABEL = re.compile(r"\b(?:Exercise|Pitfall|Step|Rule|Part|Case)\s+\d+\b|\(\d\)")
OBJECTIVE_MINUTES = re.compile(r"\((?P<n>\d+)\s*min\)")
LATEX_POWER = re.compile(r"(?:(?P<mant>\d+(?:\.\d+)?)\s*\\times\s*)?10\^\{(?P<exp>[-−]?\d+)\}")
WORD_RATIO = re.compile(
    r"\b(?:two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty|thirty|forty|"
    r"fifty|hundred|thousand)(?:\s+to\s+\w+)?(?:\s+times\s+(?:more|less|fewer|smaller|larger|bigger|"
    r"higher|lower|too|as|what)|-fold|\s+orders?\s+of\s+magnitude)\b",
    re.IGNORECASE,
)
NEARBY = 2  # code cells on each side of a markdown cell that its equality words may describe
EQUALITY_WORDS = re.compile(r"bit[ -]for[ -]bit|to the last bit|exactly equal", re.IGNORECASE)


def pinned_deepspeed() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d.split("==")[1] for d in deps if d.startswith("deepspeed=="))


def agenda_minutes() -> dict[str, int]:
    """Learner minutes per lesson, from the agenda's table (`| 03 managed ... | 14.3 | 20 |`)."""
    rows = re.findall(r"^\| (\d\d|A\d) [^|]*\|[^|]*\| (\d+) \|$", _agenda_text(), re.MULTILINE)
    return {lesson: int(minutes) for lesson, minutes in rows}


def _agenda_text() -> str:
    return (ROOT / "docs" / "instructor" / "agenda.md").read_text()


# --- the code side: literals -------------------------------------------------------------------


def _python(source: str) -> str:
    """A code cell as Python: IPython magics and shell lines dropped (a %%ranks body is Python)."""
    lines = source.splitlines()
    return "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in lines)


def _constant(node: ast.AST):
    """The value of a numeric literal or an expression of literals (2**16, 0.1 * 8), else None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _constant(node.operand)
        return None if value is None else abs(value)
    if isinstance(node, ast.BinOp):
        left, right = _constant(node.left), _constant(node.right)
        ops = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}
        if left is None or right is None or type(node.op) not in ops:
            return None
        try:
            return abs(eval(f"{left!r} {ops[type(node.op)]} {right!r}"))  # two numbers only
        except (ArithmeticError, OverflowError):
            return None
    return None


def code_literals(code_cells: list[str]) -> set[float]:
    values: set[float] = set()
    for source in code_cells:
        for node in ast.walk(ast.parse(_python(source))):
            value = _constant(node)
            if value is not None:
                values.add(float(value))
    return values


def _is_equality_assertion(node: ast.AST) -> bool:
    if isinstance(node, ast.Assert):
        return any(
            isinstance(n, ast.Compare) and any(isinstance(op, ast.Eq | ast.Is) for op in n.ops)
            for n in ast.walk(node.test)
        ) or any(_is_equal_call(n) for n in ast.walk(node.test))
    return False


def _is_equal_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Attribute) and node.func.attr in ("equal", "array_equal"))
        or (isinstance(node.func, ast.Name) and node.func.id == "equal")
    )


def asserts_equality(source: str) -> bool:
    return any(_is_equality_assertion(n) for n in ast.walk(ast.parse(_python(source))))


# --- the markdown side: number tokens ----------------------------------------------------------


@dataclass
class Notebook:
    path: Path
    markdown: list[tuple[int, str]] = field(default_factory=list)  # (cell index, source)
    code: list[tuple[int, str]] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Notebook:
        nb, out = json.loads(path.read_text()), cls(path)
        for i, cell in enumerate(nb["cells"]):
            source = "".join(cell["source"])
            (out.markdown if cell["cell_type"] == "markdown" else out.code).append((i, source))
        return out

    @property
    def lesson(self) -> str:
        return self.path.name[:2]

    def headings(self) -> dict[int, str]:
        """Numbered headings, `## 9. The same code as a script` -> {9: "The same code as a script"}."""
        found = {}
        for _, source in self.markdown:
            for m in re.finditer(r"^#+\s+(\d+)\.\s+(.+)$", source, re.MULTILINE):
                found[int(m.group(1))] = m.group(2).strip()
        return found


def _value(num: str, suffix: str | None) -> float:
    value = float(num.replace(",", ""))
    return value * MULTIPLIER.get(suffix or "", 1.0)


def _prose(source: str) -> str:
    """Markdown without what is not prose: fenced code, headings, list markers, link targets."""
    text = re.sub(r"^```.*?^```", "", source, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"^#+ .*$", "", text, flags=re.MULTILINE)
    text = re.sub(r"^(\s*)\d+\.\s", r"\1", text, flags=re.MULTILINE)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"https?://\S+", "", text)
    return text


@dataclass
class Finding:
    cell: int
    token: str
    why: str
    context: str

    def __str__(self) -> str:
        return f"cell {self.cell}: {self.token!r} {self.why}: ...{self.context}..."


def _context(text: str, start: int, end: int) -> str:
    return " ".join(text[max(0, start - 50) : end + 30].split())


def check_notebook(nb: Notebook) -> tuple[int, list[Finding]]:
    """(number tokens its markdown states, the findings: tokens unchecked and claims unbacked)."""
    literals = code_literals([s for _, s in nb.code])
    headings = nb.headings()
    all_headings = {p.name[:2]: Notebook.read(p).headings() for p in LESSONS}
    lessons = {p.name[:2] for p in LESSONS}
    pinned, minutes = pinned_deepspeed(), agenda_minutes()
    tokens, findings = 0, []
    code_indices = [i for i, _ in nb.code]
    code_at = dict(nb.code)

    for index, source in nb.markdown:
        text = _prose(source)
        spans: list[tuple[int, int]] = []  # structural tokens, already checked
        for m in VERSION.finditer(text):
            tokens += 1
            spans.append((m.start(), m.end()))
            if m.group() != pinned:
                findings.append(
                    Finding(
                        index,
                        m.group(),
                        f"is not the pinned DeepSpeed {pinned}",
                        _context(text, *m.span()),
                    )
                )
        for m in LESSON_REF.finditer(text):
            spans.append((m.start("refs"), m.end("refs")))
            for ref in re.findall(r"0\d", m.group("refs")):
                tokens += 1
                if ref not in lessons:
                    findings.append(
                        Finding(
                            index, ref, "names no lesson in tutorials/", _context(text, *m.span())
                        )
                    )
        for m in SECTION_RANGE.finditer(text):
            spans.append((m.start(), m.end()))
            for n in (m.group("a"), m.group("b")):
                tokens += 1
                if int(n) not in headings:
                    findings.append(
                        Finding(index, n, "is no numbered heading here", _context(text, *m.span()))
                    )
        for m in SECTION_REF.finditer(text):
            if any(a <= m.start() < b for a, b in spans):
                continue
            tokens += 1
            spans.append((m.start("n"), m.end("n")))
            n, rest = int(m.group("n")), m.group("rest")
            other = OTHER_LESSON.search(text[max(0, m.start() - 30) : m.start()])
            title = (all_headings.get(other.group(1), {}) if other else headings).get(n)
            if title is None:
                findings.append(
                    Finding(
                        index, str(n), "is no numbered heading here", _context(text, *m.span("n"))
                    )
                )
            elif not _names_title(rest, title):
                findings.append(
                    Finding(index, str(n), f'does not name its heading ("section {n} (*{title}*)")',
                            _context(text, *m.span("n")))
                )  # fmt: skip
        for m in LABEL.finditer(text):
            spans.append((m.start(), m.end()))
        if index == nb.markdown[0][0]:  # the objectives' time estimate
            for m in STATED_MINUTES.finditer(text):
                tokens += 1
                spans.append((m.start(), m.end()))
                total = int(m["total"])
                if minutes.get(nb.lesson) != total:
                    findings.append(
                        Finding(index, str(total), f"minutes, the agenda says {minutes.get(nb.lesson)}",
                                _context(text, *m.span()))
                    )  # fmt: skip
                parts = [int(p.group("n")) for p in OBJECTIVE_MINUTES.finditer(text)]
                for p in OBJECTIVE_MINUTES.finditer(text):
                    spans.append((p.start(), p.end()))
                if sum(parts) > total:
                    findings.append(
                        Finding(index, f"{sum(parts)} min", f"of objectives exceed the {total} minutes",
                                _context(text, *m.span()))
                    )  # fmt: skip

        for m in LATEX_POWER.finditer(text):
            if any(a <= m.start() < b for a, b in spans):
                continue
            tokens += 1
            spans.append((m.start(), m.end()))
            value = float(m.group("mant") or 1) * 10 ** int(m.group("exp").replace("−", "-"))
            if not _is_literal(value, None, literals):
                findings.append(
                    Finding(
                        index, m.group(), "is not a literal of the code", _context(text, *m.span())
                    )
                )
        for m in NUMBER.finditer(text):
            if any(a <= m.start() < b for a, b in spans):
                continue
            tokens += 1
            num, suffix = m.group("num"), m.group("suffix")
            if not _is_literal(_value(num, suffix), suffix, literals):
                findings.append(
                    Finding(
                        index, m.group(), "is not a literal of the code", _context(text, *m.span())
                    )
                )
        for m in WORD_RATIO.finditer(text):
            tokens += 1
            findings.append(Finding(index, m.group(), "is a ratio in words: print it from the code that asserts it",
                                    _context(text, *m.span())))  # fmt: skip
        for m in EQUALITY_WORDS.finditer(text):
            before = [i for i in code_indices if i < index][-NEARBY:]
            after = [i for i in code_indices if i > index][:NEARBY]
            if not any(asserts_equality(code_at[i]) for i in before + after):
                findings.append(
                    Finding(index, m.group(), "claims equality, but the code cells around assert none",
                            _context(text, *m.span()))
                )  # fmt: skip
    return tokens, findings


def _names_title(rest: str, title: str) -> bool:
    """`section 9 (*The same code as a script*)`: the words after the number start the title."""
    words = re.sub(r"[*`_()\[\],]", " ", rest).split()
    title_words = re.sub(r"[*`_()\[\],]", " ", title).split()
    n = min(3, len(title_words))
    return [w.lower() for w in words[:n]] == [w.lower() for w in title_words[:n]]


def _is_literal(value: float, suffix: str | None, literals: set[float]) -> bool:
    candidates = [value]
    if suffix == "%":
        candidates.append(value / 100)
    return any(
        math.isclose(c, lit, rel_tol=1e-9, abs_tol=0.0) for c in candidates for lit in literals
    )


# --- the tests ---------------------------------------------------------------------------------


def test_every_lesson_is_checked():
    assert len(LESSONS) >= 9, [p.name for p in LESSONS]


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_markdown_states_only_numbers_its_code_checks(path):
    tokens, findings = check_notebook(Notebook.read(path))
    assert not findings, (
        f"{path.name}: {len(findings)} of {tokens} number tokens unchecked\n"
        + "\n".join(map(str, findings))
    )


def _notebook_from(cells: list[tuple[str, str]]) -> Notebook:
    nb = Notebook(LESSONS[0])
    for i, (kind, source) in enumerate(cells):
        (nb.markdown if kind == "markdown" else nb.code).append((i, source))
    return nb


def _findings(cells):
    return [(f.token, f.why.split(",")[0]) for f in check_notebook(_notebook_from(cells))[1]]


def test_it_fails_on_a_measured_number_the_code_does_not_assert():
    cells = [
        ("markdown", f"# 00 · x\n\n**Objectives** (≈ {agenda_minutes()['00']} minutes)."),
        ("code", "err = run()\nassert err < 1e-6\nprint(f'{err:.1e}')"),
        (
            "markdown",
            "The error stays below 1e-6 for every N (worst 1.1e-6 at N = 3), about $2\\times10^{-7}$.",
        ),
    ]
    tokens = [t for t, _ in _findings(cells)]
    assert tokens == ["2\\times10^{-7}", "1.1e-6", "3"]  # 1e-6 is the asserted bound: allowed


def test_it_accepts_formatting_variants_of_a_literal():
    cells = [
        ("markdown", f"# 00 · x\n\n**Objectives** (≈ {agenda_minutes()['00']} minutes)."),
        ("code", "TOL = 0.000001\nBYTES = 1024\nscale = 2**16\nfrac = 0.33"),
        ("markdown", "Within 1e-6 ($10^{-6}$), 1,024 bytes, 65,536 = 2**16, 33% of it, 16x."),
    ]
    assert _findings(cells) == []


def test_it_checks_lesson_and_section_references_and_the_version():
    cells = [
        ("markdown", f"# 00 · x\n\n**Objectives** (≈ {agenda_minutes()['00']} minutes). DeepSpeed 0.19.7, lesson 42."),
        ("markdown", "## 9. The same code as a script\n\nAs in section 7, and section 9 (*The same code as a script*)."),
        ("markdown", "## 10. Exercises\n\nsee section 9 below."),
    ]  # fmt: skip
    got = _findings(cells)
    assert ("0.19.7", "is not the pinned DeepSpeed 0.19.8") in got
    assert ("7", "is no numbered heading here") in got
    assert ("9", 'does not name its heading ("section 9 (*The same code as a script*)")') in got
    assert ("42", "is not a literal of the code") in got  # not a two-digit lesson number: a number
    assert len(got) == 4


def test_it_refuses_ratios_in_words_and_unbacked_equality():
    cells = [
        ("markdown", f"# 00 · x\n\n**Objectives** (≈ {agenda_minutes()['00']} minutes)."),
        ("code", "assert err < 1e-6"),
        ("markdown", "Bit for bit the same, and seven to thirty times smaller."),
        ("code", "assert torch.allclose(a, b)"),
        ("code", "plot(a, b)"),
        ("code", "assert torch.equal(a, b)"),
        ("markdown", "Here bit for bit (asserted above)."),
    ]
    assert _findings(cells) == [
        (
            "seven to thirty times smaller",
            "is a ratio in words: print it from the code that asserts it",
        ),
        ("Bit for bit", "claims equality"),
    ]


def test_objective_minutes_follow_the_agenda():
    cells = [("markdown", "# 00 · x\n\n**Objectives** (≈ 20 minutes). - a (15 min)\n- b (10 min)")]
    got = _findings(cells)
    assert ("20", "minutes") in got and ("25 min", "of objectives exceed the 20 minutes") in got


def count(folder: Path | None = None) -> None:
    """Print the number tokens of every lesson's markdown, and the unchecked ones.

    ``python tests/test_prose_numbers.py [-v] [FOLDER]``: FOLDER holds other copies of the
    lessons (e.g. an older commit's ``tutorials/``, from ``git archive``) to count instead.
    """
    global LESSONS
    if folder is not None:
        LESSONS = notebooks_in(folder)
    total = unchecked = 0
    for path in LESSONS:
        tokens, findings = check_notebook(Notebook.read(path))
        total, unchecked = total + tokens, unchecked + len(findings)
        print(f"{path.stem:28s} {tokens:4d} number tokens, {len(findings):4d} findings")
        if "-v" in sys.argv:
            for f in findings:
                print("    ", f)
    print(f"{'all':28s} {total:4d} number tokens, {unchecked:4d} findings")


if __name__ == "__main__":
    folders = [Path(a) for a in sys.argv[1:] if a != "-v"]
    count(folders[0] if folders else None)


def test_no_prose_cell_hides_an_assertion_in_parentheses():
    """Issue 20: "(asserted ...)" parentheticals made prose unreadable; the code cell under a
    claim asserts it and prints the number, and the sentence reads as a sentence."""
    found = [
        (path.name, index)
        for path in LESSONS
        for index, text in Notebook.read(path).markdown
        if re.search(r"\(\s*asserted", text)
    ]
    assert found == [], f"'(asserted ...)' in prose: {found}"
