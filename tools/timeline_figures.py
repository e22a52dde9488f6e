"""The docs' timeline figures (docs/concepts/timeline_*.svg), recorded on 2 ranks::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tools/timeline_figures.py

* ``timeline_modes.svg``: DeepSpeed at stage 0, managed (GAS 3 on both ranks) above unmanaged
  (3 micro-batches on rank 0, 1 on rank 1): where the gradient all-reduce sits.
* ``timeline_libraries.svg``: the unmanaged run on gas_lab above the same on DeepSpeed.

Drawn with the lessons' sizes (tutorials/matplotlibrc) in logical time, so a re-run draws the
same figures unless the calls or collectives change.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("svg")

import torch.distributed as dist  # noqa: E402

from gas_lab.dp import end_rank, init_from_env  # noqa: E402
from gas_lab.lessons import timeline_plots as tp  # noqa: E402
from gas_lab.measure import recording as tl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "concepts"


def main() -> None:
    init_from_env()
    runs = {
        (lib, mode): tl.gather(tl.record_run(lib, 0, mode, [3, 3] if managed else [3, 1]))
        for lib in tl.LIBRARIES
        for mode, managed in (("managed", True), ("unmanaged", False))
    }
    if dist.get_rank() == 0:
        matplotlib.rc_file(ROOT / "tutorials" / "matplotlibrc")
        figures = {
            "timeline_modes.svg": {
                "managed, N = 3 on each rank": runs["deepspeed", "managed"],
                "unmanaged, N = 3 on rank 0, 1 on rank 1": runs["deepspeed", "unmanaged"],
            },
            "timeline_libraries.svg": {
                lib: runs[lib, "unmanaged"] for lib in ("gas_lab", "deepspeed")
            },
        }
        for name, shown in figures.items():
            (OUT / name).write_text(tp.svg(tp.plot_side_by_side(shown)))
            print(f"wrote {OUT / name}")
    end_rank()


if __name__ == "__main__":
    main()
