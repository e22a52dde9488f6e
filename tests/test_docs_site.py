"""The built docs site, opened in a real headless Chromium: pages render, with their figures.

Runs after `make docs` (``pytest -m docs``). Without Chromium the test is skipped with a reason,
except where GAS_LAB_REQUIRE_BROWSER=1 (CI sets it), so CI can never pass by skipping.
"""

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "build" / "html"
SHOTS = ROOT / "build" / "screenshots"
pytestmark = pytest.mark.docs

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("GAS_LAB_REQUIRE_BROWSER") == "1":
            pytest.fail(
                "Chromium and chromedriver are required here (apt-get install chromium "
                "chromium-driver)"
            )
        pytest.skip("no Chromium: apt-get install chromium chromium-driver")
    assert (SITE / "index.html").exists(), "build the site first: make docs"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-sync",
        "--disable-component-update",
        "--window-size=1280,2000",
    ]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def _open(browser, page: str):
    browser.get((SITE / page).as_uri())
    return browser


def _loaded_images(browser) -> list[dict]:
    return browser.execute_script(
        "return Array.from(document.querySelectorAll('article img')).map(i => "
        "({src: i.src, w: i.naturalWidth, h: i.naturalHeight, done: i.complete}))"
    )


def test_index_lists_every_lesson(browser):
    _open(browser, "index.html").save_screenshot(str(SHOTS / "index.png"))
    links = browser.execute_script(
        "return Array.from(document.querySelectorAll('a')).map(a => a.getAttribute('href'))"
    )
    notebooks = sorted(p.stem for p in (ROOT / "tutorials").glob("[0-9][0-9]_*.ipynb"))
    assert notebooks, "no tutorials found"
    for nb in notebooks:
        assert any(h and h.endswith(f"lessons/{nb}.html") for h in links), f"{nb} not linked"


def test_executed_lesson_pages_show_outputs_and_figures(browser):
    _open(browser, "lessons/01_single_device.html").save_screenshot(str(SHOTS / "lesson01.png"))
    text = browser.find_element("tag name", "article").text
    assert "float32: max |accumulated - full|" in text  # a printed output, not just the code
    images = _loaded_images(browser)
    assert len(images) >= 2, f"expected the lesson's figures, found {len(images)}"
    broken = [i["src"] for i in images if not (i["done"] and i["w"] > 100 and i["h"] > 100)]
    assert broken == [], f"figures that did not render: {broken}"


def test_math_renders_without_internet(browser):
    """MathJax ships with the site (no CDN): formulas are typeset, not left as raw TeX."""
    from selenium.webdriver.support.ui import WebDriverWait

    _open(browser, "lessons/01_single_device.html")
    typeset = "return document.querySelectorAll('article .MathJax, article .MathJax_CHTML').length"
    WebDriverWait(browser, 30).until(lambda b: b.execute_script(typeset) > 0)
    assert "\\frac" not in browser.find_element("tag name", "article").text


def test_rules_page_has_the_generated_table(browser):
    _open(browser, "rules.html").save_screenshot(str(SHOTS / "rules.png"))
    from gas_lab.rules import refusals, traps

    refused, accepted_traps = browser.find_elements("css selector", "article table")
    assert len(refused.find_elements("css selector", "tbody tr")) == len(refusals.table())
    assert len(accepted_traps.find_elements("css selector", "tbody tr")) == len(traps.TRAPS)


def test_api_reference_is_generated_from_docstrings(browser):
    _open(browser, "api.html")
    text = browser.find_element("tag name", "article").text
    assert "start_cluster" in text and "initialize" in text
