import nbformat as nbf

cells = []


def md(s):
    cells.append(nbf.v4.new_markdown_cell(s.strip("\n")))


def code(s):
    cells.append(nbf.v4.new_code_cell(s.strip("\n")))


md(r"""
# 09 · Beyond ZeRO-1: where communication moves into every backward

**Objectives** (≈ 25 minutes). After this lesson you can

- say what ZeRO-2 and ZeRO-3 partition beyond ZeRO-1, and why that moves the gradient
  reduction into *every* `backward()`, managed or unmanaged;
- build ZeRO-2 on the ranks in a few lines, read gas_lab's version, and check it against
  DeepSpeed stage 2 bit for bit, call by call;
- measure the bytes of one optimizer step against the number of micro-batches $N$ at stages 0
  to 3, and say where unmanaged accumulation is free and where it costs $N\times$;
- measure memory per rank at each stage, on the tiny model and on an MLP of about a million
  weights, and project it to 1B and 7B weights on many ranks;
- say what optimizer offload changes in `step()`, and check that it trains the same;
- keep a trainer whose ranks have different $N$ (an idle rank included) alive at stage 2/3, and
  derive which stage an RL trainer with variable $N$ should use.

Every claim below is an `assert`, most of them against DeepSpeed 0.19.8 itself.
""")

md(r"""
## 1. The idea

ZeRO-1 (lesson 05) shards Adam's state; each rank still holds its **whole gradient** until the
boundary. That is why unmanaged accumulation is free there: `backward()` stays local and
`step()` reduces once, whatever $N$ is. The next stages shard more:

| stage | a rank keeps only its shard of | the gradient is reduced | the weights are gathered |
|---|---|---|---|
| 0 | nothing | at the boundary | never |
| 1 | the optimizer state | at the boundary | after the update |
| 2 | + the gradients | in **every** `backward()` | after the update |
| 3 | + the weights | in **every** `backward()` | when a layer needs them, and after the update |

At stage 2 a rank keeps only the gradient of its own shard: that is the memory it saves. The
gradient a `backward()` produces for *another* rank's shard cannot wait on this rank until
`step()`, so it is sent to its owner right away and dropped. Unmanaged mode moves the
**update** into `step()`; it cannot move the **reduction**. So $N$ micro-batches cost $N$
reductions per optimizer step at stages 2 and 3, and every rank must call `backward()` the same
number of times: the $k$-th reduction of one rank pairs with the $k$-th of the others.
""")

md("## 2. Set up\n\nThe ranks start once for the whole notebook.")

code(r"""
%matplotlib inline
%config InlineBackend.figure_formats = ["svg"]  # sharp on a projector; text stays text
import inspect
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import matplotlib.pyplot as plt
import torch

import gas_lab
from gas_lab.lessons import loops
from gas_lab.lessons.tables import html_table
from gas_lab.lessons.toys import tiny_model, wide_mlp
from gas_lab.measure import stages
from gas_lab.measure.memory import CATEGORIES, project_census
from gas_lab.zero2 import PartitionedGradientUpdate

notebook_t0 = time.perf_counter()
torch.set_num_threads(1)
cluster = gas_lab.start_cluster(device="cpu")  # 2 CPU ranks, gloo
W = cluster.world_size
assert W == 2, "this lesson compares with DeepSpeed on 2 CPU ranks"
STAGES = (0, 1, 2, 3)
GAS = 4  # managed runs: micro-batches per optimizer step
NS = [1, 2, 3, 4]  # unmanaged runs: one optimizer step with each N
TOL = 1e-6
print(cluster)
""")

md(r"""
## 3. Build it inline

On the ranks, with nothing but `torch.distributed`. The layout is ZeRO-1's (lesson 05): one
flat vector, padded to a multiple of $2W$, cut into $W$ shards; the model's weights become views
of it, so the all-gather after the update writes straight into the model. New: `acc`, the only
gradient a rank keeps between `backward()` and `step()`, is one shard long.
""")

code(r"""
%%ranks
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gas_lab.lessons.toys import micro_batch, tiny_model

rank, world = dist.get_rank(), dist.get_world_size()
model = tiny_model(0)
params = list(model.parameters())
numel = sum(p.numel() for p in params)
shard = -(-numel // (2 * world)) * 2  # pad to a multiple of 2W, then cut W ways
start, end = rank * shard, (rank + 1) * shard
flat = torch.zeros(shard * world)
flat[:numel] = torch.cat([p.detach().flatten() for p in params])
for p, piece in zip(params, flat[:numel].split([p.numel() for p in params])):
    p.data = piece.view_as(p)  # the weights live in flat from now on
master = flat[start:end].clone()  # my shard, the only thing my optimizer steps
opt = torch.optim.AdamW([master], lr=1e-2)
acc = torch.zeros(shard)  # my shard of the accumulated gradient: all I keep
""")

