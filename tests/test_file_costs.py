"""`make costs` (tools/file_costs.py): each test file alone, its wall and the machine's CPU."""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import file_costs  # noqa: E402


def test_busy_seconds_counts_every_state_but_idle_and_iowait():
    hz = os.sysconf("SC_CLK_TCK")
    #          user nice system idle iowait irq softirq steal guest guest_nice
    stat = "cpu  300 20 100 5000 70 4 6 10 99 99\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    assert file_costs.busy_seconds(stat) == (300 + 20 + 100 + 4 + 6 + 10) / hz
    assert file_costs.busy_seconds() > 0  # this machine's, read from /proc/stat


def test_each_file_gets_its_result_and_a_failure_fails_the_run(tmp_path, capsys):
    good, bad = tmp_path / "test_good.py", tmp_path / "test_bad.py"
    good.write_text(
        "import time\n\ndef test_a():\n    time.sleep(0.5)\n\ndef test_b():\n    pass\n"
    )
    bad.write_text("def test_a():\n    pass\n\ndef test_c():\n    assert 1 == 2\n")
    out = tmp_path / "costs.json"
    assert file_costs.main([str(good), str(bad), "--json", str(out)]) == 1
    rows = {Path(r["target"]).name: r for r in json.loads(out.read_text())}
    assert (rows["test_good.py"]["exit"], rows["test_good.py"]["passed"]) == (0, 2)
    assert (rows["test_bad.py"]["exit"], rows["test_bad.py"]["passed"]) == (1, 1)
    assert "1 failed, 1 passed" in rows["test_bad.py"]["summary"]
    assert rows["test_good.py"]["wall"] >= 0.5 and rows["test_good.py"]["cpu"] > 0
    table = capsys.readouterr().out.split("\n\n")[-1].splitlines()
    assert "FAILED (exit 1)" in next(line for line in table if "test_bad.py" in line)
    assert table[-1].split()[2:] == ["3", "in", "all"]
