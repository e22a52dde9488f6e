"""A rank with fewer micro-batches than the others, none included (gas_lab/measure/idle_rank.py,
appendix A3): the rule, held to the committed measurement and re-run live.

The committed measurement (data/deepspeed_<version>_idle_rank.json, ``python -m
gas_lab.measure.idle_rank``) says, for every case, what each rank of DeepSpeed and of gas_lab
did; here the rule (:func:`idle_rank.backward_calls`) is checked against it both ways (where it
pads, the raw loop fails; where it asks nothing, the raw loop trains right), and the cases that
finish are re-run on the ranks.
"""

import json
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from gas_lab.measure import idle_rank

DATA = idle_rank.DATA / f"deepspeed_{version('deepspeed')}_idle_rank.json"
CASES = json.loads(DATA.read_text())["cases"]
AXES = ("lib", "stage", "managed", "clip", "schedule", "loop")


def _find(**axes) -> list[dict]:
    return [c for c in CASES if all(c[k] == v for k, v in axes.items())]


def _outcomes(case) -> list[str]:
    return [r["outcome"] for r in case["ranks"]]


def _key(case) -> str:
    return json.dumps({k: case[k] for k in AXES})


# ---------------------------------------------------------------- the rule, no ranks
@pytest.mark.parametrize(
    "stage, managed, n, n_max, calls",
    [
        (0, False, 0, 2, 0), (0, False, 1, 2, 1),  # stage 0: whatever the rank has
        (1, False, 0, 2, 1), (1, False, 1, 3, 1),  # stage 1: at least one
        (2, False, 0, 2, 2), (3, False, 1, 3, 3),  # stages 2, 3: the busiest rank's count
        (0, True, 0, 2, 4), (2, True, 1, 2, 4),  # managed: GAS (4 here)
    ],
)  # fmt: skip
def test_backward_calls_is_the_rule(stage, managed, n, n_max, calls):
    assert idle_rank.backward_calls(stage, managed, n, n_max, gas=4) == calls


def test_rule_pads_where_some_rank_owes_a_call_or_nobody_has_data():
    assert not idle_rank.rule_pads(0, False, "idle") and not idle_rank.rule_pads(1, False, "ragged")
    assert idle_rank.rule_pads(1, False, "idle") and idle_rank.rule_pads(2, False, "ragged")
    assert idle_rank.rule_pads(0, False, "all_idle")  # nobody has data: skip the step
    assert all(idle_rank.rule_pads(s, True, "ragged") for s in range(4))


def test_appendix_a3_states_the_rule_of_the_module_word_for_word():
    """The course states the rule once, in appendix A3's section 1 (a table and two sentences);
    the module that pads by it says the same, word for word."""
    notebook = Path(__file__).resolve().parents[1] / "tutorials" / "A3_idle_ranks.ipynb"
    cells = json.loads(notebook.read_text())["cells"]
    text = "".join("".join(c["source"]) + "\n" for c in cells if c["cell_type"] == "markdown")
    end = "no rank calls backward() or step()."

    def rule(t: str) -> str:  # the docstring's "::" is rst for ":" and a table shown as written
        t = " ".join(re.sub(r"`+", "", t).replace("::", ":").split())
        return t[t.index("Every rank joins every collective") : t.index(end) + len(end)]

    assert "| **unmanaged** |" in text and rule(text) == rule(idle_rank.__doc__)


# The idle-rank refusals, each at its stage and mode, and the count of backward() calls their
# reason asks for: the words of appendix A3's rule for what backward_calls returns there.
IDLE_REFUSALS = {
    "idle_rank_stage1": (1, False, "at least once"),
    "idle_rank_stage2": (2, False, "as often as the busiest rank"),
    "idle_window_stage0_clipping": (0, True, "gradient_accumulation_steps times"),
    "idle_window_stage1": (1, True, "gradient_accumulation_steps times"),
    "idle_window_stage2": (2, True, "gradient_accumulation_steps times"),
}


@pytest.mark.parametrize("name", IDLE_REFUSALS)
def test_each_idle_refusal_asks_for_what_appendix_a3_asks(name):
    """A refusal's way out is the rule's count for its stage and mode (an idle rank: 0 of 2
    micro-batches, GAS 4), in A3's words, and it points to A3, where the rule is stated."""
    from gas_lab.rules.refusals import rule_named

    stage, managed, words = IDLE_REFUSALS[name]
    reason = rule_named(name).reason
    assert words in reason and "appendix A3" in reason
    calls = idle_rank.backward_calls(stage, managed, 0, 2, gas=4)
    assert calls == {"at least once": 1, "as often as the busiest rank": 2}.get(words, 4)


