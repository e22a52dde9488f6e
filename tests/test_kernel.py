"""The runtime driven through a real Jupyter kernel, as JupyterLab drives it (jupyter_client).

Kernel -> Restart / Shut Down / Interrupt, a killed kernel, output while a cell runs, and the
messages a learner reads. Every row of issue 14's table: zero processes left within seconds.
"""

import os
import re
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from gas_lab.runtime.lifetime import running

pytestmark = pytest.mark.ranks
ROOT = Path(__file__).resolve().parents[1]
GONE_WITHIN = 5.0  # seconds after the kernel is restarted, shut down or killed


class Kernel:
    """A real IPython kernel (what JupyterLab starts), and the messages each cell sends back."""

    def __init__(self):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(ROOT), env=os.environ | {"DS_ACCELERATOR": "cpu"})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def submit(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout: float = 300, interrupt_after: float | None = None):
        """(seconds, message) for every output of cell ``msg_id`` until it ends, and its reply."""
        t0, interrupted, out = time.monotonic(), None, []
        while True:
            if interrupt_after is not None and interrupted is None:
                if time.monotonic() - t0 > interrupt_after:
                    self.km.interrupt_kernel()
                    interrupted = time.monotonic() - t0
            try:
                msg = self.kc.get_iopub_msg(timeout=0.1)
            except Exception:  # queue.Empty
                assert time.monotonic() - t0 < timeout, f"cell still running after {timeout} s"
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            out.append((time.monotonic() - t0, msg))
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        # The reply to this cell: wait_for_ready may have left kernel_info replies in the queue
        # (it asks again every second until the kernel answers, as on a loaded machine).
        reply = self.kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=30)
        return out, reply["content"], interrupted

    def run(self, code: str, **kw):
        return self.collect(self.submit(code), **kw)

    def close(self):
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)


def text_of(messages, kind=("stream",)) -> str:
    parts = []
    for _, m in messages:
        if m["msg_type"] in kind:
            c = m["content"]
            parts.append(c.get("text") or c.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def rendered(messages) -> list[str]:
    """The cell's error as JupyterLab shows it: the lines of its error output, without colour."""
    tb = next(m["content"]["traceback"] for _, m in messages if m["msg_type"] == "error")
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(tb)).splitlines()


START = "import gas_lab, os, time\nc = gas_lab.start_cluster(world_size=2, device='cpu')"


def _still_running(procs) -> list:
    return [p for p in procs if running(p)]


