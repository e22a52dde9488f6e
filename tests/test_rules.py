"""gas_lab's rules agree with the matrix measured on DeepSpeed (data/deepspeed_*_matrix.json).

Three levels: the rules *data* predict every measured case (no engine); each rule, run on
gas_lab's engine, fires with its message at its moment; and on 2 ranks gas_lab's engine
accepts and rejects exactly what DeepSpeed did in gas_lab's scope (ZeRO 0/1, ZeRO 2 in fp32,
no offload/pipeline/compile), and outside it says "not in gas_lab" before DeepSpeed would fail.
"""

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gas_lab import initialize
from gas_lab.errors import ConfigError, RejectedCombination
from gas_lab.measure import matrix, prediction
from gas_lab.rules import refusals
from gas_lab.toys import tiny_model

ROOT = Path(__file__).resolve().parents[1]


CASES = prediction.measured_matrix()["cases"]
LENIENT = {"managed_string_no", "managed_typo"}  # DeepSpeed accepts; gas_lab refuses on purpose


def in_scope(case) -> bool:
    """The brief's scope, written independently of refusals.OUT_OF_SCOPE (so it can catch it):
    ZeRO 0/1, fp32 or bf16 (lesson 08), accumulation in the model's dtype or in fp32; ZeRO 2
    in fp32 (lesson 09); no offload/pipeline/compile."""
    c, axes = case["config"], case["axes"]
    zero = c.get("zero_optimization", {})
    bf16 = c.get("bf16", {}).get("enabled", False)
    accum = c.get("data_types", {}).get("grad_accum_dtype")
    below_model = accum not in (None, "fp32") and not (bf16 and accum == "bf16")
    stage = zero.get("stage", 0)
    default_zero2 = (  # DeepSpeed's default reduction; any bucket size
        zero.get("reduce_scatter", True)
        and zero.get("contiguous_gradients", True)
        and not zero.get("round_robin_gradients", False)
    )
    return (
        (stage <= 1 or (stage == 2 and not bf16 and accum in (None, "fp32") and default_zero2))
        and "offload_optimizer" not in zero
        and not c.get("fp16", {}).get("enabled")
        and not (zero.get("stage", 0) == 1 and below_model)  # DeepSpeed-only lower buffer
        and not case["pipeline"]
        and not c.get("compile", {}).get("deepcompile")
        and axes.get("check") not in LENIENT
    )


# Rules no script of gas_lab.measure.matrix reaches; tests/test_parity.py checks each one
# against live DeepSpeed instead (test_refusals_match_deepspeed runs every rule's example).
NOT_IN_MATRIX = {
    "coalesce_nested",
    "idle_rank_stage1",
    "idle_window_stage1",
    "idle_rank_stage2",
    "idle_window_stage2",
    "idle_window_stage0_clipping",
}


# ---------------------------------------------------------------- 1. the data alone
def test_rules_predict_every_measured_case():
    wrong = []
    for case in CASES:
        try:
            rule, op = prediction.predict(case["config"], case["ops"], case["pipeline"])
        except ConfigError:
            # gas_lab refuses to parse it; only DeepSpeed's leniency cases may do that.
            if case["axes"].get("check") not in LENIENT or case["outcome"] != "accepted":
                wrong.append(f"{case['id']}: gas_lab cannot parse a config DeepSpeed measured")
            continue
        if rule is None:
            if case["outcome"] != "accepted":
                wrong.append(f"{case['id']}: no rule, but DeepSpeed raised {case['exception']}")
            continue
        got = (rule.deepspeed_raises, rule.moment, op)
        expected = (case["exception"], case["moment"], case["raised_in"])
        if case["outcome"] != "rejected":
            wrong.append(f"{case['id']}: rule {rule.name} fires, but DeepSpeed accepted it")
        elif got != expected or not case["message"].startswith(rule.deepspeed_message):
            wrong.append(f"{case['id']}: rule {rule.name} predicts {got}, measured {expected}")
    assert not wrong, f"{len(wrong)} cases disagree:\n" + "\n".join(wrong)


def test_every_rule_is_seen_in_the_matrix():
    predicted = [
        prediction.predict(c["config"], c["ops"], c["pipeline"])[0] for c in CASES if _parses(c)
    ]
    seen = {r.name for r in predicted if r is not None}
    assert {r.name for r in refusals.RULES + refusals.DEEPSPEED_ONLY} - NOT_IN_MATRIX == seen


