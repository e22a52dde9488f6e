"""What the checker answers: a verdict per ZeRO stage and case, as text, as a table, as JSON.

The JSON (``--json``, :meth:`CheckResult.to_json`) is one object:

* ``ok``: every case passed; ``stage_verdicts``: ``{"0": "PASS" | "FAIL" | "right only when
  every rank runs the same number of micro-batches", ...}``; ``seconds``: the check's wall time.
* ``declaration``: what was checked, in full: ``objective`` (the user's ``FILE.py:FUNCTION``, or
  null), ``reduction`` (the built-in one, or null), ``constant``, ``count_empty_sequences``,
  ``equal_counts``, ``cases`` (the case names asked for, or null: every case), ``stages``,
  ``library``, ``model``, ``world_size``, ``case_timeout`` (seconds per case), ``config`` (the DeepSpeed config the engines ran with, its
  ``zero_optimization.stage`` set to each of ``stages`` in turn) and ``config_given`` (whether it
  is the user's, completed, or the checker's own).
* ``versions``: ``gas_lab``, ``deepspeed``, ``torch`` and ``transformers`` (null if absent).
* ``results``: one object per stage and case: ``stage``, ``case``, ``case_description``,
  ``outcome`` (one of :class:`Outcome`), ``error`` (the largest relative parameter difference
  from the reference, or null), ``diagnosis`` (a list of sentences), ``diagnosed_alone`` (true
  where the failing cases of the stage need different explanations) and ``detail`` (a traceback,
  or what the runtime saw).
"""

from __future__ import annotations

import enum
import html
import json
from dataclasses import asdict, dataclass, field

from gas_lab.check.cases import BY_NAME


class Outcome(str, enum.Enum):
    """Every outcome a case can have: PASS, or what went wrong."""

    PASS = "PASS"
    WRONG_WEIGHTS = "wrong weights"  # finished, the ranks agree, the reference is not reached
    NOT_FINITE = "not finite"  # the weights became NaN or inf
    RANKS_DIFFER = "ranks differ"  # the ranks ended with different weights
    NOT_ONE_STEP = "not one step"  # a call did not take exactly one optimizer step
    LOOP_RAISED = "loop raised"  # the loop's own code raised
    ENGINE_RAISED = "engine raised"  # the engine (DeepSpeed, gas_lab, torch) raised in the call
    DIED = "died"  # a rank process died
    HANG = "hang"  # a rank waited longer than the case timeout

    def __str__(self) -> str:
        return self.value


PASS = Outcome.PASS
RIGHT_FOR_EQUAL_COUNTS = "right only when every rank runs the same number of micro-batches"


@dataclass
class CaseResult:
    stage: int
    case: str
    outcome: Outcome
    error: float | None = None  # largest relative parameter difference from the reference
    diagnosis: list[str] = field(default_factory=list)
    detail: str = ""  # the loop's own traceback, or what the runtime saw
    diagnosed_alone: bool = False  # the stage's failing cases need different explanations
    world_size: int = 2
    findings: list = field(default_factory=list, repr=False)  # the diagnosis as data

    @property
    def passed(self) -> bool:
        return self.outcome == Outcome.PASS

    @property
    def equal_counts(self) -> bool:
        return BY_NAME[self.case].equal_counts_at(self.world_size)

    def describe(self) -> str:
        return BY_NAME[self.case].describe(self.world_size)