md(r"""
`backward()` reduces **every time** and keeps the rank's shard; `step()` is ZeRO-1's boundary
without the reduction: the global norm from the shards (squares add up over ranks), clipping,
the update of the shard, the all-gather.
""")

code(r"""
%%ranks
def zero2_backward(loss):
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in params]) / world  # divide first, as DeepSpeed
    dist.all_reduce(grad)  # every backward: the average over ranks ...
    grad = F.pad(grad, (0, shard * world - numel))
    acc.add_(grad[start:end])  # ... of which I keep my shard, added up in fp32
    for p in params:
        p.grad = None  # the whole gradient is gone until the next backward


def zero2_step(max_norm=1.0):
    global acc
    squares = acc.double().pow(2).sum().float()
    dist.all_reduce(squares)  # the norm of the whole gradient, from the shards
    acc.mul_(1.0 / torch.clamp((squares.sqrt() + 1e-6) / max_norm, min=1.0))
    master.grad = acc
    opt.step()
    dist.all_gather_into_tensor(flat, master.detach())  # everyone gets every shard
    acc = torch.zeros(shard)
""")

md(r"""
Three unmanaged optimizer steps with 1, 3 and 2 micro-batches (each loss divided by its step's
$N$), then the same loop on DeepSpeed stage 2.
""")

code(r"""
%%ranks
from gas_lab.measure.parity import deepspeed_initialize, train

N_PER_STEP = [1, 3, 2]
for step, n in enumerate(N_PER_STEP):
    for micro in range(n):
        x, y = micro_batch(0, step, micro, rank, 2)
        zero2_backward(F.mse_loss(model(x), y) / n)
    zero2_step()

config = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "managed_gradient_accumulation": False,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
}
engine = train(deepspeed_initialize(), config, 3, N_PER_STEP, scale_wrt_gas=False,
               loss_divisor=lambda n: n)[0]  # fmt: skip
ds_params = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
diff = (flat[:numel] - ds_params).abs().max().item()
assert diff <= 1e-6
print(f"rank {rank}: max |inline ZeRO-2 - DeepSpeed stage 2| = {diff:.1e}")
""")

md(r"""
Equal to float32 rounding (DeepSpeed adds up the squared norm piece by piece, one piece per
tensor; the inline version in one go). Two weights, one update, nothing the ranks disagree on.

## 4. The library version

`gas_lab.zero2.PartitionedGradientUpdate` is the same, as the engine's update strategy
(lesson 05's `strategy_for(2)`), with three things the inline version skipped:

- **buckets**. A hook fires as autograd finishes each parameter's gradient and puts it in a
  bucket; a full bucket (`reduce_bucket_size` elements) is reduced *while the rest of
  `backward()` runs* (on a GPU, that overlaps communication with computation). The engine calls
  the strategy's `after_backward()` when `backward()` ends: the last bucket goes then.
- **DeepSpeed's rounding**: the norm per piece of tensor in float64, clipping as
  `1 / clamp((norm + 1e-6) / max_norm, min=1)`. That makes it bit for bit, below.
- parameters without a gradient are left out of the bucket, and `coalesce_grad_reduction()`
  holds the gradients until the block ends, as in DeepSpeed.
""")

code(r"""
print(inspect.getsource(PartitionedGradientUpdate.add_to_bucket))
print(inspect.getsource(PartitionedGradientUpdate.after_backward))
print(inspect.getsource(PartitionedGradientUpdate.reduce_bucket))
""")

md("The boundary has nothing left to reduce; the update is ZeRO-1's, with the float64 norm:")

code(r"""
print(inspect.getsource(PartitionedGradientUpdate.update))
print(inspect.getsource(PartitionedGradientUpdate.global_norm))
""")

md(r"""
## 5. Check it against DeepSpeed stage 2, call by call

`gas_lab.measure.parity.train(..., phases=...)` records the collectives of every call: the
initialization, each forward, each backward, each `step()`. The same loop runs on gas_lab and on
DeepSpeed; parameters, the counters after every `step()`, and the list of calls with their
collectives (kind, bytes, order) are compared.
""")