def _parses(case) -> bool:
    return case["axes"].get("check") not in LENIENT


def test_predict_walks_the_ops():
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {}}}
    assert prediction.predict(base, ["enter_no_sync", "exit_no_sync", "backward", "step"]) == (
        None,
        None,
    )
    rule, op = prediction.predict(base, ["enter_no_sync", "backward", "step"])
    assert (rule.name, op) == ("step_in_no_sync", "step")
    unmanaged = {**base, "managed_gradient_accumulation": False}
    rule, op = prediction.predict(unmanaged, ["backward", "set_boundary_false"])
    assert (rule.name, op) == ("unmanaged_set_boundary", "set_boundary_false")
    zero1 = {**base, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    rule, op = prediction.predict(zero1, ["enter_no_sync", "enter_coalesce"])
    assert (rule.name, op) == ("coalesce_nested", "enter_coalesce")
    rule, op = prediction.predict(zero1, ["enter_coalesce", "backward", "step"])
    assert (rule.name, op) == ("step_in_no_sync", "step")  # coalescing suspends like no_sync
    assert prediction.predict(zero1, ["enter_coalesce", "exit_coalesce", "step"]) == (None, None)
    idle = {**zero1, "managed_gradient_accumulation": False}  # a step() with no backward before
    assert prediction.predict(idle, ["backward", "step"]) == (None, None)
    for ops in (["step"], ["backward", "step", "step"]):
        assert prediction.predict(idle, ops)[0].name == "idle_rank_stage1"
    assert prediction.predict({**idle, "zero_optimization": {"stage": 0}}, ["step"]) == (None, None)
    # Managed, the boundary step() of a window without backward(): refused where DeepSpeed fails
    gas2 = {**zero1, "gradient_accumulation_steps": 2, "train_batch_size": 2}
    assert prediction.predict(gas2, ["step", "backward", "step"]) == (None, None)
    assert prediction.predict(gas2, ["step", "step"])[0].name == "idle_window_stage1"
    # A backward() earlier in the window does not stand in for the boundary micro-step's, and
    # one inside no_sync() does not reduce (coalescing's exit does, boundary or not).
    for ops in (["backward", "step", "step"],
                ["backward", "step", "enter_no_sync", "backward", "exit_no_sync", "step"]):  # fmt: skip
        assert prediction.predict(gas2, ops) == (refusals.rule_named("idle_window_stage1"), "step")
    coalesced = ["enter_coalesce", "backward", "exit_coalesce", "step", "step"]
    assert prediction.predict(gas2, coalesced) == (None, None)
    zero2 = {"zero_optimization": {"stage": 2}}
    assert prediction.predict({**idle, **zero2}, ["step"])[0].name == "idle_rank_stage2"
    assert prediction.predict({**gas2, **zero2}, ["step", "step"])[0].name == "idle_window_stage2"
    assert prediction.predict(base, ["step"])[0].name == "idle_window_stage0_clipping"
    assert prediction.predict({**base, "gradient_clipping": 0.0}, ["step"]) == (None, None)


def test_a_refusal_says_what_it_prevents_without_calling_it_silent():
    """Not every prevented failure is silent (lesson 06 sorts them): the message says
    "Prevents:", whatever the rule's kind."""
    for rule in refusals.ALL_RULES:
        message = str(RejectedCombination.of(rule))
        assert f"\n  Prevents: {rule.prevents}\n" in message, rule.name
        assert "silent failure" not in message.lower(), rule.name


def test_table_has_every_rule_once_as_markdown():
    md = refusals.table_markdown().splitlines()
    assert len(md) == 2 + len(refusals.table())
    for rule in refusals.RULES + refusals.DEEPSPEED_ONLY:
        assert sum(f"| {rule.name} |" in line for line in md) == 1


def test_skipping_is_scoped_to_its_block():
    rule = next(r for r in refusals.RULES if r.name == "unmanaged_overlap_comm")
    config = refusals.example_config(rule, _base())
    with refusals.skipping({rule.name}):
        assert prediction.predict(config) == (None, None)
    assert prediction.predict(config)[0] is rule


def test_a_rule_travels_pickled_by_name():
    """Ranks send refusals back pickled, and a rule's condition (often a lambda) does not
    pickle: a rule of ALL_RULES travels by name and comes back whole, even in a process that
    has imported nothing of gas_lab yet; any other rule travels without its condition."""
    rule = refusals.rule_named("idle_window_stage2")
    assert pickle.loads(pickle.dumps(rule)) is rule
    receive = "import pickle, sys; r = pickle.loads(sys.stdin.buffer.read()); "
    receive += "print(r.name, r.applies is not None, r.order)"
    fresh = subprocess.run(
        [sys.executable, "-c", receive], input=pickle.dumps(rule), capture_output=True, check=True
    )
    assert fresh.stdout.split() == [b"idle_window_stage2", b"True", b"20"]
    mine = dataclasses.replace(rule, name="my_rule")
    back = pickle.loads(pickle.dumps(mine))
    assert back == mine and back.applies is None


# ---------------------------------------------------------------- 2. each rule on the engine
def _base():
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    }


