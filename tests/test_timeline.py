"""Timelines (gas_lab.measure.recording, gas_lab.timeline, gas_lab.lessons.timeline_plots).

The 2-rank tests record every (library, stage, mode) once on the shared ranks (module fixture)
and check what the lessons assert: which collectives, how many bytes, inside which call; and
that gas_lab's sequence is DeepSpeed's. The rest runs without ranks on hand-made events.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from gas_lab import timeline as cli  # noqa: E402
from gas_lab.lessons import timeline_explorer as te  # noqa: E402
from gas_lab.lessons import timeline_plots as tp  # noqa: E402
from gas_lab.lessons.plots import svg  # noqa: E402
from gas_lab.measure import chrome_trace as ct  # noqa: E402
from gas_lab.measure import recording as tl  # noqa: E402
from gas_lab.measure.recording import Event  # noqa: E402
from gas_lab.toys import tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
W = 2
GRAD = sum(p.numel() * p.element_size() for p in tiny_model(0).parameters())  # 232 bytes
NUMEL = sum(p.numel() for p in tiny_model(0).parameters())
PADDED = math.ceil(NUMEL / (2 * W)) * 2 * W * 4  # ZeRO's flat vector, padded (lesson 05)
NORM = 4  # the gradient norm's squared sum, for clipping (DeepSpeed's default 1.0)
STEPS = 2
GAS = 3
RAGGED = [3, 1]  # unmanaged at stages 0/1: rank 0 runs 3 micro-batches, rank 1 one


def plan(stage, mode):
    """The micro-batches per rank each case runs: ragged where the stage allows it."""
    return RAGGED if mode == "unmanaged" and stage < 2 else [GAS, GAS]


def expected(stage, mode, n):
    """(call, collective, bytes) per optimizer step on a rank that runs ``n`` micro-batches:
    lessons 03-05 and 09 (gas_lab.measure.comm's docstring) in one table."""
    reduce = ("backward", "all_reduce", GRAD)
    if stage == 2:  # every backward() reduces (lesson 09)
        grads = [reduce] * n
    elif mode == "managed":  # inside the boundary micro-batch's backward() (lesson 03)
        grads = [reduce]
    else:  # inside step() (lesson 04)
        grads = [("step", "all_reduce", GRAD)]
    gather = [("step", "all_gather_into_tensor", PADDED)] if stage > 0 else []  # lesson 05
    return [*grads, ("step", "all_reduce", NORM), *gather]


CASES = [(lib, stage, mode) for lib in tl.LIBRARIES for stage in tl.STAGES for mode in tl.MODES]


@pytest.fixture(scope="module")
def recorded(cluster):
    """Every case, recorded once on the shared ranks: {(library, stage, mode): events}."""
    return {
        (lib, stage, mode): tl.record_on(
            cluster,
            library=lib,
            stage=stage,
            mode=mode,
            micro_batches=plan(stage, mode),
            steps=STEPS,
        )  # fmt: skip
        for lib, stage, mode in CASES
    }


# ---------------------------------------------------------------- recorded on 2 ranks
@pytest.mark.ranks
def test_collectives_per_rank_are_the_lessons_counts_and_bytes(recorded):
    for (lib, stage, mode), events in recorded.items():
        for rank in range(W):
            n = plan(stage, mode)[rank]
            got = tl.signature(events, rank)
            assert got == expected(stage, mode, n) * STEPS, (lib, stage, mode, rank)
            assert {c.group_size for c in tl.collectives(events, rank)} == {W}


@pytest.mark.ranks
def test_the_reduction_lies_inside_the_call_the_mode_and_stage_say(recorded):
    for (lib, stage, mode), events in recorded.items():
        for rank in range(W):
            n = plan(stage, mode)[rank]
            reductions = [c for c in tl.collectives(events, rank) if c.bytes == GRAD]
            backwards = tl.calls(events, rank, "backward")
            for c in tl.collectives(events, rank):  # nesting: inside a call, start to end
                assert any(c.within(e) for e in tl.calls(events, rank)), (lib, stage, mode, c)
            if stage == 2:
                assert [c.micro for c in reductions] == list(range(n)) * STEPS
                assert all(any(c.within(b) for c in reductions) for b in backwards)
            elif mode == "managed":  # the boundary micro-batch's backward, GAS - 1
                boundary = [b for b in backwards if b.micro == n - 1]
                assert len(reductions) == len(boundary) == STEPS
                assert all(c.within(b) for c, b in zip(reductions, boundary, strict=True))
            else:
                steps = tl.calls(events, rank, "step")
                assert all(c.within(s) for c, s in zip(reductions, steps, strict=True))
                assert not any(c.within(b) for c in reductions for b in backwards)


@pytest.mark.ranks
def test_engine_calls_counted_as_the_loop_made_them(recorded):
    for (lib, stage, mode), events in recorded.items():
        for rank in range(W):
            n, case = plan(stage, mode)[rank], (lib, stage, mode, rank)
            steps = tl.calls(events, rank, "step")
            assert len(tl.calls(events, rank, "forward")) == n * STEPS, case
            assert [b.micro for b in tl.calls(events, rank, "backward")] == list(range(n)) * STEPS
            if mode == "managed":  # a step() per micro-batch; the last one updates
                assert [(s.step, s.micro, s.boundary) for s in steps] == [
                    (k, m, m == n - 1) for k in range(STEPS) for m in range(n)
                ]
            else:
                assert [(s.step, s.micro, s.boundary) for s in steps] == [
                    (k, None, True) for k in range(STEPS)
                ]


@pytest.mark.ranks
def test_gas_lab_issues_deepspeeds_sequence_call_by_call(recorded):
    for stage in tl.STAGES:
        for mode in tl.MODES:
            ours, theirs = recorded["gas_lab", stage, mode], recorded["deepspeed", stage, mode]
            for rank in range(W):
                call_by_call = [
                    [(e.cat, e.name, e.step, e.micro, e.bytes) for e in run if e.rank == rank]
                    for run in (ours, theirs)
                ]
                assert call_by_call[0] == call_by_call[1], (stage, mode, rank)
            # DeepSpeed's own calls (deepspeed.comm), named as the torch functions they reach
            assert all(c.function.startswith("deepspeed.comm.") for c in tl.collectives(theirs))


@pytest.mark.ranks
def test_recorded_trace_validates_and_reads_back(recorded):
    events = recorded["deepspeed", 1, "unmanaged"]
    trace = json.loads(json.dumps(ct.chrome_trace(events, library="deepspeed")))
    assert ct.validate_trace(trace) == []
    assert {t["pid"] for t in trace["traceEvents"]} == {0, 1}
    back = events_from_trace(trace)
    assert sorted(back, key=_key) == sorted(events, key=_key)


def _key(e):
    return (e.rank, e.start_ns, e.cat)


@pytest.mark.ranks
def test_the_rank_with_fewer_micro_batches_waits_inside_the_reduction(cluster, recorded):
    # Each forward 50 ms longer (the tiny model's own is shorter than a shared CPU's noise):
    # rank 0 reaches the all_reduce after 2 more forwards than rank 1.
    delay = 0.05
    runs = cluster.run(tl.record_run, library="gas_lab", stage=0, mode="unmanaged",
                       micro_batches=RAGGED, steps=1, forward_s=delay)  # fmt: skip
    first = {r: tl.collectives(runs[r], r)[0] for r in range(W)}
    assert first[0].name == first[1].name == "all_reduce" and first[0].parent == "step"
    # Measured: rank 1 (1 micro-batch) calls the all_reduce before rank 0 (3) does, and waits
    # inside it for rank 0's two more forwards; rank 0 finds rank 1 there. Both leave together,
    # so rank 1 waits 2 forwards (2 x delay) longer, less any skew in their starts. Rank 0's own
    # wait is the reduction's cost, which a loaded CPU stretches (55 ms once in CI): compare the
    # difference, not rank 0's wait, with the delay.
    waits = {r: (first[r].end_ns - first[r].start_ns) / 1e9 for r in range(W)}
    assert first[1].start_ns < first[0].start_ns
    assert waits[1] - waits[0] > delay, waits
    # Drawn: the same collective ends together; only rank 1 has a waiting part.
    events = recorded["gas_lab", 0, "unmanaged"]
    first = {r: tl.collectives(events, r)[0] for r in range(W)}
    placed = {p.event: p for p in tp.layout(events)}
    p0, p1 = placed[first[0]], placed[first[1]]
    assert p0.x1 == p1.x1 and p0.ready == p1.ready == p0.x0
    assert p1.x0 < p1.ready


@pytest.mark.ranks
def test_figures_from_recorded_runs_are_readable(recorded):
    figs = [
        tp.plot_timeline(recorded["gas_lab", 2, "managed"]),
        tp.plot_timeline(recorded["deepspeed", 0, "unmanaged"], time="real"),
        tp.plot_side_by_side(
            {lib: recorded[lib, 1, "unmanaged"] for lib in tl.LIBRARIES}, title="stage 1"
        ),
    ]
    for fig in figs:
        _assert_readable(fig)
    # the side-by-side: the same sequence is drawn at the same places
    top, bottom = ([(round(p.x0, 6), round(p.x1, 6)) for p in tp.layout(recorded[lib, 1, "unmanaged"])]
                   for lib in tl.LIBRARIES)  # fmt: skip
    assert top == bottom


@pytest.mark.ranks
def test_explorer_on_the_ranks_draws_a_recorded_run(cluster, capsys):
    box = te.timeline_explorer(cluster)  # gas_lab, stage 0, unmanaged, N = 3, 1
    (events,) = box.recorded.values()
    assert [tl.signature(events, r) for r in range(W)] == [
        expected(0, "unmanaged", n) for n in RAGGED
    ]
    assert "<svg" in box._repr_mimebundle_()["text/html"]
    capsys.readouterr()


def _assert_readable(fig):
    """At most 800 px wide on a page, no text under 9 pt, no two labels overlapping, every
    label inside its bar."""
    assert fig.get_figwidth() * 96 <= 800
    fig.draw_without_rendering()
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text()]
    assert min(t.get_fontsize() for t in texts) >= 9
    boxes = [(t.get_text(), t.get_window_extent()) for t in texts]
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1 :]:
            assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"
    labels = [t for ax in fig.axes for t in ax.texts if hasattr(t, "_gas_lab_box")]
    assert any(t.get_visible() for t in labels)
    for t in labels:
        if t.get_visible():
            left, right = t.axes.transData.transform([(x, 0) for x in t._gas_lab_box])[:, 0]
            box = t.get_window_extent()
            assert left <= box.x0 and box.x1 <= right, t.get_text()


