"""What docs/concepts/boundary.md ("Which DeepSpeed has it") says of the pinned DeepSpeed: it has
every row of the table. The rows' first releases were checked against DeepSpeed's release tags
(issue 31); what a test can hold is that the pin the course installs has them all."""

import re
from pathlib import Path

import deepspeed
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "concepts" / "boundary.md").read_text()


def test_the_page_names_the_pinned_deepspeed():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = next(d.split("==")[1] for d in deps if d.startswith("deepspeed=="))
    assert deepspeed.__version__ == pinned
    section = PAGE[PAGE.index("## Which DeepSpeed has it") :]
    assert f"The course pins DeepSpeed {pinned}" in section
    assert re.findall(r"#(\d{4})", section) == ["8184", "8203", "8217", "8225", "8232"]


def test_the_pinned_deepspeed_has_every_row():
    from deepspeed.runtime.config import get_gradient_allreduce_op
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert callable(DeepSpeedEngine.managed_gradient_accumulation)  # #8184
    assert get_gradient_allreduce_op({"gradient_allreduce_op": "sum"}) == "sum"  # #8232
    # #8203, #8217, #8225: the committed matrix has DeepSpeed accept unmanaged at every stage,
    # with and without offload (the refusal matrix's tests hold that file to DeepSpeed).
    import json

    matrix = json.loads(
        (ROOT / "data" / f"deepspeed_{deepspeed.__version__}_matrix.json").read_text()
    )
    grid = {
        (c["axes"]["stage"], c["axes"]["offload"]): c["outcome"]
        for c in matrix["cases"]
        if c["group"] == "grid" and c["axes"]["managed"] is False
        and not c["axes"]["overlap_comm"] and c["axes"]["precision"] == "fp32"
    }  # fmt: skip
    assert grid == {(s, o): "accepted" for s in range(4) for o in ("none", "cpu")}