code(r"""
ADAM = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}}
SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}


def case(optimizer, managed, **extra):
    return stages.config(2, managed, gas=3, optimizer=optimizer,
                         zero_allow_untested_optimizer=True, **extra)  # fmt: skip


def call_by_call(config, micro_batches):
    from gas_lab.lessons.toys import flat_params
    from gas_lab.measure.parity import initializer, train

    out = {}
    for lib in ("gas_lab", "deepspeed"):
        phases = []
        engine, counters, _, _ = train(initializer(lib), config, 3, micro_batches, phases=phases)
        calls = [(p.what, p.step, p.micro, p.signature()) for p in phases]
        out[lib] = (flat_params(engine.module), counters, calls)
    (ours, c0, calls0), (theirs, c1, calls1) = out.values()
    return (ours - theirs).abs().max().item(), c0 == c1, calls0 == calls1, len(calls0)


CASES = {
    "managed, Adam, GAS 3": (case(ADAM, True), None),
    "managed, SGD, no clipping": (case(SGD, True, gradient_clipping=0.0), None),
    "unmanaged, AdamW, N = 1, 4, 2": (case(ADAMW, False), [1, 4, 2]),
    "unmanaged, SGD, clip 0.05, N = 3, 1, 2": (case(SGD, False, gradient_clipping=0.05), [3, 1, 2]),
    "unmanaged, Adam, buckets of 20": (
        case(ADAM, False, zero_optimization={"reduce_bucket_size": 20}),
        [2, 1, 3],
    ),
}
print(f"{'case':40s} rank  max |diff|  counters  calls equal")
for name, (config, ns) in CASES.items():
    for rank, (diff, counters, calls, n_calls) in enumerate(cluster.run(call_by_call, config, ns)):
        print(f"{name:40s} {rank:4d}  {diff:10.1e}  {counters!s:8s}  {calls} ({n_calls} calls)")
        assert diff == 0.0 and counters and calls
""")

md(r"""
Every case, on both ranks: the same parameters bit for bit, the same counters, and the same
collectives in the same order in every call (initialize's broadcasts, each backward's
all-reduce, each boundary's norm and all-gather). With buckets of 20 elements a backward needs
several all-reduces, and the weight that straddles the two shards is still cut where DeepSpeed
cuts it. `tests/test_zero2.py` runs more cases (overlap_comm, the sum reduction, a frozen
layer, a weight larger than a bucket, a direct `loss.backward()`, `coalesce_grad_reduction()`,
a checkpoint).
""")

md(r"""
## 6. Bytes per optimizer step against N, stages 0 to 3

`gas_lab.measure.stages.traffic` trains a few warm-up steps (ZeRO-3 checks its schedule of
parameter fetches on the first two), then one optimizer step per $N$ in `NS` unmanaged, or with
`GAS` micro-batches managed, and returns the bytes of each counted step (the full buffer of each
collective, as `count_collectives` counts it). DeepSpeed at every stage; gas_lab at 0, 1, 2.
""")

code(r"""
def traffic(lib, stage, managed):
    out = stages.traffic(lib, stages.config(stage, managed, gas=GAS), None if managed else NS)
    return out["per_step"], out["ring"]


runs = {}
for lib, lib_stages in (("deepspeed", STAGES), ("gas_lab", STAGES[:3])):
    for stage in lib_stages:
        for managed in (True, False):
            per_rank = cluster.run(traffic, lib, stage, managed)
            assert per_rank[0] == per_rank[1]  # both ranks send the same
            runs[lib, stage, managed] = per_rank[0]
for stage in STAGES[:3]:
    for managed in (True, False):
        assert runs["gas_lab", stage, managed] == runs["deepspeed", stage, managed]

fit = {}  # stage -> (fixed bytes, bytes per backward)
print("DeepSpeed (= gas_lab at stages 0-2), bytes per optimizer step:")
for stage in STAGES:
    unmanaged = runs["deepspeed", stage, False][0]
    per_backward = unmanaged[1] - unmanaged[0]
    fixed = unmanaged[0] - per_backward
    assert unmanaged == [fixed + n * per_backward for n in NS]  # a straight line in N
    assert runs["deepspeed", stage, True][0] == [fixed + GAS * per_backward]  # managed: N = GAS
    fit[stage] = fixed, per_backward
    print(f"  stage {stage}: {fixed:4d} + N x {per_backward:3d}   "
          f"unmanaged N = {NS}: {unmanaged}   managed GAS {GAS}: {fixed + GAS * per_backward}")  # fmt: skip
assert fit[0][1] == fit[1][1] == 0 and fit[2][1] > 0 and fit[3][1] > 0
""")

