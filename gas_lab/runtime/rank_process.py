"""The program each notebook rank runs: import torch, then become an ipyparallel engine.

The ranks start at the same time as ipyparallel's controller (see
:mod:`~gas_lab.runtime.cluster`), so the seconds a rank spends importing torch and the process
group code overlap the controller's own start-up instead of following it; the engine then finds
the controller's connection file already written.
"""

from __future__ import annotations

import torch.distributed  # noqa: F401  (the slow import every rank needs for setup_rank)

import gas_lab.dp  # noqa: F401

if __name__ == "__main__":
    from ipyparallel.engine.app import main

    main()
