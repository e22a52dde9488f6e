"""Record a timeline of every rank's engine calls and collectives, as one Chrome trace.

    python -m torch.distributed.run --nproc_per_node 2 -m gas_lab.timeline \\
        --library deepspeed --stage 0 --mode unmanaged --micro-batches 3,1 --steps 2 --out trace.json

Rank r runs the count at position r of ``--micro-batches`` per optimizer step (one count: every
rank). Managed mode needs equal counts (``gradient_accumulation_steps``); stage 2 too, since
every backward() reduces there (different counts are refused, not run into a hang). Open the
file at https://ui.perfetto.dev (Open trace file) or in chrome://tracing: one process per
rank, each collective nested under the engine call that issued it. The recording and the
format: :mod:`gas_lab.measure.recording`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gas_lab.measure import chrome_trace as ct
from gas_lab.measure import recording as tl


class _Parser(argparse.ArgumentParser):
    """argparse, with an error in one line (no usage block), printed by rank 0 only."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") == "0":
            print(f"gas_lab.timeline: error: {message}", file=sys.stderr)
        sys.exit(2)


def _count_list(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: whole numbers separated by commas, one per rank (e.g. 3,1)"
        ) from None


def _stage(text: str) -> int:
    try:
        stage = int(text)
    except ValueError:
        stage = None
    if stage not in tl.STAGES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose 0, 1 or 2 (gas_lab builds ZeRO stages 0-2, so both libraries "
            "compare there)"
        )
    return stage


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number >= 1")
    return value


def parse(argv: list[str] | None = None, world: int | None = None) -> argparse.Namespace:
    """The command's arguments, checked against ``world`` ranks (``WORLD_SIZE``, else 1)."""
    parser = _Parser(
        prog="gas_lab.timeline", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument("--library", choices=tl.LIBRARIES, default="gas_lab")
    parser.add_argument("--stage", type=_stage, default=0, help="ZeRO stage: 0, 1 or 2")
    parser.add_argument("--mode", choices=tl.MODES, default="managed")
    parser.add_argument(
        "--micro-batches",
        type=_count_list,
        default=[2],
        help="micro-batches per optimizer step on each rank, e.g. 3,1 (default 2 on every rank)",
    )
    parser.add_argument("--steps", type=_positive, default=1, help="optimizer steps (default 1)")
    parser.add_argument(
        "--gradient-clipping",
        type=float,
        default=1.0,
        help="DeepSpeed's default 1.0 adds a 4-byte norm all_reduce to step(); 0 turns it off",
    )
    parser.add_argument("--out", type=Path, default=Path("trace.json"), help="the trace file")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    try:
        args.micro_batches = tl.check_plan(
            args.library, args.stage, args.mode, args.micro_batches, args.steps, world
        )
    except tl.PlanError as e:
        alone = world == 1 and len(args.micro_batches) > 1  # not started by a launcher?
        hint = " (start the ranks with python -m torch.distributed.run --nproc_per_node N)"
        parser.error(f"argument --{e.argument.replace('_', '-')}: {e.reason}{hint * alone}")
    if not args.out.parent.is_dir():
        parser.error(f"argument --out: {args.out.parent} is not a directory")
    if args.gradient_clipping < 0:
        parser.error(f"argument --gradient-clipping: {args.gradient_clipping:g} is negative")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch.distributed as dist

    from gas_lab.dp import end_rank, init_from_env

    init_from_env()
    events = tl.record_run(
        args.library,
        args.stage,
        args.mode,
        args.micro_batches,
        args.steps,
        args.gradient_clipping,
    )
    everyone = tl.gather(events)
    if dist.get_rank() == 0:
        trace = ct.chrome_trace(
            everyone,
            library=args.library,
            stage=args.stage,
            mode=args.mode,
            micro_batches=args.micro_batches,
            steps=args.steps,
            gradient_clipping=args.gradient_clipping,
        )
        problems = ct.validate_trace(trace)  # the format this command promises, checked
        if problems:
            print(f"gas_lab.timeline: invalid trace: {problems[0]}", file=sys.stderr)
            sys.exit(1)
        args.out.write_text(json.dumps(trace, indent=1) + "\n")
        for rank in tl.ranks(everyone):
            print(tl.describe(everyone, rank))
        print(f"wrote {args.out}: open it at https://ui.perfetto.dev or chrome://tracing")
    end_rank()  # skips a teardown that sometimes aborts after the work is done


if __name__ == "__main__":
    main()