# ---------------------------------------------------------------- the committed measurement
def test_the_measurement_covers_every_case():
    """Every case of idle_rank.cases() (DeepSpeed at stages 0-3, gas_lab at its stages), once;
    a new case or a new gas_lab stage fails here until the file is re-measured."""
    assert sorted(map(_key, CASES)) == sorted(map(_key, idle_rank.cases()))
    assert {c["stage"] for c in _find(lib="deepspeed")} == {0, 1, 2, 3}
    for case in CASES:  # every case finished within the bound, with a verdict for every rank
        assert case["seconds"] < idle_rank.HANG_S + 30 and len(case["ranks"]) == 2


def test_the_raw_loop_fails_exactly_where_the_rule_pads():
    """Both libraries, every stage, mode and schedule, clipping at 1.0 (DeepSpeed's default):
    where the rule asks nothing of any rank, the raw loop trains right on every rank; where it
    pads a rank or skips the step, the raw loop does not (a rank raises, aborts, waits, or,
    when no rank has data at stage 0 unmanaged, every rank steps on zero gradients)."""
    checked = 0
    for case in _find(loop="raw", clip=1.0):
        pads = idle_rank.rule_pads(case["stage"], case["managed"], case["schedule"])
        if pads:
            assert _outcomes(case) != ["ok", "ok"], _key(case)
        else:
            assert _outcomes(case) == ["ok", "ok"], _key(case)
        checked += 1
    assert checked == 2 * 7 * 3  # modes x (DeepSpeed's 4 + gas_lab's 3 stages) x schedules


def test_the_rule_trains_right_everywhere():
    for case in _find(loop="rule"):
        assert _outcomes(case) == ["ok", "ok"], _key(case)
    assert len(_find(loop="rule")) == 2 * 7 * 3


def test_the_padding_is_counted_in_global_samples():
    """Unmanaged, a dummy backward() counts like a real one (micro-batch x W per call)."""
    (case,) = _find(lib="deepspeed", stage=2, managed=False, schedule="idle", loop="rule")
    for rank in case["ranks"]:
        calls = [c[3] for c in rank["counters"]]
        samples = [c[1] for c in rank["counters"]]
        assert samples == [idle_rank.MICRO * 2 * sum(calls[: i + 1]) for i in range(3)]
    assert case["ranks"][0]["counters"][1][3] == 2  # the idle rank ran 2 dummies


def test_deepspeed_stage1_idle_rank_raises_index_error_and_the_busy_rank_dies_with_it():
    for clip in (0.0, 1.0):
        (case,) = _find(lib="deepspeed", stage=1, managed=False, clip=clip, schedule="idle",
                        loop="raw")  # fmt: skip
        idle, busy = case["ranks"]
        assert (idle["exception"], idle["message"]) == ("IndexError", "list index out of range")
        # closed (measured with the interpreter's teardown) or reset (fresh ranks now skip it)
        assert re.search(r"Connection (closed|reset) by peer", busy["message"]), busy


# Managed, a rank whose real micro-batch runs before the boundary and whose boundary micro-step
# has no backward(): DeepSpeed's ZeRO-1/2 raise TypeError in that step() (no averaged gradient),
# and gas_lab's refusals (idle_window_stage1/2) look at the boundary micro-step, so gas_lab
# refuses at the same call with the same type instead of sending a collective gloo aborts on.
SHORT_WINDOWS = [
    {"lib": "gas_lab", "stage": stage, "managed": True, "clip": clip, "schedule": "ragged",
     "loop": "raw"}
    for stage in (1, 2) for clip in (1.0, 0.0)
]  # fmt: skip


def _same_verdict_or_refused_alike(ours) -> None:
    (theirs,) = [c for c in CASES if _key(c) == _key({**ours, "lib": "deepspeed"})]
    if all(k in ("ok", "wrong") for k in _outcomes(theirs)):
        assert _outcomes(ours) == _outcomes(theirs), _key(ours)
        diffs = [
            abs(a["diff"] - b["diff"]) for a, b in zip(ours["ranks"], theirs["ranks"], strict=True)
        ]
        assert max(diffs) <= idle_rank.TOL, _key(ours)
        return
    assert "ok" not in _outcomes(ours) and "wrong" not in _outcomes(ours), _key(ours)
    for mine, ds in zip(ours["ranks"], theirs["ranks"], strict=True):
        if ds["outcome"] == "raised" and "by peer" not in ds["message"]:  # not a peer's death
            assert mine.get("refused_as") == ds["exception"], _key(ours)