# ---------------------------------------------------------------- the command
@pytest.mark.ranks
def test_a_ddp_loop_is_recorded_with_its_all_reduces_inside_backward(cluster):
    """Lesson 02's picture: torch DDP's loop (no engine) recorded by record_loop, for each
    placement of no_sync(); an all-reduce of the whole gradient inside every backward, or only
    inside the last one of each step when no_sync() wraps forward and backward."""
    from gas_lab.lessons.loops import PLACEMENTS, ddp_train

    for placement in PLACEMENTS:
        for rank, result in enumerate(cluster.run(ddp_train, placement, GAS, STEPS)):
            events, case = result["events"], (placement, rank)
            assert tl.ranks(events) == [rank]
            backwards = tl.calls(events, rank, "backward")
            assert len(tl.calls(events, rank, "forward")) == len(backwards) == GAS * STEPS, case
            assert [b.micro for b in backwards] == list(range(GAS)) * STEPS
            steps = [(s.step, s.micro, s.boundary) for s in tl.calls(events, rank, "step")]
            assert steps == [(k, None, True) for k in range(STEPS)], case
            reduces = tl.collectives(events, rank)
            assert {(c.name, c.bytes, c.parent, c.group_size) for c in reduces} == {
                ("all_reduce", GRAD, "backward", W)
            }, case
            assert all(any(c.within(b) for b in backwards) for c in reduces)
            last_only = placement == "forward_and_backward"
            micros = [GAS - 1] if last_only else list(range(GAS))
            assert [(c.step, c.micro) for c in reduces] == [
                (k, m) for k in range(STEPS) for m in micros
            ], case
            assert (result["calls"], result["bytes"]) == (len(reduces), GRAD * len(reduces))
    fig = tp.plot_timeline([e for r in cluster.run(ddp_train, "none", 2, 1) for e in r["events"]])
    _assert_readable(fig)


