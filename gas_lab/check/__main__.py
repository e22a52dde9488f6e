"""``python -m gas_lab.check FILE.py:FUNCTION``: check a loop, exit 0 (right), 1 (wrong), 2 (usage).

The contract, the objectives and the verdict: :mod:`gas_lab.check`.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
from pathlib import Path

from gas_lab.check.models import MODELS
from gas_lab.check.objectives import REDUCTIONS


class UsageError(Exception):
    """Bad usage: one line that names the argument."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's two lines (usage + message) become one
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m gas_lab.check",
        description="Check that FUNCTION(engine, micro_batches), one unmanaged optimizer step "
        "on one rank, equals the declared objective on W CPU ranks at each ZeRO stage.",
    )
    p.add_argument("target", metavar="FILE.py:FUNCTION")
    declare = p.add_mutually_exclusive_group()
    declare.add_argument("--reduction", default=None, help=f"one of {', '.join(REDUCTIONS)}")
    declare.add_argument(
        "--objective",
        metavar="FILE.py:FUNCTION",
        default=None,
        help="your own objective: FUNCTION(ranks) -> per-target weights, [B, T] per micro-batch",
    )
    p.add_argument("--constant", type=float, default=None, help="divide the objective by C")
    p.add_argument("--count-empty-sequences", action="store_true")
    p.add_argument("--equal-counts", action="store_true", help="only cases with equal counts")
    p.add_argument("--cases", default=None, help="only these cases, comma-separated names")
    p.add_argument("--stages", default="0,1,2", help="ZeRO stages, comma-separated")
    p.add_argument("--library", default="deepspeed", help="deepspeed or gas_lab")
    p.add_argument("--model", default="toy", help=f"one of {', '.join(MODELS)}")
    p.add_argument("--world-size", type=int, default=2, help="ranks, 2 to 4")
    p.add_argument("--case-timeout", type=float, default=20.0, help="seconds per case")
    p.add_argument("--config", type=Path, default=None, help="a DeepSpeed config JSON file")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def load_function(
    target: str, argument: str = "FILE.py:FUNCTION", calls: str = "(engine, micro_batches)"
):
    """``FILE.py:FUNCTION`` -> the function; UsageError naming what is missing or wrong."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise UsageError(f"{argument}: {target!r} has no ':FUNCTION' part")
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{argument}: no such file {path!r}")
    spec = importlib.util.spec_from_file_location(f"gas_lab_user_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so the function travels to the ranks by value
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"{argument}: {path} has no function {name!r}")
    n = calls.count(",") + 1
    try:
        inspect.signature(fn).bind(*([None] * n))
    except TypeError:
        raise UsageError(
            f"{argument}: {name}{inspect.signature(fn)} cannot be called as {name}{calls}"
        ) from None
    return fn


def parse_stages(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise UsageError(f"--stages: {text!r} is not a comma-separated list of numbers") from None


def read_config(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        config = json.loads(path.read_text())
    except OSError as err:
        raise UsageError(f"--config: cannot read {str(path)!r} ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"--config: {str(path)!r} is not JSON ({err})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--config: {str(path)!r} holds a {type(config).__name__}, not an object")
    return config


def main(argv: list[str] | None = None) -> int:
    from gas_lab.check import check_arguments, check_loop

    try:
        args = parser().parse_args(argv)
        stages = parse_stages(args.stages)
        config = read_config(args.config)
        objective = None
        if args.objective is not None:
            objective = load_function(args.objective, "--objective", "(ranks)")
            objective.__gas_lab_name__ = args.objective
        fn = load_function(args.target)
        options = {
            "objective": objective,
            "count_empty_sequences": args.count_empty_sequences,
            "model": args.model,
            "world_size": args.world_size,
            "case_timeout": args.case_timeout,
            "cases": None if args.cases is None else tuple(args.cases.split(",")),
        }
        try:
            check_arguments(args.reduction, stages, args.library, args.constant, config, **options)
        except ValueError as err:
            raise UsageError(f"--{err}") from None
    except UsageError as err:
        print(f"gas_lab.check: error: {err}", file=sys.stderr)
        return 2
    result = check_loop(
        fn,
        args.reduction,
        stages,
        constant=args.constant,
        equal_counts=args.equal_counts,
        library=args.library,
        config=config,
        progress=not args.json and sys.stderr.isatty(),
        **options,
    )
    print(result.to_json() if args.json else result)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