def test_gas_lab_does_what_deepspeed_does_or_refuses_as_it_fails():
    """Every raw case at gas_lab's stages: where DeepSpeed finishes, gas_lab reaches the same
    verdict (right, or the same wrong weights); where a DeepSpeed rank raises, gas_lab's raises
    too, and an exception DeepSpeed raises itself is the type of gas_lab's refusal; where
    DeepSpeed waits or aborts, gas_lab fails."""
    checked = _find(lib="gas_lab", loop="raw")
    for ours in checked:
        _same_verdict_or_refused_alike(ours)
    assert len(checked) >= 30


@pytest.mark.parametrize("case", SHORT_WINDOWS, ids=lambda g: f"stage{g['stage']}-clip{g['clip']}")
def test_gas_lab_refuses_a_managed_window_without_its_boundary_backward(case):
    (ours,) = _find(**case)
    _same_verdict_or_refused_alike(ours)
    short, busy = ours["ranks"]  # rank 0 has 1 micro-batch of GAS = 2, rank 1 has 2
    assert (short["exception"], short["refused_as"]) == ("RejectedCombination", "TypeError")
    # the peer's connection closed, or reset where it left data unread (it skips teardown)
    assert busy["outcome"] == "raised", busy
    assert re.search(r"Connection (closed|reset) by peer", busy["message"]), busy


@pytest.mark.parametrize("stage, raises", [(1, "IndexError"), (2, "TypeError")])
def test_gas_lab_at_stages_1_and_2_refuses_the_idle_rank_as_deepspeed_fails(stage, raises):
    (case,) = _find(lib="gas_lab", stage=stage, managed=False, clip=1.0, schedule="idle",
                    loop="raw")  # fmt: skip
    idle, busy = case["ranks"]
    assert (idle["exception"], idle["refused_as"]) == ("RejectedCombination", raises)
    # the peer's connection closed, or reset where it left data unread (it skips teardown)
    assert busy["outcome"] == "raised", busy
    assert re.search(r"Connection (closed|reset) by peer", busy["message"]), busy


def test_all_ranks_idle_at_stage_0_is_a_trap():
    """No rank has data and every rank calls step(): stage 0 unmanaged steps Adam on zero
    gradients (its moments still move the weights), with no error, on both libraries."""
    for case in _find(stage=0, managed=False, schedule="all_idle", loop="raw"):
        assert _outcomes(case) == ["wrong", "wrong"]
        assert min(r["diff"] for r in case["ranks"]) > 1e-4


# ---------------------------------------------------------------- live, on the ranks
LIVE = [
    (lib, stage, managed)
    for lib, stages in (("deepspeed", (0, 1, 2, 3)), ("gas_lab", (0, 1, 2)))
    for stage in stages
    for managed in (False, True)
]


def _live(lib, stage, managed):
    out = {}
    for schedule in idle_rank.SCHEDULES:
        case = {"lib": lib, "stage": stage, "managed": managed, "clip": 1.0, "schedule": schedule}
        out[schedule] = idle_rank.diff_to_reference({**case, "loop": "rule"})
        if not idle_rank.rule_pads(stage, managed, schedule):  # the rule asks nothing here
            out[f"{schedule}, raw"] = idle_rank.diff_to_reference({**case, "loop": "raw"})
    return out


@pytest.mark.ranks
@pytest.mark.parametrize("lib, stage, managed", LIVE)
def test_the_rule_matches_the_reference(cluster, lib, stage, managed):
    for diffs in cluster.run(_live, lib, stage, managed, timeout=180):
        assert max(diffs.values()) <= idle_rank.TOL, diffs


@pytest.mark.ranks
@pytest.mark.parametrize("lib", ["deepspeed", "gas_lab"])
def test_an_idle_rank_at_stage_1_still_fails_in_fresh_processes(lib):
    case = {"lib": lib, "stage": 1, "managed": False, "clip": 1.0}
    got = idle_rank.measure_case({**case, "schedule": "idle", "loop": "raw"})
    idle, busy = got["ranks"]
    if lib == "deepspeed":
        assert (idle["exception"], idle["message"]) == ("IndexError", "list index out of range")
    else:
        assert (idle["exception"], idle["refused_as"]) == ("RejectedCombination", "IndexError")
    # the peer's connection closed, or reset where it left data unread (it skips teardown)
    assert busy["outcome"] == "raised", busy
    assert re.search(r"Connection (closed|reset) by peer", busy["message"]), busy
    assert got["seconds"] < idle_rank.HANG_S  # the busy rank does not wait for a timeout