@pytest.mark.ranks
def test_command_under_torchrun_writes_one_valid_trace_for_all_ranks(tmp_path):
    out = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "gas_lab.timeline", "--library", "deepspeed", "--stage", "1",
           "--mode", "unmanaged", "--micro-batches", "3,1", "--out", str(out)]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trace = json.loads(out.read_text())
    assert ct.validate_trace(trace) == []
    assert trace["otherData"]["micro_batches"] == [3, 1]
    names = {t["pid"]: t["args"]["name"] for t in trace["traceEvents"] if t["name"] == "process_name"}  # fmt: skip
    assert names == {0: "rank 0", 1: "rank 1"}
    events = events_from_trace(trace)
    for rank, n in enumerate([3, 1]):
        assert tl.signature(events, rank) == expected(1, "unmanaged", n)
        assert tl.describe(events, rank) in proc.stdout
    assert f"wrote {out}" in proc.stdout


@pytest.mark.parametrize(
    ("argv", "world", "named"),
    [
        (["--library", "torch"], 2, "--library"),
        (["--stage", "3"], 2, "--stage"),
        (["--mode", "auto"], 2, "--mode"),
        (["--micro-batches", "3,1"], 1, "--micro-batches"),  # 2 counts, 1 rank
        (["--micro-batches", "3,1,2"], 2, "--micro-batches"),
        (["--micro-batches", "0,1", "--mode", "unmanaged"], 2, "--micro-batches"),
        (["--micro-batches", "three"], 2, "--micro-batches"),
        (["--micro-batches", "3,1"], 2, "--micro-batches"),  # managed: must be equal
        (["--micro-batches", "3,1", "--mode", "unmanaged", "--stage", "2"], 2, "--micro-batches"),
        (["--steps", "0"], 2, "--steps"),
        (["--out", "/no/such/dir/t.json"], 2, "--out"),
        (["--gradient-clipping", "-1"], 2, "--gradient-clipping"),
    ],
)
def test_bad_arguments_get_one_line_naming_the_argument(argv, world, named, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.parse(argv, world=world)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert len(err.strip().splitlines()) == 1 and f"argument {named}:" in err, err


def test_bad_argument_from_the_shell_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "gas_lab.timeline", "--stage", "3"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "gas_lab.timeline: error: argument --stage: '3': choose 0, 1 or 2 (gas_lab builds ZeRO "
        "stages 0-2, so both libraries compare there)"
    ]