@pytest.fixture
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _first_case(rule):
    for case in CASES:
        if (
            _parses(case)
            and prediction.predict(case["config"], case["ops"], case["pipeline"])[0] is rule
        ):
            return case
    raise AssertionError(f"no measured case for {rule.name}")


class PipelineModule(torch.nn.Sequential):
    """Stands in for deepspeed.pipe.PipelineModule (which needs a process group to build)."""


def _model(pipeline: bool):
    return PipelineModule(*tiny_model(0)) if pipeline else tiny_model(0)


MEASURED_RULES = [r for r in refusals.RULES if r.name not in NOT_IN_MATRIX]


@pytest.mark.parametrize("rule", MEASURED_RULES, ids=lambda r: r.name)
def test_rule_fires_on_the_engine_with_its_message_at_its_moment(rule, single_process):
    case = _first_case(rule)
    got = matrix.run_case(initialize, case, model_fn=_model)
    # The same op as DeepSpeed's: "initialize", or a call, or entering the with-block.
    assert (got["raised_in"], got["moment"]) == (case["raised_in"], case["moment"])
    assert got["moment"] == rule.moment
    # gas_lab's own class, which is also DeepSpeed's type: code written for DeepSpeed catches it
    assert got["exception"] == "RejectedCombination" and case["exception"] in got["is_a"]
    for key in rule.keys:
        assert key in got["message"]
    assert rule.reason in got["message"] and rule.prevents in got["message"]
    assert rule.deepspeed_message in got["message"]  # DeepSpeed's own words, quoted
    assert f"raises {case['exception']} at {case['moment']}" in got["message"]


@pytest.mark.parametrize("outer", ["no_sync", "coalesce_grad_reduction"])
def test_coalesce_nested_fires_on_entering_the_inner_block(outer, single_process):
    model = tiny_model(0)
    config = {**_base(), "zero_optimization": {"stage": 1}}
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config)
    with getattr(engine, outer)():
        inner = engine.coalesce_grad_reduction()
        with pytest.raises(AssertionError, match="coalesce_grad_reduction") as err:
            inner.__enter__()  # DeepSpeed's type, and gas_lab's RejectedCombination
    assert isinstance(err.value, RejectedCombination)
    assert err.value.rule.name == "coalesce_nested"
    assert "raises AssertionError at context" in str(err.value)
    assert not engine.inside_no_sync_ctxt  # the outer block still cleaned up


def test_context_rules_fire_on_entering_not_on_creating(single_process):
    model = tiny_model(0)
    config = {**_base(), "managed_gradient_accumulation": False}
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config)
    block = engine.coalesce_grad_reduction()  # creating the context manager checks nothing
    with pytest.raises(RejectedCombination, match="coalesce_grad_reduction"):
        block.__enter__()


# ---------------------------------------------------------------- 3. gas_lab vs the matrix
def _gas_lab(cases):
    return matrix.measure(cases, engine="gas_lab")


def _compare(case, got) -> str | None:
    if case["outcome"] == "accepted":
        if got["outcome"] != "accepted":
            return f"DeepSpeed accepts, gas_lab raises {got['exception']}: {got['message'][:120]}"
        if got["observed"]["counters"] != case["observed"]["counters"]:
            return f"counters {got['observed']['counters']} != {case['observed']['counters']}"
        return None
    # gas_lab raises its RejectedCombination, which is also DeepSpeed's type for the rule
    same_type = got["exception"] == "RejectedCombination" and case["exception"] in got.get(
        "is_a", []
    )
    if not same_type or got["raised_in"] != case["raised_in"]:
        return (
            f"DeepSpeed raises {case['exception']} in {case['raised_in']}, gas_lab "
            f"{got['exception']} ({', '.join(got.get('is_a', []))}) in {got['raised_in']}"
        )
    if f"raises {case['exception']} at {case['moment']}" not in got["message"]:
        return f"gas_lab's message misnames DeepSpeed's exception: {got['message'][-160:]}"
    return None


