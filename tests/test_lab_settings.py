"""`make lab` opens the course without JupyterLab's "official Jupyter news?" toast.

Starts JupyterLab exactly as `make lab` does (the command `make -n lab` prints), on a free
loopback port with fresh user settings, and reads the notification plugin's settings back
from its REST API: what a learner's JupyterLab sees.
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "@jupyterlab/apputils-extension:notification"


def _make_lab_command() -> list[str]:
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "lab"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.replace("\\\n", " ")
    line = next(ln for ln in dry.splitlines() if "jupyter lab" in ln)
    return shlex.split(line)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_lab_turns_off_the_news_toast(tmp_path):
    port = _free_port()
    command = _make_lab_command() + [
        "--no-browser",
        f"--port={port}",
        "--IdentityProvider.token=",  # loopback only, for this test's requests
    ]
    env = os.environ | {  # no settings of this machine's user leak in
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "user-settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
    }
    lab = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/lab/api/settings/{PLUGIN}"
    try:
        deadline, settings = time.monotonic() + 90, None
        while settings is None and time.monotonic() < deadline:
            assert lab.poll() is None, lab.stderr.read().decode()[-2000:]
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    settings = json.load(reply)
            except OSError:
                time.sleep(0.5)
        assert settings is not None, "JupyterLab did not answer within 90 s"
        # The frontend's value: the user's setting (none here) over the schema's default, which
        # overrides.json replaces.
        defaults = {k: v.get("default") for k, v in settings["schema"]["properties"].items()}
        effective = defaults | settings.get("settings", {})
        assert effective["fetchNews"] == "false"  # JupyterLab's own default, "none", asks
        assert effective["checkForUpdates"] is False
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        try:
            lab.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait(timeout=10)