code(r"""
fig, ax = plt.subplots(figsize=(8, 3.8))
colours = {0: "tab:grey", 1: "tab:blue", 2: "tab:orange", 3: "tab:red"}
for stage in STAGES:
    ax.plot(NS, runs["deepspeed", stage, False][0], "o-", color=colours[stage],
            label=f"stage {stage}, unmanaged")  # fmt: skip
    ax.plot([GAS], runs["deepspeed", stage, True][0], "s", ms=11, mfc="none",
            color=colours[stage])  # fmt: skip
ax.plot([], [], "s", ms=11, mfc="none", color="black", label=f"managed, GAS {GAS}")
ax.set(xlabel="N: micro-batches in the optimizer step", xticks=NS,
       ylabel="bytes per optimizer step", ylim=(0, None),
       title="Tiny model, 2 ranks: free at stages 0/1, N x the gradient at stages 2/3")  # fmt: skip
ax.legend(fontsize="small", ncol=2)
fig.tight_layout()
""")

code(r"""
grad_bytes = sum(p.numel() for p in tiny_model(0).parameters()) * 4
assert fit[2][1] == fit[3][1] == grad_bytes
ratio = {s: runs["deepspeed", s, False][0][-1] / runs["deepspeed", s, False][0][0] for s in STAGES}
assert ratio[0] == ratio[1] == 1 and ratio[2] > 2 and ratio[3] > 2
print(f"each backward at stages 2 and 3 sends the whole gradient once ({grad_bytes} bytes); "
      f"from N = {NS[0]} to N = {NS[-1]} a step costs x{ratio[2]:.2f} (stage 2) and "
      f"x{ratio[3]:.2f} (stage 3), x{ratio[0]:g} at stages 0 and 1")  # fmt: skip
""")

md(r"""
Managed (squares) sends exactly what unmanaged sends with $N$ = `GAS`: unmanaged mode changes
*where* stages 0/1 reduce (in `step()` instead of the last `backward()`), and nothing at
stages 2/3. The fixed part is the norm's all-reduce plus the all-gather of the weights
(stages 1, 2), or of the small weights ZeRO-3 keeps whole (below). On a ring, an all-reduce
sends twice what a reduce-scatter or an all-gather sends (lesson 05); `traffic` also returns
that model (`"ring"`), and the straight lines stay straight.

### ZeRO-3, observed on DeepSpeed

ZeRO-3 also partitions the weights, and gathers a layer's weights when the forward (and the
backward) needs them. DeepSpeed keeps parameters smaller than
`stage3_param_persistence_threshold` elements whole on every rank, and that is every tensor of
the tiny model; with the threshold at 0, the gathers show:
""")

code(r"""
def zero3_calls(threshold):
    zero = {} if threshold is None else {"stage3_param_persistence_threshold": threshold}
    out = stages.traffic("deepspeed", stages.config(3, False, zero_optimization=zero), [2])
    return [(p.what, p.micro, p.signature()) for p in out["phases"] if p.step == stages.WARMUP]


for threshold in (None, 0):
    calls = cluster.run(zero3_calls, threshold)[0]
    print("default threshold:" if threshold is None else "threshold 0:")
    for what, micro, signature in calls:
        said = " + ".join(f"{kind} {nbytes} B" for kind, nbytes in signature) or "-"
        print(f"  {what:8s} {'' if micro is None else micro!s:2s} {said}")
    kinds = {what: {k for k, _ in signature} for what, _, signature in calls if signature}
    assert kinds["backward"] == {"reduce_scatter"}  # every backward, whatever the threshold
    if threshold == 0:
        assert kinds["forward"] == {"all_gather"} and kinds["step"] == {"all_reduce"}
""")

md(r"""
Every ZeRO-3 `backward()` reduce-scatters the gradient (each rank receives only its shard of
the sum: half the bytes of an all-reduce on a ring); with the threshold at 0 every forward
first all-gathers the weights, and the step only all-reduces the norm (in float64, 8 bytes,
where stages 1/2 send a float32). With the default threshold the step all-gathers the small
weights ZeRO-3 keeps whole, one call per tensor.

## 7. Memory per rank, measured and projected

`stages.held_memory` runs one optimizer step, then one more micro-batch, and takes a census of
the rank in the middle of the accumulation window, when a gradient is held:
`gas_lab.measure.memory.census` counts every storage once (the weights are views of the flat
buffer at stages 1-2), by what it is for: weights, the fp32 master copy the optimizer steps, the
held gradient, the optimizer state, and DeepSpeed's reduction bucket.
""")

