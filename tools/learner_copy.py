"""The learner's own copy of the course: ``make lab`` opens JupyterLab on ``my_tutorials/``, a
git-ignored copy of ``tutorials/``, never on ``tutorials/`` itself.

JupyterLab saves a notebook's outputs into its file as it runs (autosave), so a learner who ran
the course had changed its files (1,456 lines across two notebooks after one session), and the
next ``git pull`` of course updates conflicted. A copy keeps ``git status`` clean and every
update pullable, with nothing to install or configure (a git filter such as nbstripout would
need a package and a per-clone ``git config``, and would still leave the working files changed
on disk, where JupyterLab shows the learner their outputs of last week as if they were new).

Each run copies what the learner does not have yet and never overwrites their file; a notebook
whose original changed since it was copied is named, with how to take the new version.
Usage: ``python tools/learner_copy.py tutorials my_tutorials``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

RECORD = ".originals.json"  # the hash of each original at the time it was copied


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def update_copy(source: Path, copy: Path) -> dict[str, list[str]]:
    """Copy into ``copy`` every file of ``source`` it lacks; return ``copied`` and ``changed``
    (originals updated since the learner's copy was made), as paths relative to ``source``."""
    copy.mkdir(parents=True, exist_ok=True)
    record_path = copy / RECORD
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    copied, changed = [], []
    for original in sorted(source.rglob("*")):
        rel = original.relative_to(source)
        if original.is_dir() or any(p.startswith(".ipynb_checkpoints") for p in rel.parts):
            continue
        mine, name = copy / rel, rel.as_posix()
        if not mine.exists():
            mine.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(original, mine)
            record[name] = _digest(original)
            copied.append(name)
        elif record.get(name) not in (None, _digest(original)):
            changed.append(name)
    record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return {"copied": copied, "changed": changed}


def main(source: str, copy: str) -> None:
    done = update_copy(Path(source), Path(copy))
    if done["copied"]:
        print(
            f"{copy}/: your copy of the course ({len(done['copied'])} files copied from {source}/)"
        )
    for name in done["changed"]:
        print(
            f"{source}/{name} changed since your copy was made: to take the new version, delete "
            f"{copy}/{name} (your edits and outputs in it go with it) and run make lab again"
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
