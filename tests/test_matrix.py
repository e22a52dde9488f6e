"""The committed matrix still describes the installed DeepSpeed: re-measure a fast subset.

An upgrade that accepts what it used to reject (or rewords the message, or moves the moment)
fails here, naming the cases; re-run ``python -m gas_lab.measure.matrix`` and review the diff.
"""

from pathlib import Path

import pytest

from gas_lab.measure import matrix, prediction

pytestmark = pytest.mark.ranks
ROOT = Path(__file__).resolve().parents[1]
COMPARED = ("outcome", "exception", "message", "raised_in", "moment", "observed")
MATRIX = prediction.measured_matrix()


def _fast(case) -> bool:
    """Every case outside the big grid at stages 0/1, plus grid cases that pin a surprise."""
    axes = case["axes"]
    if case["group"] != "grid":
        return axes.get("stage", 0) <= 1 or axes.get("api") in ("no_sync", "tensor_backward")
    return (
        axes["offload"] == "none"
        and axes["precision"] == "fp32"
        or (axes["stage"] == 0 and axes["managed"] and not axes["overlap_comm"])
    )


def differences(recorded: list[dict], measured: list[dict]) -> list[str]:
    """One line per case whose measurement differs from the committed matrix."""
    out = []
    for case, now in zip(recorded, measured, strict=True):
        changed = [k for k in COMPARED if case.get(k) != now.get(k)]
        if changed:
            diff = ", ".join(f"{k}: {case.get(k)!r} -> {now.get(k)!r}" for k in changed)
            out.append(f"{case['id']}: {diff}")
    return out


def test_matrix_file_names_its_version_and_covers_the_brief():
    import deepspeed

    assert MATRIX["deepspeed_version"] == deepspeed.__version__
    cases = MATRIX["cases"]
    assert MATRIX["summary"]["cases"] == len(cases) == len({c["id"] for c in cases})
    assert MATRIX["summary"]["accepted"] == sum(c["outcome"] == "accepted" for c in cases)
    groups = {c["group"] for c in cases}
    assert {"grid", "api", "pipeline", "deepcompile", "amp", "config", "edges", "zero2"} <= groups
    apis = {c["axes"].get("api") for c in cases}
    assert {"set_boundary_true", "set_boundary_false", "step_in_no_sync", "coalesce"} <= apis
    # Each of the three moments occurs, and every rejection records where it fired.
    assert {c["moment"] for c in cases} == {None, "initialize", "call", "context"}
    for c in cases:
        assert (c["outcome"] == "rejected") == (c["exception"] is not None) == bool(c["message"])


def test_installed_deepspeed_still_matches_the_matrix(cluster):
    subset = [c for c in MATRIX["cases"] if _fast(c)]
    assert 40 <= len(subset) < len(MATRIX["cases"])
    assert {c["outcome"] for c in subset} == {"accepted", "rejected"}
    per_rank = cluster.run(matrix.measure, subset, timeout=300)
    for measured in per_rank:
        problems = differences(subset, measured)
        assert not problems, "DeepSpeed changed; re-measure and review:\n" + "\n".join(problems)


def test_differences_names_a_changed_case():
    case = MATRIX["cases"][0]
    changed = {**case, "outcome": "rejected", "exception": "AssertionError"}
    (line,) = differences([case], [changed])
    assert case["id"] in line and "'accepted' -> 'rejected'" in line
    assert differences([case], [case]) == []