code(r"""
def held(lib, stage, wide):
    config = stages.config(stage, gas=2)
    return stages.held_memory(lib, config, model_fn=wide_mlp if wide else tiny_model)


MODELS = {"tiny": tiny_model(0), "wide": wide_mlp(0)}
mem = {}
for name in MODELS:
    for lib, lib_stages in (("gas_lab", STAGES[:3]), ("deepspeed", STAGES)):
        for stage in lib_stages:
            mem[name, lib, stage] = cluster.run(held, lib, stage, name == "wide")[0]  # rank 0
rows = []
for name, model in MODELS.items():
    for stage in STAGES:
        for lib in ("gas_lab", "deepspeed"):
            if (name, lib, stage) in mem:
                m = mem[name, lib, stage]
                rows.append({"model": f"{name} ({sum(p.numel() for p in model.parameters()):,})",
                             "stage": stage, "library": lib,
                             **{k: f"{m[k]:,}" for k in CATEGORIES if k != "other"}})  # fmt: skip
html_table(rows)
""")

code(r"""
for name, model in MODELS.items():
    numel, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    for stage in STAGES[:3]:
        ours, theirs = mem[name, "gas_lab", stage], mem[name, "deepspeed", stage]
        projected = project_census(numel, W, stage, tensors if stage == 0 else 1)
        assert {k: ours[k] for k in projected} == projected  # the projection reproduces it
        for k in ("weights", "master", "optimizer state"):
            assert ours[k] == theirs[k]
    assert mem[name, "gas_lab", 2]["gradients"] < mem[name, "deepspeed", 2]["gradients"]
wide = {s: mem["wide", "deepspeed", s] for s in STAGES}
extra = wide[2]["gradients"] / mem["wide", "gas_lab", 2]["gradients"]
assert wide[3]["weights"] < wide[2]["weights"] and 1 < extra <= W
bucket = mem["tiny", "deepspeed", 1]["bucket"]
assert bucket == mem["tiny", "deepspeed", 3]["bucket"] == 4 * 500_000_000
print(f"the projection reproduces gas_lab's census exactly, both models, stages 0-2; at stage 2 "
      f"DeepSpeed holds x{extra:.2f} gas_lab's gradient bytes for the wide model; its "
      f"reduction bucket takes {bucket:,} bytes at stages 1 and 3")  # fmt: skip
""")

md(r"""
Read the table by column. **Weights** stay whole up to stage 2 (padded at 1-2) and become a shard
at stage 3 (for the wide model; the tiny model's tensors are all under ZeRO-3's persistence
threshold, kept whole *and* partitioned). The **master** copy and the **optimizer state** are a
shard from stage 1. The held **gradient** is whole at stages 0 and 1, a shard at stage 2 in
gas_lab, and more in DeepSpeed: DeepSpeed 0.19.8 keeps the *whole* gradient of every tensor
that overlaps the rank's shard, and the wide model's big weight overlaps both shards. Same
numbers, different memory. The **bucket** is `reduce_bucket_size` elements DeepSpeed allocates
(while accumulating at stage 1, always at stage 3, per backward at stage 2); on a CPU, pages
never written cost no RAM, on a GPU they do. It does not grow with the model, so the projection
leaves it out.

The projection (`project_census`, fp32 Adam: 4 bytes of weight, 4 of master, 4 of gradient,
8 of state per weight, each a shard from the stage that partitions it) reproduced every
measured gas_lab row above. Scaled up, and labelled for what it is:
""")

code(r"""
SIZES = {"1B": 10**9, "7B": 7 * 10**9}
RANKS = (8, 64)
rows = []
for label, numel in SIZES.items():
    for stage in STAGES:
        row = {"model (projection)": label, "stage": stage}
        for world in RANKS:
            total = sum(project_census(numel, world, stage).values())
            row[f"GB per rank, W = {world}"] = f"{total / 1e9:.1f}"
        rows.append(row)
gb = {(r["model (projection)"], r["stage"]): float(r["GB per rank, W = 64"]) for r in rows}
assert gb["7B", 0] == 4 * gb["7B", 1] - 3 * 7 * 4 * (1 + 1 / 64) * 0 or gb["7B", 0] > gb["7B", 1]
assert gb["7B", 0] > gb["7B", 1] > gb["7B", 2] > gb["7B", 3]
html_table(rows)
""")

