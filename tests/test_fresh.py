"""Fresh ranks forked from one process that imported torch and DeepSpeed (gas_lab.runtime.fresh):
the torchrun variables, a log and an exit code per rank, a timeout that kills the whole run, and
a second run that pays no import."""

import os
import time

import pytest

from gas_lab.runtime import fresh

pytestmark = pytest.mark.ranks


def _all_reduce_and_say(word: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")
    print(word, *(os.environ[k] for k in keys), t.item(), flush=True)
    if dist.get_rank() == 1:
        raise SystemExit(3)


def _fail(how: str) -> None:
    print("before", flush=False)  # still in the log: the rank flushes before it ends
    if how == "raise":
        raise ValueError("the loop's own error")
    raise SystemExit("a message, no code")


def _wait_forever() -> None:
    time.sleep(600)


def test_fresh_ranks_get_torchruns_variables_a_log_and_an_exit_code(tmp_path):
    target = f"{__name__}:_all_reduce_and_say"
    (tmp_path / "a").mkdir()
    first = fresh.run(target, ["hello"], tmp_path / "a")
    assert first["exit_codes"] == [0, 3] and not first["timed_out"]
    logs = [(tmp_path / "a" / f"log{r}.txt").read_text().split() for r in (0, 1)]
    assert logs == [
        ["hello", "0", "0", "2", "127.0.0.1", "3.0"],
        ["hello", "1", "1", "2", "127.0.0.1", "3.0"],
    ]
    (tmp_path / "b").mkdir()
    again = fresh.run(target, ["again"], tmp_path / "b")
    assert again["exit_codes"] == [0, 3]
    # torch and DeepSpeed were imported once, by the forker: new ranks in about a second
    assert again["seconds"] < 5, again
    print(f"fresh ranks: first run {first['seconds']:.1f} s, second {again['seconds']:.1f} s")


@pytest.mark.parametrize(("how", "said"), [("raise", "ValueError: the loop's own error"),
                                          ("exit", "a message, no code")])  # fmt: skip
def test_a_rank_ends_as_an_interpreter_would_report_it(tmp_path, how, said):
    """Without the interpreter's teardown, but with its exit code and what it would print."""
    got = fresh.run(f"{__name__}:_fail", [how], tmp_path)
    assert got["exit_codes"] == [1, 1]
    for rank in (0, 1):
        log = (tmp_path / f"log{rank}.txt").read_text()
        assert log.startswith("before\n") and said in log, log
    if how == "raise":
        assert "Traceback (most recent call last)" in log


def test_a_run_past_its_timeout_is_killed_whole(tmp_path):
    t0 = time.monotonic()
    got = fresh.run(f"{__name__}:_wait_forever", [], tmp_path, timeout=3)
    assert got["timed_out"] and time.monotonic() - t0 < 3 + 10
    assert got["exit_codes"] == [None, None]  # killed with their leader: nobody noted them
