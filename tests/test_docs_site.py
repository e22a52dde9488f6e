"""The built docs site, opened in a real headless Chromium the way a room of learners sees it.

Runs after `make docs` (``pytest -m docs``), or inside `make test`'s one pytest session, which
builds the site here once the notebooks have run (``GAS_LAB_BUILD_SITE=1``; tests/conftest.py
hands this file out last, so the other worker runs tests meanwhile). The site is served from
build/html on loopback;
the room has no internet, so any request that leaves loopback fails a test, as does any 404 or
console error. Each test asserts one thing a learner would see broken: math in fallback fonts,
a widget output left empty, a markdown table shown as raw ``|`` text, an output line hidden
behind a scrollbar, figure text too small to read, an orphan page in the search. Nothing is
written to the repository (no screenshots): the tests assert.

Without Chromium the tests are skipped with a reason, except where GAS_LAB_REQUIRE_BROWSER=1
(CI sets it), so CI can never pass by skipping.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "build" / "html"
EXECUTED = ROOT / "build" / "notebooks"  # nbmake's executed copies, which the site renders
NOTEBOOKS_WAIT_S = 900  # for the last notebooks to finish on the other test worker
pytestmark = pytest.mark.docs

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
LESSONS = sorted(p.stem for p in (ROOT / "tutorials").glob("[0-9][0-9]_*.ipynb"))
DESKTOP, PHONE = (1366, 900), (412, 915)  # a laptop on a projector, and a phone
MIN_FIGURE_PT = 9.0  # smallest figure text, in points at the size the page displays it
PAGE_ASSETS_BUDGET = 1_600_000  # bytes a page may load besides its own figures


# ---------------------------------------------------------------- serving and visiting
def _build_site() -> None:
    """Inside `make test`: wait until nbmake has written every executed copy (a copy still equal
    to its tutorials/ source has not run yet), then build the site from them (`make docs`)."""
    sources = {p.name: p.read_bytes() for p in (ROOT / "tutorials").glob("*.ipynb")}
    deadline = time.monotonic() + NOTEBOOKS_WAIT_S
    while waiting := [n for n, text in sources.items() if (EXECUTED / n).read_bytes() == text]:
        assert time.monotonic() < deadline, f"not executed after {NOTEBOOKS_WAIT_S} s: {waiting}"
        time.sleep(2)
    built = subprocess.run(
        ["make", "--no-print-directory", "docs"], cwd=ROOT, capture_output=True, text=True
    )
    assert built.returncode == 0, f"make docs failed:\n{built.stdout[-3000:]}{built.stderr[-3000:]}"


@pytest.fixture(scope="module")
def site():
    """build/html over HTTP on 127.0.0.1, as `python -m http.server` would serve it."""
    if os.environ.get("GAS_LAB_BUILD_SITE") == "1":
        _build_site()
    assert (SITE / "index.html").exists(), "build the site first: make docs"

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest's output for failures
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(SITE))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("GAS_LAB_REQUIRE_BROWSER") == "1":
            pytest.fail(
                "Chromium and chromedriver are required here (apt-get install chromium "
                "chromium-driver)"
            )
        pytest.skip("no Chromium: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [
        "--headless",
        "--no-sandbox",  # Chromium refuses to run as root (CI) without it
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",  # no requests of Chromium's own to tell apart
        "--disable-sync",
        "--disable-component-update",
        f"--window-size={DESKTOP[0]},{DESKTOP[1]}",
    ]:
        options.add_argument(flag)
    # The performance log carries every network request and response (the DevTools protocol);
    # the browser log carries the console.
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


@dataclass
class Visit:
    """What one page load asked the network for, and what went wrong on the way."""

    page: str
    requests: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # non-loopback, 4xx/5xx, console errors
    bytes_by_url: dict[str, int] = field(default_factory=dict)
    found: dict = field(default_factory=dict)  # what each test asked of the page (PAGE_QUERIES)


def _wait_for_math(browser) -> None:
    """Return once MathJax (if the page loads it) has typeset everything it will."""
    browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "if (!document.querySelector('script[src*=\"MathJax.js\"]')) { done(false); return; }"
        "const wait = () => (window.MathJax && MathJax.Hub && MathJax.isReady)"
        "  ? MathJax.Hub.Queue(() => done(true)) : setTimeout(wait, 50);"
        "wait();"
    )


def _network_settled(browser, timeout: float = 10.0) -> list[dict]:
    """The page's network events, read once the web fonts are in and every request the page
    started has finished or failed (late ones, such as fonts and deferred scripts, included),
    instead of waiting a fixed time on every page."""
    browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "document.fonts.ready.then(() => requestAnimationFrame(() => done()));"
    )
    messages, pending = [], set()
    deadline = time.monotonic() + timeout
    while True:
        for entry in browser.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            messages.append(message)
            request = message.get("params", {}).get("requestId")
            if message["method"] == "Network.requestWillBeSent":
                pending.add(request)
            elif message["method"] in ("Network.loadingFinished", "Network.loadingFailed"):
                pending.discard(request)
        if not pending:
            return messages
        assert time.monotonic() < deadline, f"requests still loading after {timeout} s"
        time.sleep(0.02)


def visit(browser, site: str, page: str, size: tuple[int, int] = DESKTOP) -> Visit:
    browser.get_log("performance"), browser.get_log("browser")  # drop the previous page's
    browser.set_window_size(*size)
    browser.get(site + page)
    _wait_for_math(browser)
    seen = Visit(page)
    urls = {}
    for message in _network_settled(browser):
        method, params = message["method"], message.get("params", {})
        if method == "Network.requestWillBeSent":
            url = params["request"]["url"]
            urls[params["requestId"]] = url
            seen.requests.append(url)
            if not (url.startswith(site) or url.startswith("data:")):
                seen.problems.append(f"request leaves loopback: {url}")
        elif method == "Network.responseReceived":
            status, url = params["response"]["status"], params["response"]["url"]
            if status >= 400:
                seen.problems.append(f"HTTP {status}: {url}")
        elif method == "Network.loadingFailed":
            url = urls.get(params["requestId"], "?")
            seen.problems.append(f"failed to load ({params.get('errorText')}): {url}")
        elif method == "Network.loadingFinished":
            url = urls.get(params["requestId"], "?")
            seen.bytes_by_url[url] = int(params.get("encodedDataLength", 0))
    for entry in browser.get_log("browser"):
        if entry["level"] == "SEVERE":
            seen.problems.append(f"console: {entry['message'][:300]}")
    return seen


def _pages() -> list[str]:
    """Every page a learner can reach, the highlighted module sources (_modules/) included."""
    pages = []
    for path in SITE.rglob("*.html"):
        rel = path.relative_to(SITE)
        if rel.parts[0] == "_modules" or not rel.parts[0].startswith("_"):
            pages.append(rel.as_posix())
    return sorted(pages)


def _lesson(nb: str) -> str:
    return f"lessons/{nb}.html"


# What the tests below ask of a lesson page (and of the rules page), asked during the one visit
# each page gets at laptop size (the `pages` fixture): loading a lesson page, MathJax included, is
# most of the time a question takes, and seven tests ask about the same pages.
PAGE_QUERIES = {
    "empty_outputs": (
        "return Array.from(document.querySelectorAll('article .cell_output')).map(o => {"
        "  const shown = o.innerText.trim().length > 0 || o.querySelector('img, svg');"
        "  const widget = o.querySelector("
        "    'script[type=\"application/vnd.jupyter.widget-view+json\"]');"
        "  return (shown && !widget) ? null"
        "    : (o.closest('.cell').querySelector('.cell_input') || o).innerText.slice(0, 80);"
        "}).filter(x => x !== null)"
    ),
    "raw_tables": (
        "return Array.from(document.querySelectorAll('article p, article li, article td'))"
        "  .map(e => e.innerText).filter(t => /\\|\\s*-{3,}\\s*\\|/.test(t)"
        "    || /^\\s*\\|.*\\|\\s*$/m.test(t)).map(t => t.slice(0, 80))"
    ),
    "table_cells": (
        "return Array.from(document.querySelectorAll('article td')).map(td => td.innerText)"
    ),
    "wide_tables": (
        "return Array.from(document.querySelectorAll('article table')).filter(t => {"
        "  const box = t.closest('article').getBoundingClientRect();"
        "  return t.getBoundingClientRect().right > box.right + 1"
        "    || t.scrollWidth > t.clientWidth + 1"
        "    || (t.parentElement.scrollWidth > t.parentElement.clientWidth + 1);"
        "}).map(t => Math.round(t.scrollWidth))"
    ),
    "output_blocks": (
        "const canvas = document.createElement('canvas').getContext('2d');"
        "return Array.from(document.querySelectorAll('article .cell_output pre')).map(p => {"
        "  const cs = getComputedStyle(p); canvas.font = cs.font;"
        "  const box = p.clientWidth - parseFloat(cs.paddingLeft)"
        "    - parseFloat(cs.paddingRight);"
        "  return {box: box, scrolls: p.scrollWidth > p.clientWidth + 1,"
        "          lines: p.innerText.split('\\n').map(l => [l, canvas.measureText(l).width])};"
        "})"
    ),
}
MATH_QUERY = (
    "const jax = MathJax.OutputJax['HTML-CSS'];"
    "return {font: jax && jax.fontInUse, log: MathJax.Message.Log(),"
    " errors: document.querySelectorAll('.MathJax_Error, merror, .merror').length,"
    " typeset: document.querySelectorAll('article .MathJax').length,"
    " faces: Array.from(document.fonts).filter(f => /MathJax/.test(f.family))"
    "   .map(f => f.family + ':' + f.status)}"
)
FIGURES_QUERY = (
    "const done = arguments[arguments.length - 1];"
    "const sizes = svg => Array.from(svg.querySelectorAll('text')).map(t => {"
    "  const m = t.getScreenCTM(); const s = Math.hypot(m.a, m.b);"
    "  return [t.textContent.slice(0, 30), parseFloat(getComputedStyle(t).fontSize) * s];"
    "});"
    "const measure = async el => {"
    "  if (el.tagName.toLowerCase() === 'svg') return {src: 'inline', texts: sizes(el)};"
    "  if (!/\\.svg$/.test(new URL(el.src).pathname)) return {src: el.src, texts: null};"
    "  const box = document.createElement('div');"
    "  box.style.cssText = 'position:absolute;left:0;top:0;visibility:hidden;width:'"
    "    + el.getBoundingClientRect().width + 'px';"
    "  box.innerHTML = await (await fetch(el.src)).text();"
    "  document.body.appendChild(box);"
    "  const svg = box.querySelector('svg');"
    "  svg.setAttribute('width', '100%'); svg.removeAttribute('height');"
    "  const result = {src: el.src, texts: sizes(svg)}; box.remove(); return result;"
    "};"
    "const figs = Array.from(document.querySelectorAll("
    "  'article .cell_output img, article .cell_output svg:not(svg svg)'));"
    "Promise.all(figs.map(measure)).then(done);"
)


def _pages_with_math() -> list[str]:
    return [
        _lesson(nb)
        for nb in LESSONS
        if 'class="math' in (SITE / _lesson(nb)).read_text(encoding="utf-8")
    ]


@pytest.fixture(scope="module")
def pages(browser, site) -> dict[str, Visit]:
    """Every page, visited once at laptop size; on the lesson pages and the rules page the
    tests' questions (PAGE_QUERIES, and MATH_QUERY where MathJax typesets) are asked in the same
    visit."""
    asked = {*map(_lesson, LESSONS), "rules.html"}
    with_math = set(_pages_with_math())
    out = {}
    for page in _pages():
        seen = visit(browser, site, page)
        if page in asked:
            seen.found = {name: browser.execute_script(js) for name, js in PAGE_QUERIES.items()}
            if page in with_math:
                seen.found["math"] = browser.execute_script(MATH_QUERY)
                seen.found["text"] = browser.find_element("tag name", "article").text
            seen.found["figures"] = browser.execute_async_script(FIGURES_QUERY)  # adds, removes
        out[page] = seen
    return out


# ---------------------------------------------------------------- the whole site
def test_index_lists_every_lesson(browser, site):
    visit(browser, site, "index.html")
    links = browser.execute_script(
        "return Array.from(document.querySelectorAll('a')).map(a => a.getAttribute('href'))"
    )
    assert LESSONS, "no tutorials found"
    for nb in LESSONS:
        assert any(h and h.endswith(f"lessons/{nb}.html") for h in links), f"{nb} not linked"


def test_every_page_loads_from_loopback_only_without_errors(pages):
    """Offline room: every asset ships with the site, nothing 404s, the console stays clean."""
    problems = {}
    for page, seen in pages.items():
        if seen.problems:
            problems[page] = seen.problems
    assert problems == {}, json.dumps(problems, indent=1)


def test_pages_carry_only_the_assets_they_use(pages):
    heaviest = {}
    for page in ["index.html", *map(_lesson, LESSONS)]:
        seen = pages[page]
        assert not any("fontawesome.js" in u for u in seen.requests), (
            f"{page} loads fontawesome.js (1.5 MB): the theme's icons come from its CSS font"
        )
        assets = sum(n for u, n in seen.bytes_by_url.items() if "/_images/" not in u)
        heaviest[page] = assets
    worst = max(heaviest, key=heaviest.get)
    assert heaviest[worst] <= PAGE_ASSETS_BUDGET, f"{worst} loads {heaviest[worst]:,} bytes"


def test_search_index_has_no_orphan_pages(browser, site):
    """Every page the search can find is reachable from the navigation, and has a title."""
    visit(browser, site, "search.html")
    index = browser.execute_script("return Search._index")
    nav = browser.execute_script(
        "return Array.from(document.querySelectorAll('.bd-sidebar-primary a'))"
        ".map(a => new URL(a.href).pathname)"
    )
    reachable = {p.rstrip("/").removeprefix("/").removesuffix(".html") for p in nav}
    reachable.add("index")
    bad = [
        f"{doc} ({title})"
        for doc, title in zip(index["docnames"], index["titles"], strict=True)
        if doc not in reachable or title.strip() in ("", "<no title>")
    ]
    assert bad == [], f"in the search index but not in the navigation, or untitled: {bad}"


# ---------------------------------------------------------------- math
def test_math_is_typeset_in_mathjax_fonts_offline(pages):
    """MathJax ships with the site and finds its own web fonts: no 404, no fallback fonts."""
    with_math = _pages_with_math()
    assert with_math, "no lesson page has math: did the notebooks lose their formulas?"
    for page in with_math:
        seen = pages[page]
        assert not [p for p in seen.problems if "MathJax" in p or "/jax/" in p], seen.problems
        state = seen.found["math"]
        assert state["typeset"] > 0, f"{page}: no formula typeset"
        assert state["errors"] == 0, f"{page}: MathJax errors"
        assert state["font"] not in (None, "generic", "image"), f"{page}: fallback {state}"
        # MathJax_Blank is MathJax's reference font, defined never to load (docs/conf.py).
        faces = [f for f in state["faces"] if not f.startswith("MathJax_Blank:")]
        loaded = [f for f in faces if f.endswith(":loaded")]
        failed = [f for f in faces if f.endswith(":error")]
        assert loaded and not failed, f"{page}: MathJax web fonts {state['faces']}"
        assert not re.search(r"fail|error|can't", state["log"], re.I), state["log"]
        text = seen.found["text"]
        assert "\\frac" not in text and "$$" not in text, f"{page}: raw TeX left"


def test_displayed_equations_are_not_cut_on_a_phone(browser, site):
    """A displayed equation fits its box, or its box scrolls to show the rest: never clipped."""
    for page in _pages_with_math():
        visit(browser, site, page, size=PHONE)
        cut = browser.execute_script(
            "return Array.from(document.querySelectorAll('article div.math')).filter(math => {"
            "  const box = math.querySelector('.MathJax_Display') || math;"
            "  const parts = Array.from(box.querySelectorAll('.MathJax nobr *'))"  # not the
            "    .map(e => e.getBoundingClientRect()).filter(r => r.width > 0);"  # hidden MathML
            "  if (!parts.length) return true;"
            "  const b = box.getBoundingClientRect();"
            "  const right = Math.max(...parts.map(r => r.right)) - b.left;"
            "  const scrolls = /auto|scroll/.test(getComputedStyle(box).overflowX);"
            "  return right > b.width + 1 && !(scrolls && box.scrollWidth + 1 >= right);"
            "}).map(math => math.textContent.trim().slice(0, 60))"
        )
        assert cut == [], f"{page}: equations cut at {PHONE[0]} px: {cut}"


# ---------------------------------------------------------------- lesson outputs
def test_executed_lesson_pages_show_outputs_and_figures(browser, site):
    visit(browser, site, _lesson("01_single_device"))
    text = browser.find_element("tag name", "article").text
    assert "float32: max |accumulated - full|" in text  # a printed output, not just the code
    images = browser.execute_script(
        "return Array.from(document.querySelectorAll('article .cell_output img, "
        "article .cell_output svg')).map(i => ({src: i.src || 'inline svg', "
        "w: i.getBoundingClientRect().width, h: i.getBoundingClientRect().height, "
        "done: i.complete !== false}))"
    )
    assert len(images) >= 2, f"expected the lesson's figures, found {len(images)}"
    broken = [i["src"] for i in images if not (i["done"] and i["w"] > 100 and i["h"] > 100)]
    assert broken == [], f"figures that did not render: {broken}"


def test_no_output_is_left_empty(pages):
    """A widget output the site cannot run must still show something (a figure, a note)."""
    empty = {}
    for nb in LESSONS:
        found = pages[_lesson(nb)].found["empty_outputs"]
        if found:
            empty[nb] = found
    assert empty == {}, f"outputs that show nothing on the page (cell source): {empty}"


def test_progress_bar_shows_its_final_state(browser, site):
    visit(browser, site, _lesson("07_capstone"))
    text = browser.find_element("tag name", "article").text
    assert re.search(r"100%\|.*\| 40/40", text), "lesson 07's progress bar is not on the page"


def test_markdown_outputs_render_as_tables(pages):
    """`display(Markdown(table))` and the rules page: tables, not pipe-separated text."""
    raw = {}
    for page in [*map(_lesson, LESSONS), "rules.html"]:
        found = pages[page].found["raw_tables"]
        if found:
            raw[page] = found
    assert raw == {}, f"raw markdown tables: {raw}"


def test_trap_tables_keep_their_text_and_fit(pages):
    """The traps table, on the rules page and in lesson 06: every word of the columns each
    shows (an asterisk is a multiplication, not italics), and every column visible at 1366 px."""
    from gas_lab.rules import traps

    # The rules page shows every column; lesson 06 leaves out the condition (its prose gives it).
    shown = {"rules.html": ("name", "condition", "symptom", "fix"),
             _lesson("06_rejected_combinations"): ("name", "symptom", "fix")}  # fmt: skip
    for page, fields in shown.items():
        cells = " ".join(pages[page].found["table_cells"])
        for trap in traps.TRAPS:
            for text in (getattr(trap, name) for name in fields):
                assert " ".join(text.split()) in " ".join(cells.split()), (
                    f"{page}: {text!r} is not in a table cell as written"
                )
        wide = pages[page].found["wide_tables"]
        assert wide == [], f"{page}: tables wider than the page: {wide} px"


def test_rules_page_has_the_generated_table(browser, site):
    visit(browser, site, "rules.html")
    from gas_lab.rules import refusals, traps

    refused, accepted_traps = browser.find_elements("css selector", "article table")
    assert len(refused.find_elements("css selector", "tbody tr")) == len(refusals.table())
    assert len(accepted_traps.find_elements("css selector", "tbody tr")) == len(traps.TRAPS)


# A columnar line: fields separated by 2+ spaces or " | " after its indentation.
_COLUMNS = re.compile(r"\S( {2,}| \| )\S")


def test_output_lines_fit_their_box_on_a_laptop(pages):
    """At 1366 px no output hides behind a horizontal scrollbar, and no line of a table (a line
    with aligned columns in a block of such lines, source code included) is wider than its box:
    prose may wrap, columns may not."""
    too_wide = {}
    for nb in LESSONS:
        for block in pages[_lesson(nb)].found["output_blocks"]:
            columnar = [bool(_COLUMNS.search(line.strip())) for line, _ in block["lines"]]
            table = sum(columnar) >= 2
            over = [
                f"{len(line)} chars: {line[:90]}"
                for (line, width), col in zip(block["lines"], columnar, strict=True)
                if table and col and width > block["box"] + 1
            ]
            if block["scrolls"]:
                over.append(f"scrolls: {block['lines'][0][0][:90]}")
            if over:
                too_wide.setdefault(nb, []).extend(over)
    assert too_wide == {}, json.dumps(too_wide, indent=1)


def test_figure_text_is_readable_at_display_size(pages):
    """Every figure's smallest text is >= MIN_FIGURE_PT at the size the page shows it.

    Figures are SVG with live text, so the browser measures each label as displayed: font
    size times the scale the page draws the figure at. A PNG cannot be measured: it fails.
    """
    small = {}
    for nb in LESSONS:
        figures = pages[_lesson(nb)].found["figures"]
        for fig in figures:
            name = fig["src"].rsplit("/", 1)[-1][:16]
            if not fig["texts"]:  # a PNG, or an SVG with its text drawn as paths
                small.setdefault(nb, []).append(f"{name}: no live text to measure (PNG?)")
                continue
            px_min = MIN_FIGURE_PT * 96 / 72
            tiny = sorted({f"{t!r} {px * 72 / 96:.1f} pt" for t, px in fig["texts"] if px < px_min})
            if tiny:
                small.setdefault(nb, []).append(f"{name}: {tiny[:4]}")
    assert small == {}, json.dumps(small, indent=1)


# ---------------------------------------------------------------- reference
def test_api_reference_is_generated_from_docstrings(browser, site):
    visit(browser, site, "api.html")
    text = browser.find_element("tag name", "article").text
    assert "start_cluster" in text and "initialize" in text
    assert "Should be overridden by all subclasses" not in text  # torch's, not ours


def test_the_site_sets_a_valid_first_color_mode():
    """pydata-sphinx-theme's script calls setTheme() with the page's data-mode, which a first
    visit (nothing in localStorage yet) takes from html_context["default_mode"]: unset, it is
    empty and the lesson 00 page logged "Got invalid theme mode" in the console."""
    import runpy

    conf = runpy.run_path(str(Path(__file__).resolve().parents[1] / "docs" / "conf.py"))
    assert conf["html_context"]["default_mode"] in ("auto", "light", "dark")


def test_a_first_visit_logs_no_console_error(browser, site):
    """The first page a new reader opens, with nothing stored by the theme yet."""
    visit(browser, site, "index.html")
    browser.execute_script("window.localStorage.clear()")
    seen = visit(browser, site, _lesson("00_setup"))
    assert seen.problems == [], seen.problems
