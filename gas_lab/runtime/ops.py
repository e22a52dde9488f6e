"""DeepSpeed's C++ ops, built once per environment before anything waits on them.

``python -m gas_lab.runtime.ops`` (``make`` runs it before the course, the tests and JupyterLab)
builds, on DeepSpeed's CPU accelerator, the two ops the course and its tests load:

* ``deepspeed_shm_comm``: the communication op every DeepSpeed start on a CPU loads;
* ``fused_adam``: DeepSpeed's Adam without ``"torch_adam": true`` (the default-path tests).

It prints one line per op with its seconds, and only loads what is built already (about a
second). The compiler's output goes to ``gas_lab_build.log`` in the op's folder, as the runtime's
own build notice does (:mod:`~gas_lab.runtime.calls`). The ops are kept in the environment's own
cache (:func:`~gas_lab.runtime.build_lock.use_environment_cache`).

Why a second spelling of the environment's path rebuilt them: PyTorch's JIT loader writes the
absolute paths of DeepSpeed's sources and of PyTorch's headers into the op's ``build.ninja``, and
those paths are spelled as ``sys.path`` spells them. Reached through a symlinked ``.venv`` (or
home), every path is new, ninja sees new commands and compiles again, and switching back compiles
once more. :func:`real_paths_hook` writes a one-line ``.pth`` file that resolves ``sys.path``
to real paths when the interpreter starts, before torch or DeepSpeed is imported, so every
spelling reaches the same build.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import time

from gas_lab.runtime import build_lock

OPS = {  # op name -> DeepSpeed's builder class on the CPU accelerator
    "deepspeed_shm_comm": "ShareMemCommBuilder",
    "fused_adam": "FusedAdamBuilder",
}
PTH_NAME = "gas_lab_real_paths.pth"
# site.py runs a .pth line that starts with "import"; it must stay one line.
PTH_LINE = "import os, sys; sys.path[:] = [os.path.realpath(p) if p else p for p in sys.path]\n"


def real_paths_hook(site_packages: str | None = None) -> str:
    """Write (once) the ``.pth`` file that makes this environment's ``sys.path`` real paths at
    start-up (see the module docstring); return its path."""
    folder = site_packages or sysconfig.get_paths()["purelib"]
    path = os.path.join(folder, PTH_NAME)
    try:
        with open(path) as f:
            if f.read() == PTH_LINE:
                return path
    except OSError:
        pass
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path


@contextlib.contextmanager
def _output_to(log_path: str):
    """Send this process's stdout and stderr (the compiler's too: ninja inherits them) to a log."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def build(name: str) -> tuple[bool, float, str]:
    """Build or load op ``name``: (whether it was built now, seconds, its log file)."""
    from deepspeed.accelerator import get_accelerator

    before = build_lock.built_ops()
    folder = os.path.join(build_lock.extensions_root(), name)
    os.makedirs(folder, exist_ok=True)
    log = os.path.join(folder, "gas_lab_build.log")
    with open(log, "w") as f:
        f.write(f"gas_lab: DeepSpeed's C++ op {name}, built in {folder}\n")
    builder = get_accelerator().create_op_builder(OPS[name])
    start = time.perf_counter()
    with _output_to(log):
        builder.load(verbose=True)
    seconds = time.perf_counter() - start
    built = name in build_lock.builds_since(before)
    return built, seconds, log


def main() -> int:
    # The environment's own cache is already set: importing gas_lab (this package) does it.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    hook = real_paths_hook()
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator()._name
    if name != "cpu":
        print(f"gas_lab ops: DeepSpeed's accelerator is {name}: its ops build on first use")
        return 0
    build_lock.clear_stale_locks(say=lambda text: print(f"gas_lab ops: {text}"))
    root = build_lock.extensions_root()
    for op in OPS:
        try:
            built, seconds, log = build(op)
        except Exception as err:  # the log has the compiler's words; one line here
            print(
                f"gas_lab ops: {op}: the build failed ({type(err).__name__}); see its log in "
                f"{os.path.join(root, op, 'gas_lab_build.log')}",
                file=sys.stderr,
            )
            return 1
        what = f"built in {seconds:.0f} s" if built else f"built already ({seconds:.1f} s to load)"
        print(f"gas_lab ops: {op}: {what}" + (f"; log: {log}" if built else ""))
    print(f"gas_lab ops: kept in {root}; real paths at start-up: {hook}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