def test_a_good_plan_per_rank():
    args = cli.parse(["--micro-batches", "3,1", "--mode", "unmanaged", "--steps", "2"], world=2)
    assert (args.micro_batches, args.steps, args.library, args.stage) == ([3, 1], 2, "gas_lab", 0)
    assert tl.check_plan("deepspeed", 2, "managed", [4], 1, 2) == [4, 4]  # one count: every rank
    with pytest.raises(tl.PlanError, match="micro_batches: 3,1 differ"):
        tl.check_plan("gas_lab", 0, "managed", [3, 1], 1, 2)


# ---------------------------------------------------------------- the format, without ranks
def _events(per_rank):
    """Hand-made events of a stage-0 run: ``per_rank[r]`` micro-batches on rank r, one step,
    1 µs per forward/backward, the reduction in step() waiting for the last rank."""
    out, t_reduce = [], 2000 * max(per_rank) + 100
    for r, n in enumerate(per_rank):
        t = 0
        for m in range(n):
            out += [tl.Event(r, "engine", "forward", t, t + 900, 0, m),
                    tl.Event(r, "engine", "backward", t + 1000, t + 1900, 0, m)]  # fmt: skip
            t += 2000
        out += [
            tl.Event(r, "engine", "step", t, t_reduce + 2000, 0, None, True),
            tl.Event(r, "collective", "all_reduce", t + 50, t_reduce + 500, 0, None,
                     bytes=GRAD, group_size=2, dtype="float32", parent="step"),
            tl.Event(r, "collective", "all_reduce", t_reduce + 600, t_reduce + 700, 0, None,
                     bytes=NORM, group_size=2, dtype="float32", parent="step"),
        ]  # fmt: skip
    return out


