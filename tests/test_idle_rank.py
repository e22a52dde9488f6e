"""A rank with nothing to train on (gas_lab/measure/idle_rank.py, lesson 07).

The committed measurement (data/deepspeed_<version>_idle_rank.json) says, per ZeRO stage, what
DeepSpeed and gas_lab do; here the cases that finish are re-run on the ranks (the workaround at
every stage, on both libraries), and two that crash a rank are re-run in fresh processes.
"""

import json
from importlib.metadata import version

import pytest
import torch

from gas_lab.measure import idle_rank

DATA = idle_rank.DATA / f"deepspeed_{version('deepspeed')}_idle_rank.json"
CASES = json.loads(DATA.read_text())["cases"]


def _find(**axes) -> list[dict]:
    return [c for c in CASES if all(c[k] == v for k, v in axes.items())]


def _outcomes(case) -> list[str]:
    return [r["outcome"] for r in case["ranks"]]


def _key(case) -> str:
    return json.dumps({k: case[k] for k in ("lib", "stage", "managed", "clip", "schedule", "loop")})


def test_the_measurement_covers_every_case():
    """Every case of idle_rank.cases() (DeepSpeed at stages 0-3, gas_lab at its stages), once;
    a new gas_lab stage fails here until the file is re-measured."""
    assert sorted(map(_key, CASES)) == sorted(map(_key, idle_rank.cases()))
    assert {c["stage"] for c in _find(lib="deepspeed")} == {0, 1, 2, 3}
    for case in CASES:  # every case finished within the bound, with a verdict for every rank
        assert case["seconds"] < idle_rank.HANG_S + 30 and len(case["ranks"]) == 2


def test_deepspeed_unmanaged_idle_rank_per_stage():
    """One idle rank, unmanaged, as measured: stage 0 reduces zeros for it and trains right;
    stage 1 raises IndexError on the idle rank and the busy rank dies with it; stages 2 and 3
    fail too."""
    for case in _find(lib="deepspeed", managed=False, schedule="idle", loop="raw"):
        idle, busy = case["ranks"]
        if case["stage"] == 0:
            assert _outcomes(case) == ["ok", "ok"]
            continue
        assert idle["outcome"] == "raised" and busy["outcome"] in ("raised", "abort", "hang")
        if case["stage"] == 1:
            assert (idle["exception"], idle["message"]) == ("IndexError", "list index out of range")
            assert "Connection closed by peer" in busy["message"]


def test_gas_lab_does_what_deepspeed_does_or_refuses_as_it_fails():
    """Every case at gas_lab's stages, managed or not, one rank or every rank idle: where
    DeepSpeed finishes, gas_lab reaches the same verdict (right, or the same wrong weights);
    where a DeepSpeed rank raises, gas_lab's raises too, and an exception DeepSpeed raises
    itself is the type of gas_lab's refusal; where DeepSpeed waits or aborts, gas_lab fails."""
    checked = 0
    for ours in _find(lib="gas_lab", loop="raw"):
        (theirs,) = [c for c in CASES if _key(c) == _key({**ours, "lib": "deepspeed"})]
        if all(k in ("ok", "wrong") for k in _outcomes(theirs)):
            assert _outcomes(ours) == _outcomes(theirs), _key(ours)
            diffs = [
                abs(a["diff"] - b["diff"])
                for a, b in zip(ours["ranks"], theirs["ranks"], strict=True)
            ]
            assert max(diffs) <= idle_rank.TOL, _key(ours)
            checked += 1
            continue
        assert "ok" not in _outcomes(ours) and "wrong" not in _outcomes(ours), _key(ours)
        for mine, ds in zip(ours["ranks"], theirs["ranks"], strict=True):
            if ds["outcome"] == "raised" and "by peer" not in ds["message"]:  # not a peer's death
                assert mine.get("refused_as") == ds["exception"], _key(ours)
        checked += 1
    assert checked == len(_find(lib="gas_lab", loop="raw")) >= 16


@pytest.mark.parametrize("stage, raises", [(1, "IndexError"), (2, "TypeError")])
def test_gas_lab_at_stages_1_and_2_refuses_the_idle_rank_as_deepspeed_fails(stage, raises):
    (case,) = _find(lib="gas_lab", stage=stage, managed=False, clip=1.0, schedule="idle",
                    loop="raw")  # fmt: skip
    idle, busy = case["ranks"]
    assert (idle["exception"], idle["refused_as"]) == ("RejectedCombination", raises)
    assert busy["outcome"] == "raised" and "closed by peer" in busy["message"]


def test_the_workaround_trains_right_everywhere_it_was_measured():
    for case in _find(loop="workaround"):
        assert _outcomes(case) == ["ok", "ok"], case


def test_all_ranks_idle_at_stage_0_is_a_trap():
    """No rank has data and every rank calls step(): DeepSpeed's stage 0 unmanaged steps Adam
    on zero gradients (its moments still move the weights), with no error."""
    for case in _find(lib="deepspeed", stage=0, managed=False, schedule="all_idle", loop="raw"):
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
        got = idle_rank.run(lib, stage, managed, 1.0, schedule, "workaround")
        ref = idle_rank.reference(managed, 1.0, schedule)
        out[schedule] = (torch.tensor(got["params"]) - ref).abs().max().item()
    if stage == 0 and not managed:  # the idle rank needs nothing at stage 0
        got = idle_rank.run(lib, 0, False, 1.0, "idle", "raw")
        out["raw"] = torch.tensor(got["params"]) - idle_rank.reference(False, 1.0, "idle")
        out["raw"] = out["raw"].abs().max().item()
    return out


@pytest.mark.ranks
@pytest.mark.parametrize("lib, stage, managed", LIVE)
def test_the_workaround_matches_the_reference(cluster, lib, stage, managed):
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
    assert busy["outcome"] == "raised" and "closed by peer" in busy["message"]
    assert got["seconds"] < idle_rank.HANG_S  # the busy rank does not wait for a timeout