@dataclass
class CheckResult:
    declaration: dict  # what was checked (the JSON's "declaration")
    results: list[CaseResult]
    seconds: float = 0.0
    versions: dict = field(default_factory=dict)

    @property
    def reduction(self) -> str:
        d = self.declaration
        return d["objective"] or d["reduction"]

    @property
    def library(self) -> str:
        return self.declaration["library"]

    @property
    def stages(self) -> list[int]:
        return self.declaration["stages"]

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
            return "PASS"
        if self.right_for_equal_counts(stage):
            return RIGHT_FOR_EQUAL_COUNTS
        return "FAIL"

    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    def headline(self) -> str:
        d = self.declaration
        what = f"objective {d['objective']}" if d["objective"] else f"'{d['reduction']}' objective"
        extra = [f"÷ {d['constant']:g}"] if d["constant"] not in (None, 1.0) else []
        extra += ["empty sequences counted"] if d["count_empty_sequences"] else []
        return (
            f"gas_lab.check: {what}{' (' + ', '.join(extra) + ')' if extra else ''} on "
            f"{d['library']}, {d['model']} model, {d['world_size']} ranks, ZeRO stages "
            f"{', '.join(map(str, self.stages))}: {'PASS' if self.ok else 'FAIL'} "
            f"({sum(r.passed for r in self.results)} of {len(self.results)} cases, "
            f"{self.seconds:.0f} s)"
        )

    def __str__(self) -> str:
        lines = [self.headline()]
        width = max((len(r.case) for r in self.results), default=0) + 2
        for s in self.stages:
            lines.append(f"  stage {s}: {self.stage_verdict(s)}")
            for r in self.results:
                if r.stage == s:
                    lines.append(f"    {r.case:<{width}}{r.outcome}")
        told = set()
        for r, same in self.grouped_failures():
            if r.diagnosed_alone and r.stage not in told:
                told.add(r.stage)
                lines += [
                    "",
                    f"At stage {r.stage} the failing cases need different explanations: no one "
                    "known mistake fits them all, so each is diagnosed on its own.",
                ]
            lines += ["", f"FAIL at stage {r.stage}, case '{r.case}': {r.outcome}"]
            if same:
                lines.append(
                    "  (the same at " + ", ".join(f"stage {x.stage} '{x.case}'" for x in same) + ")"
                )
            lines.append(f"  the case: {r.describe()}")
            if r.error is not None:
                lines.append(f"  the error: parameters off by up to {_relative(r.error)}")
            if r.detail:
                lines += ["  " + line for line in r.detail.rstrip().splitlines()]
            label = "diagnosis (this case)" if r.diagnosed_alone else "diagnosis"
            lines += [f"  {label}: {d}" for d in r.diagnosis[:1]]
            lines += [f"  or, fitting these cases as well: {d}" for d in r.diagnosis[1:]]
        return "\n".join(lines)

    def grouped_failures(self) -> list[tuple[CaseResult, list[CaseResult]]]:
        """Each failure once: a failure with the same outcome, diagnosis and traceback as an
        earlier one is listed under it (a loop that raises fails every case alike). The group
        is named by its case with the largest error, whose error it shows."""
        groups: dict = {}
        for r in self.failures():
            key = (r.outcome, tuple(r.diagnosis), r.detail if r.error is None else "")
            groups.setdefault(key, []).append(r)
        out = []
        for g in groups.values():
            head = max(g, key=lambda x: x.error or 0.0)
            out.append((head, [x for x in g if x is not head]))
        return out

    def _repr_html_(self) -> str:
        cases = list(dict.fromkeys(r.case for r in self.results))
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cases)
        rows = []
        for s in self.stages:
            cells = []
            for c in cases:
                r = next(x for x in self.results if x.stage == s and x.case == c)
                color = "#1a7f37" if r.passed else "#cf222e"
                cells.append(f'<td style="color:{color}">{html.escape(str(r.outcome))}</td>')
            rows.append(
                f"<tr><th>stage {s}</th>{''.join(cells)}"
                f"<td>{html.escape(self.stage_verdict(s))}</td></tr>"
            )
        notes = "".join(
            f"<li><b>stage {r.stage}, {html.escape(r.case)}</b>"
            + (f" ({len(same)} more alike)" if same else "")
            + (" (diagnosed on its own: the cases need different explanations)"
               if r.diagnosed_alone else "")
            + ": "
            + html.escape(" Or, fitting these cases as well: ".join(r.diagnosis))
            + (f"<pre>{html.escape(r.detail)}</pre>" if r.detail else "")
            + "</li>"
            for r, same in self.grouped_failures()
        )  # fmt: skip
        return (
            f"<p><b>{html.escape(self.headline())}</b></p>"
            f"<table><tr><th></th>{head}<th>verdict</th></tr>{''.join(rows)}</table>"
            + (f"<ul>{notes}</ul>" if notes else "")
        )

    def to_dict(self) -> dict:
        results = []
        for r in self.results:
            doc = asdict(r)
            doc["outcome"] = r.outcome.value
            doc["case_description"] = r.describe()
            del doc["world_size"], doc["findings"]  # the declaration's; the words say it
            results.append(doc)
        return {
            "ok": self.ok,
            "stage_verdicts": {str(s): self.stage_verdict(s) for s in self.stages},
            "seconds": self.seconds,
            "declaration": self.declaration,
            "versions": self.versions,
            "results": results,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)


def _relative(error: float) -> str:
    return "a non-finite value (NaN or inf)" if error == float("inf") else f"{error:.1%} (relative)"