def test_a_trace_has_the_promised_format():
    trace = ct.chrome_trace(_events([3, 1]), library="gas_lab")
    assert ct.validate_trace(trace) == []
    x = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    assert {t["cat"] for t in x} == {"engine", "collective"}
    reduce = next(t for t in x if t["cat"] == "collective")
    assert reduce["name"] == "all_reduce" and reduce["args"]["bytes"] == GRAD
    assert reduce["ts"] == 6.05 and reduce["dur"] == 0.55  # µs, from ns
    assert trace["otherData"] == {"library": "gas_lab"}


@pytest.mark.parametrize(
    ("break_it", "problem"),
    [
        (lambda t: t.pop("traceEvents"), '"traceEvents" list'),
        (lambda t: _engine(t).update(ph="B"), "ph 'B', expected \"X\""),
        (lambda t: _engine(t).update(dur=-1), "dur -1 is not a number"),
        (lambda t: _engine(t).update(pid="0"), "pid '0' is not an integer"),
        (lambda t: _engine(t).update(cat="misc"), "cat 'misc'"),
        (lambda t: _engine(t).update(name="zero_grad"), "engine call 'zero_grad'"),
        (lambda t: _collective(t)["args"].pop("bytes"), "args.bytes None"),
        (lambda t: _collective(t).update(name="send"), "'send' is not a torch.distributed"),
        (lambda t: _collective(t).update(dur=1e6), "without nesting"),
        (lambda t: t["traceEvents"].pop(0), 'pid 0: no "process_name"'),
    ],
)
def test_the_validator_names_what_is_wrong(break_it, problem):
    trace = ct.chrome_trace(_events([2, 2]))
    break_it(trace)
    problems = ct.validate_trace(trace)
    assert any(problem in p for p in problems), problems


def _engine(trace):
    return next(t for t in trace["traceEvents"] if t.get("cat") == "engine")


def _collective(trace):
    return next(t for t in trace["traceEvents"] if t.get("cat") == "collective")


def test_logical_layout_lines_up_each_collective_and_shows_the_wait():
    placed = tp.layout(_events([3, 1]))
    reduces = [p for p in placed if p.event.cat == "collective"]
    by_rank = {r: [p for p in reduces if p.event.rank == r] for r in range(W)}
    for k in range(2):  # the k-th collective ends at the same x on both ranks
        assert by_rank[0][k].x1 == by_rank[1][k].x1
    assert by_rank[1][0].x0 < by_rank[1][0].ready == by_rank[0][0].x0  # rank 1 waits
    assert by_rank[0][0].x0 == by_rank[0][0].ready  # rank 0 arrives last: no wait
    steps = [p for p in placed if p.event.name == "step"]
    assert all(p.x0 <= c.x0 and c.x1 <= p.x1 for p in steps for c in by_rank[p.event.rank])
    with pytest.raises(ValueError, match="time 'wall'"):
        tp.layout(_events([1, 1]), time="wall")


def test_hand_made_figure_is_readable_and_writes_svg():
    fig = tp.plot_timeline(_events([3, 1]), title="stage 0, unmanaged, N = 3, 1")
    _assert_readable(fig)
    text = svg(fig)
    assert text.startswith("<svg") and ">all_reduce" in text  # text kept as text


