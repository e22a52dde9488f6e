"""`make lab` opens the course as a learner should find it: no "official Jupyter news?" toast, no
ipyparallel cluster panel (its clusters are not the course's ranks), and notebooks that open
unmodified, on this environment's Python and on any other 3.11.x.

Starts JupyterLab exactly as `make lab` does (the command `make -n lab` prints), on a free
loopback port with fresh user settings, and reads back what a learner's JupyterLab gets: a
plugin's settings and the page config from the server, a notebook's state from a headless
Chromium (skipped without one, except where GAS_LAB_REQUIRE_BROWSER=1, as in CI).
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from normalize_notebooks import in_form, kernel_metadata  # noqa: E402

from gas_lab.runtime.fresh import free_port  # noqa: E402

NEWS = "@jupyterlab/apputils-extension:notification"
NOTEBOOKS = sorted(
    p for p in (ROOT / "tutorials").rglob("*.ipynb") if ".ipynb_checkpoints" not in str(p)
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


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


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab as `make lab` starts it, serving a copy of tutorials/ (a test may add files),
    with one notebook committed by a maintainer whose Python was another 3.11.x."""
    tmp = tmp_path_factory.mktemp("lab")
    notebooks = tmp / "tutorials"
    shutil.copytree(ROOT / "tutorials", notebooks)
    other = json.loads((notebooks / "00_setup.ipynb").read_text())
    other["metadata"]["language_info"]["version"] = "3.11.0"
    (notebooks / "other_python.ipynb").write_text(json.dumps(other, indent=1) + "\n")
    port, command = free_port(), _make_lab_command()
    command[command.index("--notebook-dir") + 1] = str(notebooks)  # make lab's, copied
    command += [
        "--no-browser",
        f"--port={port}",
        "--IdentityProvider.token=",  # loopback only, for this test's requests
        "--LabApp.expose_app_in_browser=True",  # to ask the page whether a notebook is modified
    ]
    env = os.environ | {  # no settings of this machine's user leak in
        "JUPYTER_CONFIG_DIR": str(tmp / "config"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp / "user-settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
    }
    server = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not answer within 90 s"
                time.sleep(0.5)
        yield url
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as reply:
        return reply.read().decode()


def test_make_lab_turns_off_the_news_toast(lab):
    settings = json.loads(_get(f"{lab}/lab/api/settings/{NEWS}"))
    # The frontend's value: the user's setting (none here) over the schema's default, which
    # overrides.json replaces.
    defaults = {k: v.get("default") for k, v in settings["schema"]["properties"].items()}
    effective = defaults | settings.get("settings", {})
    assert effective["fetchNews"] == "false"  # JupyterLab's own default, "none", asks
    assert effective["checkForUpdates"] is False


def test_make_lab_has_no_ipyparallel_cluster_panel(lab):
    """The page config the frontend boots from: ipyparallel's extension is installed (it comes
    with ipyparallel) and disabled, so JupyterLab does not load it."""
    page = _get(f"{lab}/lab")
    config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S)[1])
    installed = {e["name"] for e in config["federated_extensions"]}
    assert "ipyparallel-labextension" in installed
    assert "ipyparallel-labextension" in config["disabledExtensions"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_as_jupyterlab_saves_them(path):
    """Else a notebook is modified the moment it opens (python tools/normalize_notebooks.py)."""
    assert in_form(path.read_text(encoding="utf-8")), (
        f"run: python tools/normalize_notebooks.py {path}"
    )


def test_the_course_lab_gives_a_notebook_this_pythons_metadata(lab):
    model = json.loads(_get(f"{lab}/api/contents/other_python.ipynb?content=1"))
    assert model["content"]["metadata"] == kernel_metadata()  # not 3.11.0, what the file says


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("GAS_LAB_REQUIRE_BROWSER") == "1":
            pytest.fail("Chromium and chromedriver are required here (apt-get install chromium)")
        pytest.skip("no Chromium: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


_STATE = """
const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
const kernel = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
return kernel ? {status: kernel.status, dirty: w.context.model.dirty} : null;
"""


def test_a_notebook_opens_unmodified_in_the_course_lab(lab, browser):
    """Opened, its kernel started and idle (JupyterLab then writes the kernel's metadata), the
    notebook is not modified: closing it asks nothing. Written by a maintainer on another
    3.11.x, as a learner's copy of the course may be."""
    browser.get(f"{lab}/lab/tree/other_python.ipynb")
    deadline, state = time.monotonic() + 120, None
    while not (state and state["status"] == "idle") and time.monotonic() < deadline:
        time.sleep(0.5)
        state = browser.execute_script(_STATE)
    assert state and state["status"] == "idle", f"the kernel did not start: {state}"
    time.sleep(2)  # JupyterLab updates the metadata once the kernel has answered
    assert browser.execute_script(_STATE)["dirty"] is False
