"""The course's JupyterLab (`make lab` loads this file): a notebook opens unmodified.

When a notebook's kernel starts, JupyterLab writes the kernel's metadata (its kernelspec, and
Python's exact version in ``language_info``) into the notebook, which marks it modified when it
differs from what the file holds, and closing it then asks whether to save. The notebooks are
committed in that form (tools/normalize_notebooks.py); here each notebook this JupyterLab opens
gets this environment's metadata, so a learner whose Python is another 3.11.x sees no change.
"""

import sys
from pathlib import Path

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from normalize_notebooks import kernel_metadata  # noqa: E402

c = get_config()  # noqa: F821 (traitlets provides it to a config file)


class CourseContents(AsyncLargeFileManager):
    """Jupyter's default contents manager, filling in this environment's kernel metadata."""

    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if model["type"] == "notebook" and model["content"] is not None:
            if model["content"].metadata.get("kernelspec", {}).get("name") == "python3":
                model["content"].metadata.update(kernel_metadata())
        return model


c.ServerApp.contents_manager_class = CourseContents
