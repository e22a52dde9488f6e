"""Rank output as the notebook shows it (issue 14, part 3), fed the way ipyparallel delivers it:
a growing text per stream whose unfinished last line a carriage return collapses."""

import re

from gas_lab.runtime.streaming import DEEPSPEED_NOISE, RankOutput


class FakeResult:
    def __init__(self):
        self.stdout = self.stderr = ""


def test_lines_are_shown_as_they_complete_prefixed_with_the_rank(capsys):
    r0, r1 = FakeResult(), FakeResult()
    out = RankOutput([0, 1], DEEPSPEED_NOISE)
    r0.stdout = "step 0\nstep 1\nhalf"
    out.pump([r0, r1])
    assert capsys.readouterr().out == "[rank 0] step 0\n[rank 0] step 1\n"
    r1.stdout, r0.stdout = "hello\n", "step 0\nstep 1\nhalf a line\n"
    out.pump([r0, r1])
    assert capsys.readouterr().out == "[rank 0] half a line\n[rank 1] hello\n"
    r1.stderr = "no newline at the end"
    out.close([r0, r1])
    assert capsys.readouterr().err == "[rank 1] no newline at the end\n"


def test_a_progress_bar_is_one_line_not_hundreds(capsys):
    r0 = FakeResult()
    out = RankOutput([0], DEEPSPEED_NOISE)
    for i in range(1, 101):
        r0.stderr = f"train: {i:3d}%|"  # ipyparallel keeps only the latest state of the line
        out.pump([r0])
    r0.stderr = "train: 100%| done\n"
    out.close([r0])
    assert capsys.readouterr().err == "[rank 0] train: 100%| done\n"


def test_output_is_capped_per_rank_with_a_note(capsys):
    r0 = FakeResult()
    out = RankOutput([0], re.compile("never matches"), limit=1000)
    r0.stdout = "x" * 99 + "\n" + ("y" * 99 + "\n") * 100
    out.close([r0])
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 10  # 10 lines of 100 characters fit in 1000
    assert "[rank 0] ... 9,100 more characters not shown" in captured.err


def test_known_noise_is_hidden(capsys):
    r0 = FakeResult()
    r0.stdout = (
        "/usr/bin/ld: cannot find -laio: No such file or directory\nreal output\n"
        "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n"
    )
    RankOutput([0], DEEPSPEED_NOISE).close([r0])
    assert capsys.readouterr().out == "[rank 0] real output\n"
    # DeepSpeed's BF16_Optimizer reports memory at every start (lesson 08 starts a dozen)
    r0.stdout = (
        "begin bf16_optimizer\nMA 0.49 GB         Max_MA 0.49 GB         CA 0.49 GB         "
        "Max_CA 0 GB \nCPU Virtual Memory:  used = 3.1 GB, percent = 13.2%\n"
        "before initializing group 0\nafter initializing group 0\nend bf16_ optimizer\n"
        "real output\n"
    )
    RankOutput([0], DEEPSPEED_NOISE).close([r0])
    assert capsys.readouterr().out == "[rank 0] real output\n"