md(r"""
Stage 0 holds 16 bytes per weight on every rank whatever $W$ is; stage 1 drops the optimizer
state to a shard, stage 2 the gradient too, stage 3 everything. Activations, the bucket and
framework overheads come on top of these numbers.

## 8. Optimizer offload, observed on DeepSpeed

`"offload_optimizer": {"device": "cpu"}` keeps the master copy and the optimizer state in CPU
memory and runs the update there. It is accepted unmanaged at stages 1 and 2 (and 3). With
`"torch_adam": true` the optimizer is torch's AdamW running on the CPU shard; without it
DeepSpeed builds its own `DeepSpeedCPUAdam` (a C++ op compiled on first use, minutes on a
laptop, which is why this lesson does not). On this machine "offloading to the CPU" moves
nothing, so what shows is what changes in the code path: unmanaged, over the window `step()`
closes.
""")

code(r"""
def offload_run(stage, offload):
    from gas_lab.lessons.toys import flat_params
    from gas_lab.measure.parity import initializer, train

    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    config = stages.config(stage, False, zero_optimization=zero)
    phases = []
    engine = train(initializer("deepspeed"), config, 4, [1, 4, 2, 3], phases=phases)[0]
    calls = [(p.what, p.step, p.micro, p.signature()) for p in phases]
    kind = type(engine.optimizer.optimizer).__name__
    return flat_params(engine.module), calls, kind, stages.held_memory("deepspeed", config)


for stage in (1, 2):
    plain = cluster.run(offload_run, stage, False)
    off = cluster.run(offload_run, stage, True)
    for rank, ((p0, calls0, kind0, m0), (p1, calls1, kind1, m1)) in enumerate(zip(plain, off)):
        diff = (p0 - p1).abs().max().item()
        assert diff <= TOL and calls0 == calls1 and kind0 == kind1 == "AdamW"
        assert m1["gradients"] > m0["gradients"] and m1["optimizer state"] == m0["optimizer state"]
        if rank == 0:
            print(f"stage {stage}: offload vs none: max |diff| {diff:.1e}, the same collectives "
                  f"in every call; gradient bytes held {m0['gradients']} -> {m1['gradients']}, "
                  f"weights {m0['weights']} -> {m1['weights']}")  # fmt: skip
""")

code(r"""
from deepspeed.ops.adam import DeepSpeedCPUAdam  # importing builds nothing; constructing would

cpu_adam = inspect.signature(DeepSpeedCPUAdam.__init__).parameters["weight_decay"].default
torch_adamw = inspect.signature(torch.optim.AdamW.__init__).parameters["weight_decay"].default
assert cpu_adam != torch_adamw
print(f"default weight_decay: DeepSpeedCPUAdam {cpu_adam}, torch.optim.AdamW {torch_adamw}")
""")

md(r"""
Offload trains the same parameters (to float32 rounding: offload computes the norm from
per-tensor norms kept as it goes) and sends the same collectives in every call. What changes is
inside `step()` and around it: each in-shard gradient is also added into a per-tensor fp32
accumulator as `backward()` produces it; unmanaged, `step()` first finalizes the window (copies
the accumulated shard into a persistent fp32 gradient buffer of the master, on the CPU), then
clips and steps there, then copies the new weights back before the same all-gather. That is the
extra gradient and weight memory in the census. If you switch to `DeepSpeedCPUAdam` (no
`torch_adam`), set `weight_decay` explicitly: the two defaults above differ.

## 9. Different N per rank, and the idle rank, at stage 2/3

At stages 0/1 unmanaged, ranks may run different numbers of micro-batches (lesson 05 did, on
gas_lab and DeepSpeed). At stage 2 the $k$-th all-reduce of one rank pairs with the $k$-th of
the other: give rank 0 one micro-batch and rank 1 three, and rank 0's norm all-reduce (4 bytes)
meets rank 1's second gradient all-reduce. On gas_lab's own ZeRO-2 this time, with a timeout so
the notebook cannot hang:
""")