@pytest.fixture(scope="module")
def gas_lab_results(cluster):
    per_rank = cluster.run(_gas_lab, CASES, timeout=300)
    assert per_rank[0] == per_rank[1]
    return dict(zip((c["id"] for c in CASES), per_rank[0], strict=True))


@pytest.mark.ranks
def test_gas_lab_agrees_with_deepspeed_in_scope(gas_lab_results):
    checked = [c for c in CASES if in_scope(c)]
    assert len(checked) >= 30 and {c["outcome"] for c in checked} == {"accepted", "rejected"}
    # Among them: loss.backward() at stages 0 and 1, and coalescing at ZeRO-1 (once gaps).
    apis = {(c["axes"].get("api"), c["axes"].get("stage"), c["outcome"]) for c in checked}
    assert {("tensor_backward", 0, "rejected"), ("tensor_backward", 1, "accepted")} <= apis
    assert ("coalesce", 1, "accepted") in apis
    # Lesson 09: ZeRO-2, managed and unmanaged, with what DeepSpeed refuses there.
    assert {("no_sync", 2, "rejected"), ("coalesce", 2, "accepted")} <= apis
    assert {("set_boundary_true", 2, "rejected"), ("tensor_backward", 2, "accepted")} <= apis
    grid2 = {(c["axes"]["managed"], c["axes"]["overlap_comm"]) for c in checked
             if c["group"] == "grid" and c["axes"]["stage"] == 2}  # fmt: skip
    assert grid2 == {(True, False), (True, True), (False, False), (False, True)}
    assert {c["axes"].get("variant") for c in checked} >= {"small_buckets"}
    # Lesson 08: bf16 at both stages, the sum, and stage 0's refusal of an fp32 buffer.
    precisions = {(c["axes"].get("precision"), c["axes"].get("stage")) for c in checked}
    assert {("bf16", 0), ("bf16", 1)} <= precisions
    assert {c["axes"].get("op") for c in checked} >= {"sum"}
    assert any(c["exception"] == "NotImplementedError" for c in checked)
    wrong = [f"{c['id']}: {p}" for c in checked if (p := _compare(c, gas_lab_results[c["id"]]))]
    assert not wrong, f"{len(wrong)} in-scope cases disagree:\n" + "\n".join(wrong)


def _position(case, op) -> int:
    return -1 if op == "initialize" else case["ops"].index(op)


def test_gas_lab_routes_precision_to_deepspeeds_optimizer_wrapper():
    """Every accepted in-scope case: the wrapper DeepSpeed built (measured) is the one gas_lab's
    precision.route mirrors (the bare optimizer where DeepSpeed has none)."""
    from gas_lab.deepspeed_compat.config import load_config
    from gas_lab.deepspeed_compat.precision import route

    checked = [c for c in CASES if in_scope(c) and c["outcome"] == "accepted"]
    wrappers = set()
    for case in checked:
        cfg = load_config(case["config"], world_size=2)
        bare = cfg.optimizer.torch_optimizer([torch.nn.Parameter(torch.zeros(1))])
        wrapper = route(cfg).wrapper or type(bare).__name__
        measured = case["observed"]["optimizer"]
        assert wrapper == measured, f"{case['id']}: gas_lab mirrors {wrapper}, DeepSpeed {measured}"
        wrappers.add(measured)
    assert {
        "AdamW",
        "DeepSpeedZeroOptimizer",
        "FP16_UnfusedOptimizer",
        "BF16_Optimizer",
    } <= wrappers


@pytest.mark.ranks
def test_out_of_scope_points_to_deepspeed_no_later_than_it_fails(gas_lab_results):
    wrong = []
    for case in (c for c in CASES if not in_scope(c) and _parses(c)):
        got = gas_lab_results[case["id"]]
        if got["exception"] not in ("RejectedCombination", "NotImplementedInGasLab"):
            wrong.append(f"{case['id']}: gas_lab {got['outcome']} ({got['exception']})")
        elif got["exception"] == "NotImplementedInGasLab" and "deepspeed" not in got["message"]:
            wrong.append(f"{case['id']}: no pointer to DeepSpeed: {got['message']}")
        elif case["outcome"] == "rejected" and _position(case, got["raised_in"]) > _position(
            case, case["raised_in"]
        ):
            wrong.append(f"{case['id']}: gas_lab refuses later than DeepSpeed")
    assert not wrong, "\n".join(wrong)


