"""Rewrite notebooks in exactly the form JupyterLab saves them, so they open unmodified.

    python tools/normalize_notebooks.py tutorials/*.ipynb           # rewrite in place
    python tools/normalize_notebooks.py --check tutorials/*.ipynb   # exit 1 if one differs

When a notebook's kernel starts, JupyterLab writes the kernel's metadata into the notebook: the
kernelspec (``"display_name": "Python 3 (ipykernel)"``) and the ``language_info`` the kernel
reports, Python's exact version included. A notebook committed with anything else is
"modified" the moment it opens, and closing it asks whether to save. This tool writes that
metadata for this environment's Python kernel, then serializes as Jupyter's server does
(nbformat: sorted keys, one-space indent, a final newline). Cells, their ids and outputs are
kept as they are.

The course's JupyterLab (``make lab``) also fills in the learner's own Python version when it
opens a notebook (``lab/jupyter_lab_config.py``), so a learner whose Python is another 3.11.x
sees no change either.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat


def kernel_metadata(python_version: str | None = None) -> dict:
    """The notebook metadata JupyterLab writes for this environment's Python kernel.
    ``python_version`` replaces the running Python's (to check a notebook another 3.11.x wrote)."""
    from ipykernel.ipkernel import IPythonKernel
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    language_info = dict(IPythonKernel.language_info)
    if python_version is not None:
        language_info["version"] = python_version
    return {
        "kernelspec": {
            "display_name": spec.display_name,
            "language": spec.language,
            "name": "python3",
        },
        "language_info": language_info,
    }


def normalized(text: str, python_version: str | None = None) -> str:
    """``text`` (a notebook's JSON) as JupyterLab would save it in this environment."""
    nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
    nb.metadata.update(kernel_metadata(python_version))
    return nbformat.writes(nb).rstrip("\n") + "\n"


def in_form(text: str) -> bool:
    """Is ``text`` in the form JupyterLab saves? Another 3.11.x than this environment's counts:
    each maintainer's JupyterLab writes its own, and a learner's fills in theirs."""
    version = json.loads(text).get("metadata", {}).get("language_info", {}).get("version", "")
    same_minor = version.split(".")[:2] == [str(n) for n in sys.version_info[:2]]
    return normalized(text, version if same_minor else None) == text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if one differs"
    )
    args = parser.parse_args(argv)
    differ = []
    for path in args.notebooks:
        text = path.read_text(encoding="utf-8")
        if args.check and not in_form(text):
            differ.append(path)
        elif not args.check and normalized(text) != text:
            differ.append(path)
            path.write_text(normalized(text), encoding="utf-8")
    verb = "differ from" if args.check else "rewritten in"
    for path in differ:
        print(f"{path}: {verb} the form JupyterLab saves")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