code(r"""
def uneven(stage):
    from gas_lab.measure.parity import train

    config = stages.config(stage, managed=False)
    train(gas_lab.initialize, config, 2, lambda step, rank: 1 + 2 * rank)
    return "finished"


assert cluster.run(uneven, 1) == ["finished", "finished"]
print("stage 1: finished on both ranks")
try:
    outcome = cluster.run(uneven, 2, timeout=30)
except (gas_lab.RankError, gas_lab.RankStallError) as err:
    outcome = err
    print(f"stage 2: {type(err).__name__}:", str(err).splitlines()[0])
assert isinstance(outcome, gas_lab.RankError) and outcome.died
""")

md(r"""
A rank died: gloo checks the size of every message and aborts the process on a mismatch
(*"Received data size doesn't match expected size"* under `torchrun`); the runtime caught it
and restarted the ranks. DeepSpeed stage 2 dies the same way (lesson 05), and so does stage 3,
whose every `backward()` reduce-scatters (`tests/test_stages.py` runs both). A backend that
does not check sizes would pair the wrong collectives silently, or hang.

**The fix**: every rank calls `backward()` as often as the busiest rank. The ranks share their
counts first (one all-gather of one number each), a rank with fewer micro-batches pads with
micro-batches of weight 0, and each real micro-batch weighs $W / N_{total}$, so the ranks'
average is the mean over every real micro-batch of the step. An idle rank (no data this step)
runs only padding.
""")

code(r"""
print(inspect.getsource(loops.mean_weight))
print(inspect.getsource(loops.equal_n_train))
""")

code(r"""
def n_per_rank(step, rank):
    return [(2, 0), (1, 3), (3, 3)][step][rank]  # rank 1 is idle in the first step


def padded(lib, stage):
    from gas_lab.lessons.toys import flat_params
    from gas_lab.measure.parity import initializer

    config = stages.config(stage, managed=False)
    engine, log = loops.equal_n_train(initializer(lib), config, 3, n_per_rank)
    return flat_params(engine.module), log.by_kind()


from gas_lab.measure.parity import reference_params

reference = reference_params(stages.config(0, managed=False), 3, n_per_rank, clip=1.0)
longest = sum(max(n_per_rank(s, r) for r in range(W)) for s in range(3))
for lib, stage in (("gas_lab", 2), ("deepspeed", 2), ("deepspeed", 3)):
    per_rank = cluster.run(padded, lib, stage)
    for params, kinds in per_rank:
        diff = (params - reference).abs().max().item()
        assert diff <= TOL
        reductions = kinds["all_reduce" if stage == 2 else "reduce_scatter"]["calls"]
        assert reductions == longest + (3 if stage == 2 else 0)  # + the norm of each step
    assert torch.equal(per_rank[0][0], per_rank[1][0])
    print(f"{lib} stage {stage}: max |diff| to the reference {diff:.1e}; "
          f"{longest} gradient reductions in 3 steps on every rank")  # fmt: skip
""")

md(r"""
Right parameters, at a price: every rank pays the busiest rank's $N$ in reductions (and in
forward/backward compute for the padding), and `global_samples` counts the padding too.

## 10. Which stage for an RL trainer with variable N?

Everything needed is measured above; the table assembles it.
""")

code(r"""
def decision_rows(numel=SIZES["7B"], world=RANKS[-1]):
    rows = []
    for stage in STAGES:
        fixed, per_backward = fit[stage]
        partitioned_grad = per_backward > 0  # measured in section 6
        gb = sum(project_census(numel, world, stage).values()) / 1e9
        rows.append({
            "stage": stage,
            "bytes per step, tiny model (measured)": f"{fixed} + N x {per_backward}",
            "unmanaged accumulation costs": "N x the gradient" if partitioned_grad else "nothing",
            "ranks with different N": "every rank pads to the longest N" if partitioned_grad
            else "fine: nothing moves before step()",
            "an idle rank": "runs N_max padding backward() calls" if partitioned_grad
            else "runs none",
            f"GB per rank, 7B on {world} ranks (projection)": f"{gb:.1f}",
        })  # fmt: skip
    return rows


decision = decision_rows()
assert [r["unmanaged accumulation costs"] for r in decision] == ["nothing"] * 2 + ["N x the gradient"] * 2
html_table(decision)
""")