class FakeCluster:
    """Answers record_run with hand-made events, so the explorer runs without ranks."""

    world_size = 2

    def __init__(self):
        self.calls = []

    def run(self, fn, **kwargs):
        self.calls.append(kwargs)
        events = _events(kwargs["micro_batches"])
        return [[e for e in events if e.rank == r] for r in range(self.world_size)]


def test_a_plain_loop_is_recorded_and_put_back_as_it_was():
    """record_loop without ranks: forward, every Tensor.backward() and optimizer.step(), each
    step a boundary; afterwards the model, the optimizer and torch.Tensor are untouched."""
    import torch

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backward, step = torch.Tensor.backward, optimizer.step
    with tl.record_loop(model, optimizer) as events:
        for _ in range(2):
            for _ in range(3):
                model(torch.ones(1, 4)).sum().backward()
            optimizer.step()
    assert [(e.name, e.step) for e in events] == [
        (name, k) for k in range(2) for name in ["forward", "backward"] * 3 + ["step"]
    ]
    assert [e.micro for e in tl.calls(events, 0, "backward")] == [0, 1, 2] * 2
    assert all(e.boundary for e in tl.calls(events, 0, "step")) and not tl.collectives(events)
    assert torch.Tensor.backward is backward and "step" not in vars(optimizer)
    assert "forward" not in vars(model) and optimizer.step == step
    with pytest.raises(RuntimeError, match="boom"), tl.record_loop(model, optimizer):
        raise RuntimeError("boom")  # an error inside the block puts everything back too
    assert torch.Tensor.backward is backward and "forward" not in vars(model)


def test_explorer_records_each_setting_once_and_says_why_it_cannot(capsys):
    cluster = FakeCluster()
    box = te.timeline_explorer(cluster)
    assert len(cluster.calls) == 1 and "N = 3, 1" in box.message.value
    box.stage.value = 1
    box.stage.value = 0  # seen before: drawn again, not recorded again
    assert [c["stage"] for c in cluster.calls] == [0, 1]
    bundle = box._repr_mimebundle_()
    assert "<svg" in bundle["text/html"]  # the picture a viewer without a kernel shows
    box.mode.value = "managed"  # 3, 1 cannot run managed: said, not run
    assert len(cluster.calls) == 2 and "Not run" in box.message.value
    assert "gradient_accumulation_steps" in box.message.value
    # No picture under "Not run": the last one showed another setting than the buttons do.
    assert "<svg" not in box._repr_mimebundle_()["text/html"]
    box.mode.value = "unmanaged"  # runnable again: its picture comes back
    assert "<svg" in box._repr_mimebundle_()["text/html"]
    capsys.readouterr()


def test_explorer_without_ipywidgets_is_the_static_figure(monkeypatch):
    monkeypatch.setattr(te, "w", None)
    fig = te.timeline_explorer(FakeCluster(), stage=1)
    assert isinstance(fig, matplotlib.figure.Figure) and fig.axes


def test_the_docs_snippet_runs(capsys):
    """docs/concepts/timeline.md's notebook code, as written (ranks answered by FakeCluster)."""
    text = (ROOT / "docs" / "concepts" / "timeline.md").read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    cluster = FakeCluster()
    exec(snippet, {"cluster": cluster})
    assert [c["library"] for c in cluster.calls] == ["gas_lab", "deepspeed", "gas_lab"]
    capsys.readouterr()


def events_from_trace(trace: dict) -> list[Event]:
    """The events back from chrome_trace()'s output (after validate_trace())."""
    out = []
    for t in trace["traceEvents"]:
        if t.get("ph") != "X":
            continue
        a = t.get("args", {})
        start = round(t["ts"] * 1000)
        out.append(
            Event(
                t["pid"],
                t["cat"],
                t["name"],
                start,
                start + round(t["dur"] * 1000),
                a.get("step"),
                a.get("micro_batch"),
                bool(a.get("boundary", False)),
                a.get("bytes", 0),
                a.get("group_size", 0),
                a.get("dtype", ""),
                a.get("called", ""),
                a.get("inside") or "",
            )
        )
    return out