@pytest.mark.ranks
def test_deepspeed_leniency_is_refused_by_gas_lab(gas_lab_results):
    for case in (c for c in CASES if c["axes"].get("check") in LENIENT):
        assert case["outcome"] == "accepted" and case["observed"]["managed"] is True
        got = gas_lab_results[case["id"]]
        assert (got["exception"], got["raised_in"]) == ("ConfigError", "initialize")
        assert "managed_gradient_ac" in got["message"]


# ---------------------------------------------------------------- 4. the unsafe teaching mode
def _unsafe_vs_deepspeed(config, skip, set_boundary=None):
    # Independent of unsafe.run (which lesson 06 uses): the loop written out once more.
    """On a rank: 2 unmanaged steps of 3 micro-batches on gas_lab.measure.unsafe and on DeepSpeed with
    the same check bypassed; parameters and all-reduce counts of each."""
    import contextlib
    import functools

    import torch
    import torch.distributed as dist

    from gas_lab.measure import unsafe
    from gas_lab.measure.comm import count_collectives
    from gas_lab.toys import flat_params, micro_batch, tiny_model

    out = {}
    for lib in ("gas_lab", "deepspeed"):
        model = tiny_model(0)
        if lib == "gas_lab":
            engine = unsafe.initialize(model, config, skip, quiet=True)[0]
            bypass = contextlib.nullcontext
        elif not skip:
            from gas_lab.measure.parity import deepspeed_initialize

            engine = deepspeed_initialize()(model=model, model_parameters=model.parameters(),
                                            config=config)[0]  # fmt: skip
            bypass = contextlib.nullcontext
        else:
            engine = unsafe.deepspeed_initialize(model, config)[0]
            bypass = functools.partial(unsafe.pretend_managed, engine)
        with count_collectives() as log:
            for step in range(2):
                for m in range(3):
                    if set_boundary is not None:
                        with bypass():
                            engine.set_gradient_accumulation_boundary(set_boundary)
                    x, y = micro_batch(0, step, m, dist.get_rank(), 2)
                    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
                engine.step()
        out[lib] = (flat_params(engine.module), log.count("all_reduce"), engine.global_steps)
    return out


UNSAFE_BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 3,
    "managed_gradient_accumulation": False,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "zero_allow_untested_optimizer": True,
}


def _reference(steps=2):
    from gas_lab.measure.parity import reference_params

    return reference_params(UNSAFE_BASE, steps, [3] * steps)


@pytest.mark.ranks
def test_unsafe_overlap_at_zero1_matches_deepspeed_and_is_wrong(cluster):
    """Lesson 06 (issue 20, statement 7): at ZeRO-1 with the averaging skipped the ranks end
    identical and wrong, on DeepSpeed itself: identical replicas do not prove averaging."""
    config = {**UNSAFE_BASE, "zero_optimization": {"stage": 1, "overlap_comm": True}}
    ranks = cluster.run(_unsafe_vs_deepspeed, config, ["unmanaged_overlap_comm"], timeout=120)
    ref = _reference()
    for out in ranks:
        assert torch.equal(out["gas_lab"][0], out["deepspeed"][0])  # the model is faithful
        assert (out["gas_lab"][0] - ref).abs().max() > 1e-2  # and silently wrong
    for lib in ("gas_lab", "deepspeed"):  # ranks agree on it: ZeRO-1's step() all-gathers
        assert torch.equal(ranks[0][lib][0], ranks[1][lib][0])
    # the same loop without overlap_comm, safe: the ranks agree AND are right
    safe = cluster.run(_unsafe_vs_deepspeed, {**config, "zero_optimization": {"stage": 1}}, [],
                       timeout=120)  # fmt: skip
    for out in safe:
        assert (out["deepspeed"][0] - ref).abs().max() < 1e-6