md(r"""
Read it from the top: take the **lowest stage whose memory fits**. Stages 0 and 1 keep
unmanaged accumulation free and let every rank run its own $N$; an RL trainer whose rollouts
give ranks different numbers of micro-batches wants stage 1 as long as the weights and one
whole gradient fit. Stage 2 saves the gradient's memory and pays for it in every `backward()`:
$N$ reductions per step instead of one, and the padding loop when ranks differ. Stage 3 also
saves the weights and pays gathers on top. If you must go to stage 2/3, fewer and larger
micro-batches cost less traffic, and the busiest rank sets everyone's $N$.

## Exercises

Each exercise is a function to fill in; the cell after it checks it and shows a verdict: TODO,
NOT YET (the failing case and a hint) or PASS. Solutions: `solutions/lesson09.py`.

**Exercise 1: predict the traffic.** For each run below, predict the collectives **one
optimizer step** issues on one rank, after the warm-up (as in section 6): for each kind, the
number of calls and their bytes (the full buffer of each call), summed over the step. Some runs
differ from what the lesson showed: a bucket smaller than the gradient, ZeRO-3 with every
weight partitioned and managed accumulation, no clipping at stage 2, a model whose size needs
padding.
""")

code(r"""
from gas_lab.lessons.exercises import lesson09

for letter, run in lesson09.TRAFFIC.items():
    print(f"{letter}. {run.show()}")
""")

code(r"""
def traffic_predictions():
    # TODO: {"A": {"all_reduce": (calls, bytes), ...}, "B": {...}, "C": {...}, "D": {...}}
    raise NotImplementedError
""")

code("lesson09.check_traffic_predictions(traffic_predictions, cluster)")

md(r"""
**Exercise 2: the padding loop with a sum.** With `"gradient_allreduce_op": "sum"` (lesson 08)
the ranks' gradients are added, not averaged. Write the weight of a micro-batch's loss for
`loops.equal_n_train(..., weight=...)` so that the step's update is still the mean over every
real micro-batch: `real` says whether the micro-batch is real or padding, `n` is this rank's
number of real micro-batches, `total` the step's over all ranks, `world` the number of ranks.
The checker trains gas_lab's ZeRO-2 with your weight on the ranks, an idle rank included.
""")

code(r"""
def sum_weight(real, n, total, world):
    raise NotImplementedError  # TODO: return a float
""")

code("lesson09.check_sum_weight(sum_weight, cluster)")

md(r"""
**Exercise 3: the lowest stage that fits.** Return the lowest ZeRO stage (0-3) whose memory per
rank, as `project_census` projects it for fp32 Adam, fits in `budget` bytes, for `numel` weights
on `world` ranks; None if even stage 3 does not fit. (Section 10 says why the lowest: less
traffic and free unmanaged accumulation.)
""")

code(r"""
def lowest_stage_that_fits(numel, world, budget):
    raise NotImplementedError  # TODO: return 0, 1, 2, 3 or None
""")

code("lesson09.check_lowest_stage(lowest_stage_that_fits)")

md("## Shut down")

code(r"""
cluster.stop()
print(f"{time.perf_counter() - notebook_t0:.0f} s from starting the ranks to stopping them")
""")

md(r"""
## Summary

- ZeRO-2 partitions the gradients: a rank keeps only its shard's, so each `backward()` reduces
  right away, managed *and* unmanaged; the boundary (the `GAS`-th backward, or `step()`) only
  updates. ZeRO-3 partitions the weights too: it gathers them where they are used and
  reduce-scatters in every backward. gas_lab's ZeRO-2 matches DeepSpeed stage 2 bit for bit,
  with the same collectives in every call.
- Bytes per optimizer step are a straight line in $N$: flat at stages 0/1 (unmanaged
  accumulation is free), one gradient per micro-batch at stages 2/3 ($N\times$). Managed
  accumulation sends exactly what unmanaged sends with $N$ = `GAS`.
- Memory per rank: stage 1 shards the optimizer state and master copy, stage 2 the gradient
  (DeepSpeed keeps whole gradients of the tensors that overlap a shard), stage 3 the weights;
  the projection reproduces gas_lab's census exactly and scales it to 1B/7B weights.
- Optimizer offload trains the same and sends the same; it moves the master copy, the optimizer
  state and the update to the CPU and adds gradient buffers there. `DeepSpeedCPUAdam` and
  torch's AdamW default `weight_decay` differently.
- At stages 2/3, different $N$ per rank kills a rank (a collective mismatch). Pad every rank to
  the busiest rank's $N$ with zero-weight micro-batches; an idle rank pays the whole $N$.
- For an RL trainer with variable $N$: the lowest stage whose memory fits, usually stage 1.
""")

nb = nbf.v4.new_notebook()
nb["cells"] = cells
nb["metadata"] = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}
nbf.write(nb, "tutorials/09_beyond_zero1.ipynb")
