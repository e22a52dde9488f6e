#!/usr/bin/env bash
# `make gpu-check`: prove the course on a machine with CUDA GPUs, in one command that fits in
# 8 minutes on one GPU. Without a GPU it says so and exits 0, having run nothing.
#
# 1. Count the GPUs (nvidia-smi). None: print that and stop.
# 2. Find a Python whose torch sees CUDA, in this order:
#    - $GPU_CHECK_PYTHON, as given;
#    - .venv (a `make install` on a GPU box that downloads torch gets a CUDA build: the Linux
#      wheels of torch on the package index are CUDA builds);
#    - .venv-gpu, made here once: on top of an interpreter that already holds a CUDA torch
#      (a GPU image's own, reused with --system-site-packages: no multi-GB download), else
#      with the pinned torch version installed from the index ($GPU_CHECK_TORCH_INDEX picks a
#      CUDA wheel index), ignoring local find-links that may hold the CPU build. constraints.txt,
#      the CPU pin CI uses, is not touched. Offline, $GPU_CHECK_WHEELS names a folder of wheels.
# 3. Run tools/gpu_check.py with it: the tutorial scripts under torchrun and deepspeed with one
#    rank per GPU (nccl), the tests marked gpu, lessons 00 and 07 under nbmake where the machine
#    has the 2 GPUs they need; then a table of what ran, passed, and took how long.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
BUDGET=${GPU_CHECK_BUDGET_S:-480}
START=$SECONDS
# make exports DS_ACCELERATOR=cpu for CPU machines; here DeepSpeed must find the GPUs itself.
unset DS_ACCELERATOR

gpus=0 why="nvidia-smi is not installed"
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true) why="nvidia-smi lists none"
fi
if [ "$gpus" -eq 0 ]; then
    echo "gpu-check: no GPU on this machine ($why), so nothing was run."
    echo "gpu-check: with CUDA GPUs this runs the tutorial scripts under torchrun and deepspeed,"
    echo "gpu-check: the tests marked gpu and lessons 00 and 07 with nccl, then prints a table."
    exit 0
fi
echo "gpu-check: nvidia-smi lists $gpus GPU(s)"

cuda_torch() {  # does this interpreter's torch see a GPU?
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

PY=${GPU_CHECK_PYTHON:-}
if [ -z "$PY" ] && [ -x .venv/bin/python ] && cuda_torch .venv/bin/python; then
    PY=.venv/bin/python
fi
if [ -z "$PY" ]; then
    VENV=.venv-gpu
    mkdir -p build/gpu-check
    pipopts=(--quiet --disable-pip-version-check)
    if [ -n "${GPU_CHECK_WHEELS:-}" ]; then pipopts+=(--no-index --find-links "$GPU_CHECK_WHEELS"); fi
    if [ ! -f "$VENV/.installed" ] || [ tools/gpu_requirements.txt -nt "$VENV/.installed" ]; then
        base=""
        for cand in ${GPU_CHECK_BASE_PYTHON:-} python3 python; do
            if command -v "$cand" >/dev/null 2>&1 && cuda_torch "$cand"; then base=$cand; break; fi
        done
        rm -rf "$VENV"
        if [ -n "$base" ]; then
            echo "gpu-check: making $VENV on $(command -v "$base"), reusing its CUDA torch"
            "$base" -m venv --system-site-packages "$VENV"
        else
            pin=$(sed -n 's/^torch==//p' constraints.txt)
            echo "gpu-check: making $VENV with torch $pin from the index (a CUDA build)"
            python3 -m venv "$VENV"
            index=()
            if [ -n "${GPU_CHECK_TORCH_INDEX:-}" ]; then index=(--index-url "$GPU_CHECK_TORCH_INDEX"); fi
            # Local find-links and pip config files may hold the CPU build: not for this one.
            env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null \
                "$VENV/bin/python" -m pip install "${pipopts[@]}" "${index[@]}" "torch==$pin"
        fi
        grep -v '^torch' constraints.txt >build/gpu-check/constraints.txt
        # --no-build-isolation: DeepSpeed ships as source and its build imports the torch above.
        "$VENV/bin/python" -m pip install "${pipopts[@]}" --no-build-isolation \
            -c build/gpu-check/constraints.txt -r tools/gpu_requirements.txt
        touch "$VENV/.installed"
    fi
    PY=$VENV/bin/python
fi
if ! cuda_torch "$PY"; then
    echo "gpu-check: $PY has torch $("$PY" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1),"
    echo "gpu-check: which sees no GPU: set GPU_CHECK_TORCH_INDEX to a CUDA wheel index, or"
    echo "gpu-check: GPU_CHECK_PYTHON to a Python with a CUDA torch, and run make gpu-check again."
    exit 1
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # gas_lab from this tree, installed or not
exec "$PY" tools/gpu_check.py --budget $((BUDGET - (SECONDS - START)))