@pytest.mark.ranks
def test_unsafe_experiment_reports_what_it_ran(cluster):
    """unsafe.experiment (lesson 06's harness): its numbers are the runs' own."""
    from gas_lab.measure import unsafe

    config = {**UNSAFE_BASE, "zero_optimization": {"stage": 1, "overlap_comm": True}}
    out = unsafe.experiment(cluster, "overlap", config, ["unmanaged_overlap_comm"])
    ours, theirs = out.runs["gas_lab"], out.runs["deepspeed"]
    assert out.same_as_deepspeed and out.spread == 0.0 and out.updates == 2
    assert out.error == (ours[0].params - _reference()).abs().max().item() > 1e-2
    # no gradient all-reduce anywhere: the norm's (4 B) and the shards' all-gather remain
    grad = sum(p.numel() * 4 for p in tiny_model(0).parameters())
    assert out.collectives == {("all_reduce", 4): 2, ("all_gather", 240): 2}
    assert ("all_reduce", grad) not in theirs[1].collectives()
    assert "same as DeepSpeed: yes" in str(out)
    with pytest.raises(ValueError, match="cannot be bypassed"):
        unsafe.run("deepspeed", UNSAFE_BASE, ["step_in_no_sync"])


@pytest.mark.ranks
@pytest.mark.parametrize("flag", [False, True])
def test_unsafe_set_boundary_matches_deepspeed(cluster, flag):
    ranks = cluster.run(
        _unsafe_vs_deepspeed, UNSAFE_BASE, ["unmanaged_set_boundary"], flag, timeout=120
    )
    ref = _reference()
    for out in ranks:
        (ours, ours_reduces, ours_steps), theirs = out["gas_lab"], out["deepspeed"]
        assert torch.equal(ours, theirs[0]) and (ours_reduces, ours_steps) == theirs[1:]
        if flag:  # 3 backward() + 1 step() reductions per step, and the right result
            assert (ours_reduces, ours_steps) == (8, 2) and (ours - ref).abs().max() < 1e-6
        else:  # no reduction and no update at all
            assert (ours_reduces, ours_steps) == (0, 0)
            assert torch.equal(ours, _flat_initial())


def _flat_initial():
    from gas_lab.toys import flat_params, tiny_model

    return flat_params(tiny_model(0))


def test_unsafe_refuses_unknown_rules_and_says_so(single_process, capsys):
    from gas_lab.measure import unsafe

    with pytest.raises(ValueError, match="unknown rules"):
        unsafe.initialize(tiny_model(0), UNSAFE_BASE, ["no_such_rule"])
    engine = unsafe.initialize(tiny_model(0), UNSAFE_BASE, ["unmanaged_set_boundary"])[0]
    assert "UNSAFE" in capsys.readouterr().out
    engine.set_gradient_accumulation_boundary(False)  # skipped on this engine ...
    safe = initialize(model=tiny_model(0), config=UNSAFE_BASE)[0]
    with pytest.raises(RejectedCombination):  # ... and on no other
        safe.set_gradient_accumulation_boundary(False)


def _direct_backward_at_stage_0():
    """On a rank: managed, GAS 3, loss.backward() instead of engine.backward(loss), on
    gas_lab.measure.unsafe with the stage-0 rule skipped and on DeepSpeed with its check bypassed."""
    import torch
    import torch.distributed as dist

    from gas_lab.measure import unsafe
    from gas_lab.measure.comm import count_collectives
    from gas_lab.toys import flat_params, micro_batch, tiny_model

    config = {**UNSAFE_BASE, "managed_gradient_accumulation": True}
    out = {}
    for lib in ("gas_lab", "deepspeed"):
        if lib == "gas_lab":
            engine = unsafe.initialize(
                tiny_model(0), config, ["tensor_backward_stage0"], quiet=True
            )[0]
        else:
            engine = unsafe.allow_tensor_backward(
                unsafe.deepspeed_initialize(tiny_model(0), config)[0]
            )
        with count_collectives() as log:
            for step in range(2):
                for m in range(3):
                    x, y = micro_batch(0, step, m, dist.get_rank(), 2)
                    torch.nn.functional.mse_loss(engine(x), y).backward()
                    engine.step()
        out[lib] = (flat_params(engine.module), log.count("all_reduce"), engine.global_steps)
    return out


@pytest.mark.ranks
def test_unsafe_direct_backward_at_stage_0_matches_deepspeed_and_drifts(cluster):
    ranks = cluster.run(_direct_backward_at_stage_0, timeout=120)
    for out in ranks:
        (ours, reduces, steps), theirs = out["gas_lab"], out["deepspeed"]
        assert torch.equal(ours, theirs[0]) and (reduces, steps) == theirs[1:]
        assert (reduces, steps) == (0, 2)  # two updates, no boundary all-reduce at all
    spread = (ranks[0]["gas_lab"][0] - ranks[1]["gas_lab"][0]).abs().max().item()
    assert spread > 1e-2  # each rank stepped on its own gradient: the replicas drifted apart