CASES = {
    "restart, idle": (False, lambda k: k.km.restart_kernel(now=False)),
    "restart, busy": (True, lambda k: k.km.restart_kernel(now=False)),
    "restart now": (False, lambda k: k.km.restart_kernel(now=True)),
    "shut down now, busy": (True, lambda k: k.km.shutdown_kernel(now=True)),
    "kernel killed": (True, lambda k: os.kill(k.pid, signal.SIGKILL)),
    "shut down, idle": (False, lambda k: k.km.shutdown_kernel(now=False)),
    "shut down, busy": (True, lambda k: k.km.shutdown_kernel(now=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_process_outlives_its_kernel(case):
    busy, action = CASES[case]
    k = Kernel()
    try:
        _, reply, _ = k.run(START + "\nprint(c._tmp)")
        assert reply["status"] == "ok", reply
        procs = psutil.Process(k.pid).children(recursive=True)
        folders = Path(tempfile.gettempdir()).glob("gas_lab_ranks_*")
        folder = next(f for f in folders if _owned_by(f, k.pid))
        assert len(procs) == 6  # guardian, controller and heart monitor, 2 ranks and their parent
        if busy:
            k.submit("c.run(time.sleep, 60)")
            time.sleep(2)
        t0 = time.monotonic()
        action(k)
        while _still_running(procs) and time.monotonic() - t0 < GONE_WITHIN + 10:
            time.sleep(0.1)
        gone_after = time.monotonic() - t0
        assert _still_running(procs) == [], f"{case}: processes left after {gone_after:.1f} s"
        assert gone_after < GONE_WITHIN, f"{case}: took {gone_after:.1f} s"
        print(f"{case}: {len(procs)} processes, all gone {gone_after:.1f} s after")
        deadline = time.monotonic() + 5
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not folder.exists()
    finally:
        k.close()


def _owned_by(folder: Path, pid: int) -> bool:
    try:
        return (folder / "cluster_id").read_text().startswith(f"gas_lab-{pid}-")
    except OSError:
        return False


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    _, reply, _ = k.run(START)
    assert reply["status"] == "ok", reply
    yield k
    k.close()


SPIN = """
def spin(seconds):
    t = time.time()
    while time.time() - t < seconds:
        pass
    return "finished"
"""


def test_interrupt_stops_the_work_and_keeps_the_ranks(kernel):
    kernel.run(SPIN)
    _, reply, _ = kernel.run("pids = c.pids\nc.run(lambda: os.environ.__setitem__('KEPT', '1'))")
    assert reply["status"] == "ok"
    msgs, reply, at = kernel.run("c.run(spin, 30)", interrupt_after=3)
    ended = msgs[-1][0] - at
    assert reply["status"] == "error" and reply["ename"] == "RankInterrupt", reply
    assert "stopped" in reply["evalue"] and "keep their variables" in reply["evalue"]
    assert ended < 5, f"the cell ended {ended:.1f} s after the interrupt"
    lines = rendered(msgs)  # where rank 0 was stopped, in the learner's function, first
    assert lines[0] == "Traceback on rank 0 (most recent call last):"
    assert re.fullmatch(r"  Cell In\[\d+\], line \d+, in spin", lines[1]), lines
    assert lines[2].strip() in ("while time.time() - t < seconds:", "pass")
    assert "KeyboardInterrupt" in lines[:6]
    assert lines[-1].startswith("gas_lab: Interrupted: the work on ranks [0, 1] stopped after")
    assert lines[-1].endswith("Full report: print(cluster.last_error).")
    assert not any("gas_lab/runtime" in line for line in lines)
    msgs, reply, _ = kernel.run("assert c.pids == pids\nprint(c.run(os.getenv, 'KEPT'))")
    assert reply["status"] == "ok" and "['1', '1']" in text_of(msgs)
    assert msgs[-1][0] < 3, "the next call waited for work the interrupt should have stopped"
    print(
        f"interrupt while computing: cell ended {ended:.2f} s after; next call {msgs[-1][0]:.2f} s"
    )


LONELY = """
def lonely():
    import torch, torch.distributed as dist
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return "returned"
"""


def test_interrupt_in_a_collective_restarts_the_ranks_and_says_so(kernel):
    kernel.run(LONELY + "\npids = c.pids")
    msgs, reply, at = kernel.run("c.run(lonely)", interrupt_after=3)
    ended = msgs[-1][0] - at
    assert reply["status"] == "error" and reply["ename"] == "RankInterrupt", reply
    assert "rank 0 was waiting in a collective (all_reduce" in reply["evalue"]
    assert "restarted" in reply["evalue"]
    assert ended < 40, f"the cell ended {ended:.1f} s after the interrupt"
    lines = rendered(msgs)  # where rank 0 waits, in the learner's function, first
    assert lines[0] == "Stack on rank 0 (most recent call last):"
    assert re.fullmatch(r"  Cell In\[\d+\], line \d+, in lonely", lines[1]), lines
    assert lines[2] == "    dist.all_reduce(torch.ones(1))  # rank 1 never joins"
    assert lines[3].startswith("rank 0 is waiting in a collective (all_reduce, called from lonely")
    assert "so the ranks were restarted" in lines[-1]
    msgs, reply, _ = kernel.run("assert c.pids != pids\nprint(c.run(os.getpid) == c.pids)")
    assert reply["status"] == "ok" and "True" in text_of(msgs)
    assert msgs[-1][0] < 3, "the next call should not pay for the stuck collective"
    print(
        f"interrupt in a collective: cell ended {ended:.2f} s after; next call {msgs[-1][0]:.2f} s"
    )


LIVE = """%%ranks
import time
import torch.distributed as dist
from tqdm.auto import tqdm

for step in range(6):
    print(f"step {step}")
    time.sleep(0.5)
if dist.get_rank() == 0:
    for _ in tqdm(range(30), desc="train"):
        time.sleep(0.1)
"""


def test_output_arrives_while_the_cell_runs_and_a_bar_is_one_live_line(kernel):
    msgs, reply, _ = kernel.run(LIVE)
    assert reply["status"] == "ok", reply
    end = msgs[-1][0]
    first = next(t for t, m in msgs if "[rank 0] step 0" in text_of([(t, m)]))
    assert end - first > 2.0, f"the first line came {end - first:.1f} s before the end"
    streamed = text_of(msgs)
    assert "[rank 1] step 5" in streamed and "%|" not in streamed  # no bar lines as text
    bars = [m for _, m in msgs if m["msg_type"] in ("display_data", "update_display_data")]
    assert bars and all("[rank 0] train" in text_of([(0, m)], kind=(m["msg_type"],)) for m in bars)
    updates = [m for m in bars if m["msg_type"] == "update_display_data"]
    assert len(updates) >= 3  # it moved while the cell ran, in place
    assert "100%" in text_of([(0, updates[-1])], kind=("update_display_data",))


@pytest.mark.parametrize(
    "line, says",
    [
        ("--timeout", "%%ranks --timeout needs a number of seconds"),
        ("--timeout abc", "%%ranks --timeout abc: not a number of seconds"),
        ("--timeout 0", "%%ranks --timeout 0: the timeout must be more than 0 seconds"),
        ("--timeout -1", "%%ranks --timeout -1: the timeout must be more than 0 seconds"),
        ("--tmeout 5", "%%ranks: unknown option '--tmeout'"),
    ],
)
def test_a_bad_ranks_line_is_one_line_naming_the_option(kernel, line, says):
    msgs, reply, _ = kernel.run(f"%%ranks {line}\nprint('the cell ran')")
    assert reply["status"] == "error" and reply["ename"] == "UsageError", reply
    assert reply["evalue"].startswith(says) and "\n" not in reply["evalue"]
    assert "the cell ran" not in text_of(msgs)  # refused before anything ran on the ranks


def test_after_stop_a_ranks_cell_says_the_ranks_are_new(kernel):
    kernel.run("%%ranks\nmine = 1")
    msgs, reply, _ = kernel.run("c.stop()")
    assert reply["status"] == "ok"
    msgs, reply, _ = kernel.run("%%ranks\nprint(mine)")
    # A notice, told from an error at a glance: its own display on a blue rule, not stderr's red.
    said = "fresh ranks are starting; variables defined on the ranks by earlier cells are gone"
    notices = [d for d in displayed(msgs) if said in d["text/plain"]]
    assert len(notices) == 1 and notices[0]["text/plain"].startswith("gas_lab notice: ")
    assert "border-left" in notices[0]["text/html"] and said not in text_of(msgs)
    assert reply["ename"] == "RankError" and "NameError" in reply["evalue"]
    assert "started anew for this call" in reply["evalue"]


RAISES = """%%ranks
import torch.distributed as dist
if dist.get_rank() == 1:
    raise ValueError("boom")
"""


def test_a_rank_error_shows_the_ranks_own_traceback_first(kernel):
    msgs, reply, _ = kernel.run(RAISES)
    assert reply["status"] == "error" and reply["ename"] == "RankError", reply
    lines = rendered(msgs)
    assert lines[0] == "Traceback on rank 1 (most recent call last):"
    assert re.fullmatch(r"  Cell In\[\d+\], line 3, in <module>", lines[1]), lines
    # The cell under the prompt, not the next one (IPython counts the cell before running it).
    assert lines[1].startswith(f"  Cell In[{reply['execution_count']}],"), lines
    assert lines[2:4] == ['    raise ValueError("boom")', "ValueError: boom"]
    assert lines[-1] == (
        "gas_lab: rank 1 failed; rank 0 finished; the ranks keep their variables. "
        "Full report: print(cluster.last_error)."
    )
    assert not any("gas_lab/runtime" in line or "run_cell_magic" in line for line in lines)
    msgs, reply, _ = kernel.run("print(c.last_error)")  # the full report, as the line says
    assert "rank 1 raised ValueError: boom\n" in text_of(msgs)


def test_a_stall_shows_where_the_rank_waits_first(kernel):
    kernel.run(LONELY)
    msgs, reply, _ = kernel.run("c.run(lonely, timeout=2)")
    assert reply["status"] == "error" and reply["ename"] == "RankStallError", reply
    lines = rendered(msgs)
    assert lines[0] == "Stack on rank 0 (most recent call last):"
    assert re.fullmatch(r"  Cell In\[\d+\], line \d+, in lonely", lines[1]), lines
    assert lines[2] == "    dist.all_reduce(torch.ones(1))  # rank 1 never joins"
    assert lines[3].startswith("rank 0 is waiting in a collective (all_reduce, called from lonely")
    assert lines[-1] == (
        "gas_lab: no result from rank 0 after 2 s (rank 1 finished); the ranks were restarted, "
        "variables on the ranks are lost. Full report: print(cluster.last_error)."
    )


def displayed(messages) -> list[dict]:
    """The data of each display in the cell, in order."""
    return [m["content"]["data"] for _, m in messages if m["msg_type"] == "display_data"]


def test_a_ranks_cells_last_expression_shows_each_ranks_value_like_out(kernel):
    msgs, reply, _ = kernel.run("%%ranks\nimport torch.distributed as dist\ndist.get_rank() * 10")
    assert reply["status"] == "ok", reply
    n = reply["execution_count"]
    assert [d["text/plain"] for d in displayed(msgs)] == [
        f"[rank 0] Out[{n}]: 0",
        f"[rank 1] Out[{n}]: 10",
    ]
    assert not any(m["msg_type"] == "execute_result" for _, m in msgs)
    msgs, reply, _ = kernel.run("%%ranks\ndist.get_rank() * 10;  # quiet, as in IPython")
    assert reply["status"] == "ok" and displayed(msgs) == []
    msgs, _, _ = kernel.run("%%ranks\nprint('no value')\nNone")
    assert displayed(msgs) == [] and "[rank 1] no value" in text_of(msgs)
    # A rich value arrives as the rank's own mime bundle, below its label.
    msgs, _, _ = kernel.run(
        "%%ranks\nfrom IPython.display import HTML\nHTML(f'<b>{dist.get_rank()}</b>')"
    )
    shown = displayed(msgs)
    n += 3
    assert [d["text/plain"] for d in shown[::2]] == [f"[rank 0] Out[{n}]:", f"[rank 1] Out[{n}]:"]
    assert [d.get("text/html") for d in shown[1::2]] == ["<b>0</b>", "<b>1</b>"]
    # cluster.run's results stay a list, shown once as the cell's own Out.
    msgs, reply, _ = kernel.run("c.run(lambda: 1)")
    results = [m for _, m in msgs if m["msg_type"] == "execute_result"]
    assert [m["content"]["data"]["text/plain"] for m in results] == ["[1, 1]"]


def test_a_cell_on_chosen_ranks_runs_there_only(kernel):
    msgs, reply, _ = kernel.run("%%ranks --rank 1\nimport os\nprint('here', os.environ['RANK'])")
    assert reply["status"] == "ok", reply
    assert "[rank 1] here 1" in text_of(msgs) and "[rank 0]" not in text_of(msgs)
    msgs, reply, _ = kernel.run("%%ranks --rank 0,1\nimport os\nint(os.environ['RANK'])")
    assert [d["text/plain"][9:] for d in displayed(msgs)] == [
        f"Out[{reply['execution_count']}]: 0",
        f"Out[{reply['execution_count']}]: 1",
    ]
    msgs, reply, _ = kernel.run("%%ranks --rank 2\nprint('ran')")
    assert reply["ename"] == "UsageError" and "this notebook has ranks 0 to 1" in reply["evalue"]


LONE = """%%ranks --rank 0
import torch, torch.distributed as dist
dist.all_reduce(torch.ones(1))
"""


def test_a_collective_on_chosen_ranks_ends_the_cell_soon_and_says_why(kernel):
    msgs, reply, _ = kernel.run(LONE)
    took = msgs[-1][0]
    assert reply["status"] == "error" and reply["ename"] == "LoneCollectiveError", reply
    assert took < 20, f"the cell ended after {took:.1f} s (the stall timeout is 60 s)"
    lines = rendered(msgs)
    assert lines[0] == "Stack on rank 0 (most recent call last):"
    assert lines[1] == f"  Cell In[{reply['execution_count']}], line 2, in <module>", lines
    assert lines[2] == "    dist.all_reduce(torch.ones(1))"
    assert lines[-1] == (
        "gas_lab: this cell runs on rank 0 only (%%ranks --rank 0) and rank 1 never joins the "
        "collective, so it can never complete; the ranks were restarted, variables on the ranks "
        "are lost. Collectives need every rank: run them in a %%ranks cell without --rank."
    )
    msgs, reply, _ = kernel.run("print(c.run(lambda: 'ready'))")
    assert reply["status"] == "ok" and "['ready', 'ready']" in text_of(msgs)
    print(f"a collective on rank 0 only: the cell ended after {took:.1f} s")


def test_ranks_status_is_a_line_magic(kernel):
    msgs, reply, _ = kernel.run("%ranks_status")
    assert reply["status"] == "ok", reply
    out = next(m for _, m in msgs if m["msg_type"] == "execute_result")["content"]["data"]
    lines = out["text/plain"].splitlines()
    assert lines[0].startswith("gas_lab: this notebook's ranks: 2 ranks (gloo), 6 processes")
    assert [line.split()[0] for line in lines[2:4]] == ["0", "1"]
    assert all(line.endswith("idle") and " cpu " in line for line in lines[2:4]), lines
