"""What the checker answers: a verdict per ZeRO stage and case, as text, as a table, as JSON."""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field

from gas_lab.check.cases import BY_NAME

PASS = "PASS"


@dataclass
class CaseResult:
    stage: int
    case: str
    outcome: str  # PASS, or what went wrong: "wrong weights", "raised", "died", "hang", ...
    error: float | None = None  # largest relative parameter difference from the reference
    diagnosis: list[str] = field(default_factory=list)
    detail: str = ""  # the loop's own traceback, or what the runtime saw

    @property
    def passed(self) -> bool:
        return self.outcome == PASS

    @property
    def equal_counts(self) -> bool:
        return BY_NAME[self.case].equal_counts


@dataclass
class CheckResult:
    reduction: str
    library: str
    stages: list[int]
    results: list[CaseResult]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.passed for r in self.results)

    def right_for_equal_counts(self, stage: int) -> bool:
        """The loop passes every case of ``stage`` where the ranks run the same number of
        micro-batches, and fails only where they do not."""
        mine = [r for r in self.results if r.stage == stage]
        bad = [r for r in mine if not r.passed]
        return bool(bad) and all(not r.equal_counts for r in bad)

    def stage_verdict(self, stage: int) -> str:
        mine = [r for r in self.results if r.stage == stage]
        if all(r.passed for r in mine):
            return PASS
        if self.right_for_equal_counts(stage):
            return "right only when every rank runs the same number of micro-batches"
        return "FAIL"

    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    def __str__(self) -> str:
        lines = [
            f"gas_lab.check: '{self.reduction}' objective on {self.library}, ZeRO stages "
            f"{', '.join(map(str, self.stages))}: {'PASS' if self.ok else 'FAIL'} "
            f"({sum(r.passed for r in self.results)} of {len(self.results)} cases, "
            f"{self.seconds:.0f} s)"
        ]
        for s in self.stages:
            lines.append(f"  stage {s}: {self.stage_verdict(s)}")
            for r in self.results:
                if r.stage == s:
                    lines.append(f"    {r.case:<16} {r.outcome}")
        for r, same in self.grouped_failures():
            lines += ["", f"FAIL at stage {r.stage}, case '{r.case}': {r.outcome}"]
            if same:
                lines.append(
                    "  (the same at " + ", ".join(f"stage {x.stage} '{x.case}'" for x in same) + ")"
                )
            lines.append(f"  the case: {BY_NAME[r.case].describe()}")
            if r.error is not None:
                worst = max([r, *same], key=lambda x: x.error or 0.0)
                where = f" (case '{worst.case}')" if same else ""
                lines.append(
                    f"  the error: parameters off by up to {_relative(worst.error)}{where}"
                )
            if r.detail:
                lines += ["  " + line for line in r.detail.rstrip().splitlines()]
            lines += [f"  diagnosis: {d}" for d in r.diagnosis[:1]]
            lines += [f"  or, fitting these cases as well: {d}" for d in r.diagnosis[1:]]
        return "\n".join(lines)

    def grouped_failures(self) -> list[tuple[CaseResult, list[CaseResult]]]:
        """Each failure once: a failure with the same outcome, diagnosis and traceback as an
        earlier one is listed under it (a loop that raises fails every case alike)."""
        groups: dict = {}
        for r in self.failures():
            key = (r.outcome, tuple(r.diagnosis), r.detail if r.error is None else "")
            groups.setdefault(key, []).append(r)
        return [(g[0], g[1:]) for g in groups.values()]

    def _repr_html_(self) -> str:
        cases = list(dict.fromkeys(r.case for r in self.results))
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cases)
        rows = []
        for s in self.stages:
            cells = []
            for c in cases:
                r = next(x for x in self.results if x.stage == s and x.case == c)
                color = "#1a7f37" if r.passed else "#cf222e"
                cells.append(f'<td style="color:{color}">{html.escape(r.outcome)}</td>')
            rows.append(
                f"<tr><th>stage {s}</th>{''.join(cells)}"
                f"<td>{html.escape(self.stage_verdict(s))}</td></tr>"
            )
        notes = "".join(
            f"<li><b>stage {r.stage}, {html.escape(r.case)}</b>"
            + (f" ({len(same)} more alike)" if same else "")
            + ": "
            + html.escape(" Or, fitting these cases as well: ".join(r.diagnosis))
            + (f"<pre>{html.escape(r.detail)}</pre>" if r.detail else "")
            + "</li>"
            for r, same in self.grouped_failures()
        )
        verdict = "PASS" if self.ok else "FAIL"
        return (
            f"<p><b>{verdict}</b>: the '{html.escape(self.reduction)}' objective on "
            f"{html.escape(self.library)} ({self.seconds:.0f} s)</p>"
            f"<table><tr><th></th>{head}<th>verdict</th></tr>{''.join(rows)}</table>"
            + (f"<ul>{notes}</ul>" if notes else "")
        )

    def to_json(self) -> str:
        doc = asdict(self)
        doc["ok"] = self.ok
        doc["stage_verdicts"] = {str(s): self.stage_verdict(s) for s in self.stages}
        for r in doc["results"]:
            r["case_description"] = BY_NAME[r["case"]].describe()
        return json.dumps(doc, indent=1, default=str)


def _relative(error: float) -> str:
    return "a non-finite value (NaN or inf)" if error == float("inf") else f"{error:.1%} (relative)"