def _direct_backward_unmanaged(lib, config):
    """On a rank: unmanaged, 2 steps of 3 micro-batches, each (loss / 3).backward() called on
    the tensor instead of engine.backward(loss, scale_wrt_gas=False)."""
    import torch
    import torch.distributed as dist

    from gas_lab.measure.parity import initializer
    from gas_lab.toys import flat_params, micro_batch, tiny_model

    model = tiny_model(0)
    engine = initializer(lib)(model=model, model_parameters=model.parameters(), config=config)[0]
    for step in range(2):
        for m in range(3):
            x, y = micro_batch(0, step, m, dist.get_rank(), 2)
            (torch.nn.functional.mse_loss(engine(x), y) / 3).backward()
        engine.step()
    return flat_params(engine.module), engine.global_samples


@pytest.mark.ranks
def test_trap_direct_backward_at_zero1_is_gas_times_too_small_and_uncounted(cluster):
    """The trap's text (docs/rules.md, lesson 06) says what DeepSpeed does, measured: the hook
    divides by GAS, so the update is GAS times too small, and global_samples stays 0."""
    from gas_lab.measure.parity import reference_params
    from gas_lab.rules import traps

    trap = next(t for t in traps.TRAPS if t.name == "tensor_backward_zero1")
    assert "GAS times too small" in trap.symptom and "stays 0" in trap.symptom
    gas = 4  # not the 3 micro-batches a step runs: "GAS times", not "N times"
    config = {**UNSAFE_BASE, "gradient_accumulation_steps": gas, "zero_optimization": {"stage": 1}}
    right = reference_params(config, 2, [3, 3])
    slow = {**config, "optimizer": {"type": "SGD", "params": {"lr": 0.1 / gas}}}
    too_small = reference_params(slow, 2, [3, 3])  # SGD: a gradient / GAS = the lr / GAS
    for lib in ("gas_lab", "deepspeed"):
        for params, samples in cluster.run(_direct_backward_unmanaged, lib, config, timeout=120):
            assert (params - too_small).abs().max().item() < 1e-6, lib
            assert (params - right).abs().max().item() > 1e-2, lib
            assert samples == 0, lib


@pytest.mark.parametrize("stage", [0, 1])
def test_unsafe_deepcompile_is_plain_at_stage_0_and_fails_in_step_at_zero1(stage, single_process):
    """DeepCompile, modelled from DeepSpeed's source: stage 0 falls back to torch.compile (the
    engine trains as without it); at ZeRO-1 no backward() is the boundary, so the averaged
    gradients step() reads were never set (DeepSpeed: KeyError)."""
    from gas_lab.measure import unsafe
    from gas_lab.toys import micro_batch

    config = {
        **UNSAFE_BASE,
        "compile": {"deepcompile": True},
        "zero_optimization": {"stage": stage},
    }
    engine = unsafe.initialize(tiny_model(0), config, ["unmanaged_deepcompile"], quiet=True)[0]
    for m in range(3):
        x, y = micro_batch(0, 0, m, 0, 2)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    if stage == 1:
        with pytest.raises(KeyError):
            engine.step()
        assert engine.global_steps == 0
    else:
        engine.step()
        assert engine.global_steps == 1


# ---------------------------------------------------------------- 5. the reasons are true
def test_no_sync_stage23_reason_holds():
    """The rule's text: stage 2 all-reduces each bucket by default (the flag DeepSpeed's
    ZeRO-1/2 reduction reads, on by default), not a reduce-scatter."""
    import inspect

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    reason = refusals.rule_named("no_sync_stage23").reason
    assert "stage 2 all-reduces each bucket" in reason
    assert "use_multi_rank_bucket_allreduce" in reason
    assert DeepSpeedZeroConfig().use_multi_rank_bucket_allreduce is True
    assert "use_multi_rank_bucket_allreduce" in inspect.getsource(
        DeepSpeedZeroOptimizer.average_tensor
    )


