"""A first DeepSpeed start, with DeepSpeed's C++ op not built yet in this environment, is start-up
work, not a stall: the imports and the JIT build outlast a 3-second timeout, the call waits for
them, and the runtime says it in one line as the build starts and one as it ends, with the
compiler's output in a log file the lines name (tests/test_rank_errors.py has the other
errors). A real build into an empty cache, in a process of its own: about a minute, so the
file stands alone and the test workers run it beside others.
"""

import json
import os
import re
import sys

import pytest

from gas_lab.runtime.lifetime import run_command

pytestmark = pytest.mark.ranks


_COLD_START = """
import json, os, sys, time
os.environ["TORCH_EXTENSIONS_DIR"] = sys.argv[1]  # an empty cache: DeepSpeed builds its op
import gas_lab
from gas_lab.lessons import hello
c = gas_lab.start_cluster(world_size=2, device="cpu")
t = time.time()
out = c.run(hello.train_tiny_deepspeed, 1, timeout=3)
same = bool((out[0]["params"] == out[1]["params"]).all())
print(json.dumps({"seconds": time.time() - t, "same": same, "built": c.built}))
gas_lab.stop_cluster()
"""


def test_a_first_deepspeed_start_is_start_up_work_not_a_stall(tmp_path):
    """Imports and the JIT build of DeepSpeed's op outlast a short timeout: not a stall."""
    proc = run_command(
        [sys.executable, "-c", _COLD_START, str(tmp_path)],
        timeout=900,
        env=os.environ | {"DS_ACCELERATOR": "cpu"},
    )
    # The head says what gas_lab decided (start-up work, stall, death); the tail where it ended.
    assert proc.returncode == 0, proc.stderr[:3000] + "\n...\n" + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same"] and result["seconds"] > 3
    assert list(result["built"]) == ["deepspeed_shm_comm"]  # said once, by the runtime
    # One line as the build starts, one as it ends, naming the log; not the compiler's lines.
    building = re.search(
        r"^gas_lab notice: building DeepSpeed's C\+\+ op deepspeed_shm_comm, once for this "
        r"environment: 0 s \(the compiler's output goes to (\S+)\)$",
        proc.stderr,
        re.M,
    )
    assert building, proc.stderr[:3000]
    log = building[1]
    assert re.search(
        r"^gas_lab notice: built DeepSpeed's C\+\+ op deepspeed_shm_comm in \d+ s, once for this "
        rf"environment: it is kept in {re.escape(str(tmp_path))}; full log: {re.escape(log)}$",
        proc.stderr,
        re.M,
    ), proc.stderr[-3000:]
    with open(log) as f:
        logged = f.read()
    # What the ranks printed while they built, and the compiler's commands (PyTorch shows their
    # output only when a build fails): none of it in the cell.
    assert "--- what the ranks printed during the build ---" in logged
    assert "command = $cxx -MMD" in logged and "$cxx" not in proc.stdout + proc.stderr
    assert "built successfully" not in proc.stdout + proc.stderr
    # a word, not a substring: DeepSpeed's and the compiler's lines may say "installed"
    assert not re.search(r"\bstalled\b", proc.stderr) and os.listdir(tmp_path)  # built, cold
    print(f"cold DeepSpeed start with timeout=3: {result['seconds']:.1f} s")