def test_max_grad_norm_reason_holds():
    """The rule's text (docs/rules.md): torch's optimizers refuse the keyword, FusedLamb uses it."""
    import inspect

    from deepspeed.ops.lamb import FusedLamb

    rule = refusals.rule_named("max_grad_norm_param")
    assert "TypeError" in rule.prevents and "FusedLamb" in rule.prevents
    params = [torch.nn.Parameter(torch.zeros(1))]
    for optimizer in (torch.optim.SGD, torch.optim.AdamW):
        with pytest.raises(TypeError, match="max_grad_norm"):
            optimizer(params, lr=0.1, max_grad_norm=1.0)
    assert "max_grad_norm" in inspect.signature(FusedLamb).parameters
    assert "group['max_grad_norm']" in inspect.getsource(FusedLamb.step)  # it clips with it


def test_tensor_backward_reason_holds_in_both_modes():
    """The rule's text (lesson 04's pitfall 3): DeepSpeed refuses loss.backward() at stage 0 in
    both modes (measured), because only a ZeRO optimizer can signal a backward pass's end (its
    source), not because of where the boundary reduces, which the mode moves."""
    import inspect
    import re

    from deepspeed.runtime.engine import DeepSpeedEngine

    rule = refusals.rule_named("tensor_backward_stage0")
    outcome = {(c["axes"]["stage"], c["axes"]["managed"]): c["outcome"]
               for c in CASES if c["axes"].get("api") == "tensor_backward"}  # fmt: skip
    assert outcome[0, True] == outcome[0, False] == "rejected"
    assert outcome[1, True] == outcome[1, False] == "accepted"
    allowed = r"isinstance\(self\.optimizer, ZeROOptimizer\)[^\n]*:\s*self\._support_torch_style_backward = True"
    assert re.search(allowed, inspect.getsource(DeepSpeedEngine.__init__))
    assert "not self._support_torch_style_backward" in inspect.getsource(
        DeepSpeedEngine._backward_prologue
    )
    assert "ZeRO optimizer" in rule.reason and "managed or not" in rule.reason
    assert "all-reduce" not in rule.reason  # the reduction's place depends on the mode


def _stage2_bf16_fp32_accumulation():
    """On a rank: DeepSpeed ZeRO-2, bf16 weights, grad_accum_dtype fp32; what it accumulates in."""
    import torch.distributed as dist

    from gas_lab.measure.parity import deepspeed_initialize
    from gas_lab.toys import micro_batch

    config = {**_base(), "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
              "zero_optimization": {"stage": 2}}  # fmt: skip
    model = tiny_model(0)
    engine = deepspeed_initialize()(
        model=model, model_parameters=model.parameters(), config=config
    )[0]
    dtypes = set()
    for m in range(2):  # one window of GAS = 2
        x, y = (t.to(torch.bfloat16) for t in micro_batch(0, 0, m, dist.get_rank(), 2))
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        dtypes |= {str(t.dtype) for group in engine.optimizer.averaged_gradients.values()
                   for t in (group if isinstance(group, list) else [group])}  # fmt: skip
        engine.step()
    opt = engine.optimizer
    return (
        type(opt).__name__,
        opt.use_separate_grad_accum,
        str(opt.gradient_accumulation_dtype),
        dtypes,
    )


@pytest.mark.ranks
def test_stage2_keeps_fp32_accumulated_gradients(cluster):
    """Issue 20, statement 3: the fp32 accumulation buffer is not a stage-1-only thing. DeepSpeed's
    ZeRO-2 with bf16 and grad_accum_dtype fp32 accumulates its gradient partitions in fp32; the
    reason of the stage-0 refusal says so."""
    for name, separate, dtype, seen in cluster.run(_stage2_bf16_fp32_accumulation, timeout=120):
        assert (name, separate, dtype) == ("DeepSpeedZeroOptimizer", True, "torch.float32")
        assert seen == {"torch.float32"}
    reason = refusals.rule_named("grad_accum_dtype_stage0").reason
    assert "stage 2" in reason and "use_separate_grad_accum" in reason
    assert "stage 1 only" not in reason


def test_the_rules_page_names_every_idle_rank_rule_it_sets_apart():
    """docs/rules.md sets the idle-rank rows apart by name (no count to go stale): the names it
    lists are the idle-rank rules, all of them."""
    import re
    from pathlib import Path

    from gas_lab.rules.idle_rank_refusals import IDLE_RANK_REFUSALS

    text = (Path(__file__).resolve().parents[1] / "docs" / "rules.md").read_text()
    paragraph = text[text.index("The idle-rank rows") :].split("\n\n")[0]
    named = set(re.findall(r"`(idle_[a-z0-9_]+)`", paragraph))
    assert named == {rule.name for rule in IDLE_RANK_REFUSALS}
