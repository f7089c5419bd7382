"""The built site as a reader meets it, in headless Chromium with the network blocked.

Every request that leaves 127.0.0.1 is aborted and fails the test: the site must work offline
(math, figures and explorers). On every page the table of contents lists: no console errors,
every image loads, figures show at (nearly) their natural size at a 1280 px viewport, no code
block overflows sideways, math is typeset, and every explorer switches to the precomputed frame
of each setting of its controls within its size budget. Launch buttons and search work.

The site is `_build/html` (`make book`); set INFRA_LAB_SITE to test another build, e.g. one
made in a scratch copy. Its pages are taken from the `_toc.yml` beside that build.
"""
import functools
import http.server
import os
import shutil
import threading
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from _words import INTERNAL, VERDICT_WORDS

pytestmark = pytest.mark.site
ROOT = Path(__file__).resolve().parent.parent
SITE = Path(os.environ.get("INFRA_LAB_SITE") or ROOT / "_build" / "html").resolve()
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-quic"]
VIEWPORT = {"width": 1280, "height": 900}
MIN_SHOWN_SHARE = 0.6          # a figure shows at no less than 60% of its natural width
EXPLORER_BYTES = 2_100_000     # one explorer's frames, as stored in the page
PAGE_BYTES = 1_000_000         # a page's HTML besides its explorers' frames
SVG_DATA = "data:image/svg+xml;charset=utf-8,"


def toc_pages(toc: Path) -> list[str]:
    """The pages `toc` lists, root first, as paths of the built site ("book/ch00_stack.html")."""
    def files(entry):
        if isinstance(entry, dict):
            if "file" in entry:
                yield entry["file"]
            for key in ("parts", "chapters", "sections"):
                for child in entry.get(key, []):
                    yield from files(child)
    data = yaml.safe_load(toc.read_text(encoding="utf-8"))
    names = [data["root"], *files(data)]
    return [f"{Path(name).with_suffix('').as_posix()}.html" for name in dict.fromkeys(names)]


TOC = SITE.parent.parent / "_toc.yml"
TOC_PAGES = toc_pages(TOC if TOC.is_file() else ROOT / "_toc.yml")
CHAPTERS = [page for page in TOC_PAGES if Path(page).name.startswith("ch")]
PAGES = [*TOC_PAGES, "genindex.html", "search.html"]


@pytest.fixture(scope="module")
def site_url():
    if not (SITE / "index.html").is_file():
        pytest.fail(f"no built site in {SITE}: run `make book` first")
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("Debian's chromium is not installed: `make test` installs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Visit:
    """One page opened with the network blocked: what it asked for and what it logged."""

    def __init__(self, browser, url, viewport=VIEWPORT):
        self.page = browser.new_page(viewport=viewport)
        self.errors, self.external = [], []
        self.page.route("**/*", self._route)
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(
            f"{m.text} ({m.location.get('url', '')}:{m.location.get('lineNumber', '')})"))
        self.page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        response = self.page.goto(url, wait_until="load")
        assert response is not None and response.ok, url
        # MathJax typesets after load; wait for it where the page loads it.
        self.page.evaluate("async () => { const s = window.MathJax && MathJax.startup;"
                           " if (s && s.promise) await s.promise; }")
        self.page.wait_for_timeout(200)

    def _route(self, route):
        url = urlparse(route.request.url)
        if url.scheme in ("data", "blob") or url.hostname == "127.0.0.1":
            route.continue_()
        else:
            self.external.append(route.request.url)
            route.abort()


def visitor(browser, site_url, viewport):
    """visit(page) -> Visit, each page opened once per module (the checks only read it)."""
    visits = {}

    def open_once(relative):
        if relative not in visits:
            if not (SITE / relative).is_file():
                pytest.fail(f"{relative} is in the table of contents but not in {SITE}")
            visits[relative] = Visit(browser, f"{site_url}/{relative}", viewport)
        return visits[relative]

    return open_once, visits


@pytest.fixture(scope="module")
def visit(browser, site_url):
    open_once, visits = visitor(browser, site_url, VIEWPORT)
    yield open_once
    for one in visits.values():
        one.page.close()


def test_the_site_has_every_page_of_the_toc_and_no_other():
    built = {p.relative_to(SITE).as_posix() for p in SITE.rglob("*.html")
             if "_static" not in p.parts and "_sources" not in p.parts}
    built.discard("index.html")  # the redirect to the root page
    assert set(PAGES) == built, (sorted(set(PAGES) - built), sorted(built - set(PAGES)))
    assert "book/ch00_stack.html" in CHAPTERS


def test_no_page_shows_quick_sizes():
    """A run with INFRA_LAB_QUICK (infra_lab.sizes) says so on its first line; the page is the
    full-size run, so no built page carries that line."""
    from infra_lab import sizes

    quick = [p.relative_to(SITE).as_posix() for p in SITE.rglob("*.html")
             if f"quick sizes ({sizes.ENVIRONMENT})" in p.read_text(encoding="utf-8")]
    assert quick == [], f"built with {sizes.ENVIRONMENT} set: {quick}"


@pytest.mark.parametrize("relative", PAGES)
def test_page_loads_offline_without_console_errors(visit, relative):
    page = visit(relative)
    assert page.external == [], f"{relative} asked another host at page load: {page.external}"
    assert page.errors == [], f"{relative} logged console errors: {page.errors}"


def test_index_redirects_to_the_root_page_offline(browser, site_url):
    page = browser.new_page(viewport=VIEWPORT)
    external = []
    page.route("**/*", lambda route: route.continue_()
               if urlparse(route.request.url).hostname == "127.0.0.1"
               else (external.append(route.request.url), route.abort()))
    page.goto(f"{site_url}/index.html")
    page.wait_for_url(f"**/{TOC_PAGES[0]}", timeout=10000)
    assert external == [], external
    page.close()


IMAGES = """async () => {
  for (const d of document.querySelectorAll("details")) d.open = true;
  const images = Array.from(document.querySelectorAll("img"));
  for (const i of images) i.loading = "eager";
  await Promise.all(images.map(i => i.decode().catch(() => null)));
  return images.map(i => {
    const box = i.getBoundingClientRect();
    return {src: (i.getAttribute("src") || "").slice(0, 100), complete: i.complete,
            natural: i.naturalWidth, shown: box.width, width: i.getAttribute("width"),
            figure: !!i.closest("article")};
  });
}"""


@pytest.mark.parametrize("relative", TOC_PAGES)
def test_every_image_loads(visit, relative):
    images = visit(relative).page.evaluate(IMAGES)
    broken = [i["src"] for i in images if not (i["complete"] and i["natural"] > 0)]
    assert broken == [], f"{relative}: images that did not load: {broken}"


@pytest.mark.parametrize("relative", TOC_PAGES)
def test_figures_show_at_their_natural_width(visit, relative):
    """A figure wider than the text column is scaled down and its labels shrink below 9 pt."""
    small = []
    for image in visit(relative).page.evaluate(IMAGES):
        # an explicit width attribute (a 2x PNG shown at half size) is the size meant
        meant = float(image["width"]) if (image["width"] or "").isdigit() else image["natural"]
        if image["figure"] and image["shown"] > 0 and meant > 0:
            if image["shown"] < MIN_SHOWN_SHARE * meant:
                small.append(f"{image['src']}: {image['shown']:.0f} px of {meant:.0f}")
    assert small == [], (f"{relative}: figures shown below {MIN_SHOWN_SHARE:.0%} of their "
                         f"natural width at {VIEWPORT['width']} px: {small}")


OVERFLOW = """() => {
  for (const d of document.querySelectorAll("details")) d.open = true;
  return Array.from(document.querySelectorAll("pre, .infra-lab-source"))
    .filter(e => e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1)
    .map(e => ({what: e.tagName.toLowerCase() + (e.closest(".cell_output") ? " (output)" : ""),
                scroll: e.scrollWidth, client: e.clientWidth,
                text: e.textContent.split("\\n").reduce((a, b) => a.length >= b.length ? a : b)
                        .trim().slice(0, 90)}));
}"""


@pytest.mark.parametrize("relative", TOC_PAGES)
def test_no_code_block_overflows_sideways(visit, relative):
    wide = visit(relative).page.evaluate(OVERFLOW)
    assert wide == [], (f"{relative}: code blocks wider than the column at "
                        f"{VIEWPORT['width']} px (element, content px, shown px, longest line): "
                        + "; ".join(f"{w['what']} {w['scroll']}>{w['client']} {w['text']!r}"
                                    for w in wide))


MATH = """() => {
  const math = Array.from(document.querySelectorAll(".math"));
  return {count: math.length,
          typeset: math.filter(m => m.querySelector("mjx-container svg")).length,
          errors: Array.from(document.querySelectorAll("mjx-merror, [data-mjx-error]"))
                    .map(e => e.getAttribute("data-mjx-error") || e.textContent).slice(0, 5),
          raw: math.filter(m => !m.querySelector("mjx-container"))
                   .map(m => m.textContent.slice(0, 60)).slice(0, 5)};
}"""


@pytest.mark.parametrize("relative", TOC_PAGES)
def test_math_is_typeset_offline(visit, relative):
    math = visit(relative).page.evaluate(MATH)
    assert math["typeset"] == math["count"], f"{relative}: math left as TeX: {math['raw']}"
    assert math["errors"] == [], f"{relative}: MathJax errors: {math['errors']}"
    if relative == "book/ch00_stack.html":
        assert math["count"] > 0, "chapter 00 has math: the check would prove nothing"


GAPS = """() => {
  const shows = e => e.innerText.trim() !== "" || e.querySelector("img, svg, iframe, video");
  const outputs = Array.from(document.querySelectorAll("div.cell_output"));
  const bars = document.body.innerText.match(/\\d+%\\|[^\\n]*\\| *\\d+\\/\\d+ \\[/g) || [];
  return {empty: outputs.filter(e => !shows(e)).length, bars: bars.slice(0, 3)};
}"""


@pytest.mark.parametrize("relative", TOC_PAGES)
def test_no_progress_bar_or_empty_output(visit, relative):
    """A progress bar or a widget with no static face shows nothing useful on a page without a
    kernel: its text stand-in ("measuring: 0%|") or an empty output box."""
    gaps = visit(relative).page.evaluate(GAPS)
    assert gaps == {"empty": 0, "bars": []}, f"{relative}: {gaps}"


EXPLORERS = """() => {
  const prefix = %r;
  const plain = svg => svg.replace(/<metadata>[\\s\\S]*?<\\/metadata>/, "")
                          .replace(/\\b[pm][0-9a-f]{8,}\\b/g, "id");
  return Array.from(document.querySelectorAll(".infra-lab-explorer")).map(root => {
    const store = root.querySelector("script.infra-lab-explorer-frames");
    const text = store ? store.textContent : "{}";
    const frames = JSON.parse(text);
    const image = root.querySelector("img.infra-lab-explorer-frame");
    const controls = Array.from(root.querySelectorAll("[data-axis]"));
    const problems = [];
    const shown = () => image.src.startsWith(prefix)
      ? decodeURIComponent(image.src.slice(prefix.length)) : null;
    const check = (what, previous) => {
      const key = controls.map(c => c.value).join(",");
      if (image.dataset.key !== key)
        problems.push(`${what}: shows ${image.dataset.key}, not ${key}`);
      else if (!(key in frames)) problems.push(`${what}: no frame stored under ${key}`);
      else if (shown() !== frames[key]) problems.push(`${what}: the image is not frame ${key}`);
      else if (previous !== null && plain(frames[key]) === plain(previous))
        problems.push(`${what}: frame ${key} looks like the one before it`);
      for (const c of controls) {
        if (c.type !== "range") continue;
        const label = JSON.parse(c.dataset.labels)[c.value];
        const output = c.parentElement.querySelector("output");
        const reads = output && output.textContent;
        if (reads !== label) problems.push(`${what}: ${c.dataset.axis} reads ${reads}, not ${label}`);
      }
    };
    if (!image) problems.push("no frame image");
    if (controls.length === 0) problems.push("no controls");
    if (image && controls.length) {
      check("as built", null);
      for (const c of controls) {
        const count = c.type === "range" ? Number(c.max) + 1 : c.options.length;
        const start = Number(c.value);
        for (let step = 1; step <= count; step++) {  // every option, ending where it started
          const previous = shown();
          const value = String((start + step) %% count);
          if (c.type === "range") c.value = value;
          else c.selectedIndex = Number(value);
          c.dispatchEvent(new Event(c.type === "range" ? "input" : "change", {bubbles: true}));
          if (count > 1) check(`${c.dataset.axis} = option ${value}`, previous);
        }
      }
    }
    return {id: root.id, bytes: new TextEncoder().encode(text).length,
            frames: Object.keys(frames).length, axes: controls.map(c => c.dataset.axis),
            problems: problems.slice(0, 8)};
  });
}""" % SVG_DATA


@pytest.mark.parametrize("relative", CHAPTERS)
def test_explorers_switch_to_the_precomputed_frames(visit, relative):
    page = visit(relative)
    explorers = page.page.evaluate(EXPLORERS)
    assert explorers, f"{relative} has no explorer"
    for explorer in explorers:
        assert explorer["frames"] >= 2, f"{relative}: {explorer}"
        assert explorer["problems"] == [], f"{relative}: explorer over {explorer['axes']}: " \
                                           f"{explorer['problems']}"
        assert explorer["bytes"] <= EXPLORER_BYTES, (
            f"{relative}: an explorer over {explorer['axes']} stores {explorer['bytes']:,} bytes "
            f"of frames; at most {EXPLORER_BYTES:,}")
    size = (SITE / relative).stat().st_size
    rest = size - sum(explorer["bytes"] for explorer in explorers)
    assert rest <= PAGE_BYTES, (f"{relative} is {size:,} bytes, {rest:,} besides "
                                f"its explorers' frames; at most {PAGE_BYTES:,}")


@pytest.mark.parametrize("relative", CHAPTERS)
def test_every_chapter_has_figures_source_and_an_explorer(visit, relative):
    page = visit(relative).page
    widths = page.eval_on_selector_all("article img", "imgs => imgs.map(i => i.naturalWidth)")
    assert len([w for w in widths if w > 100]) >= 2, widths
    assert page.locator(".infra-lab-source").count() >= 2
    text = page.inner_text("body")
    assert "Explorer." in text and "infra_lab backend:" in text


def test_chapter_00_shows_its_source_listings(visit):
    page = visit("book/ch00_stack.html").page
    assert page.locator(".infra-lab-source").count() >= 4
    assert "infra_lab/backend.py, lines" in page.inner_text("body")


def test_no_widget_state_or_widget_renderer_is_shipped(visit):
    for relative in CHAPTERS:
        html = visit(relative).page.content()
        for needle in ("application/vnd.jupyter.widget-state+json", "embed-amd.js",
                       "require.min.js"):
            assert needle not in html, f"{relative} still ships {needle}"


# The repository the launch links open: _config.yml's repository.url (a GitHub URL) and branch
# (main unless it says otherwise), and its launch hosts; from the _config.yml beside the build.
CONFIG = yaml.safe_load(((SITE.parent.parent if TOC.is_file() else ROOT) / "_config.yml")
                        .read_text(encoding="utf-8"))
REPOSITORY = CONFIG["repository"]["url"].rstrip("/")
GITHUB = urlparse(REPOSITORY).path.strip("/")  # owner/repo
BRANCH = CONFIG["repository"].get("branch") or "main"
COLAB = (CONFIG.get("launch_buttons") or {}).get("colab_url", "https://colab.research.google.com").rstrip("/")
BINDERHUB = (CONFIG.get("launch_buttons") or {}).get("binderhub_url", "https://mybinder.org").rstrip("/")
# the pages built from a notebook, which carry launch buttons: every page of the toc here
LAUNCHABLE = [page for page in TOC_PAGES
              if ((TOC.parent if TOC.is_file() else ROOT) / page).with_suffix(".ipynb").is_file()]
LAUNCH_BUTTONS = """() => Object.fromEntries(Array.from(
  document.querySelectorAll(".dropdown-launch-buttons a")).map(a => [a.textContent.trim(), a.href]))"""
EXERCISES_SENTENCE = """(notebook) => {
  const code = Array.from(document.querySelectorAll("main a code"))
    .find(c => c.textContent.trim() === notebook);
  return code ? Array.from(code.closest("p").querySelectorAll("a"))
    .map(a => [a.textContent.trim(), a.href]) : null;
}"""


def opens_on_binder(link: str, notebook: str) -> bool:
    """A Binder link that opens `notebook` of the configured repository and branch."""
    parts = urlparse(link)
    urlpath = parse_qs(parts.query).get("urlpath", [""])[0]
    return (f"{parts.scheme}://{parts.netloc}{parts.path}" == f"{BINDERHUB}/v2/gh/{GITHUB}/{BRANCH}"
            and urlpath in (f"tree/{notebook}", f"lab/tree/{notebook}"))


def test_launch_links_come_from_a_github_repository():
    assert urlparse(REPOSITORY).hostname == "github.com" and GITHUB.count("/") == 1, REPOSITORY
    assert "book/ch00_stack.html" in LAUNCHABLE and "book/appendix_numbers.html" in LAUNCHABLE


@pytest.mark.parametrize("relative", LAUNCHABLE)
def test_launch_buttons_open_the_pages_own_notebook(visit, relative):
    """Colab and Binder open this page's notebook from the configured repository and branch."""
    buttons = visit(relative).page.evaluate(LAUNCH_BUTTONS)
    notebook = Path(relative).with_suffix(".ipynb").as_posix()
    assert buttons.get("Colab") == f"{COLAB}/github/{GITHUB}/blob/{BRANCH}/{notebook}", buttons
    assert opens_on_binder(buttons.get("Binder", ""), notebook), buttons


@pytest.mark.parametrize("relative", CHAPTERS)
def test_launch_links_to_the_chapters_exercises_on_github(visit, relative):
    notebook = f"exercises/{Path(relative).stem}.ipynb"
    links = visit(relative).page.evaluate(EXERCISES_SENTENCE, notebook)
    assert links is not None, f"{relative}: no link to {notebook}"
    assert [notebook, f"{REPOSITORY}/blob/{BRANCH}/{notebook}"] in links, links


@pytest.mark.parametrize("relative", CHAPTERS)
def test_launch_links_open_the_chapters_exercises_in_colab_and_binder(visit, relative):
    """The learner opens the exercises notebook in one click (infra_lab.book.exercise_statements)."""
    notebook = f"exercises/{Path(relative).stem}.ipynb"
    links = dict(visit(relative).page.evaluate(EXERCISES_SENTENCE, notebook) or [])
    assert links.get("Colab") == f"{COLAB}/github/{GITHUB}/blob/{BRANCH}/{notebook}", links
    assert opens_on_binder(links.get("Binder", ""), notebook), links


def test_search_answers_offline(browser, site_url):
    page = Visit(browser, f"{site_url}/search.html?q=intensity")
    page.page.wait_for_selector("#search-results ul.search li", timeout=15000)
    hits = page.page.locator("#search-results ul.search li a").all_inner_texts()
    assert any("stack" in hit.lower() for hit in hits), hits
    assert page.errors == [] and page.external == [], (page.errors, page.external)
    page.page.close()


PROSE = """() => {
  const main = (document.querySelector("main") || document.body).cloneNode(true);
  main.querySelectorAll("pre, code, .highlight, script, style, mjx-container, svg")
      .forEach(e => e.remove());
  // the shared function's verdicts say "does not hold" and "inconclusive" by design
  main.querySelectorAll("p").forEach(p => {
    if (p.textContent.trim().startsWith("Verdict:")) p.remove();
  });
  return main.textContent;
}"""


@pytest.mark.parametrize("relative", TOC_PAGES)
def test_the_prose_has_no_words_of_the_books_own_process(visit, relative):
    """A reader has no seed, issue or bar: articles are cited by title and a target is called
    a target; and every verdict on a claim is the shared function's (infra_lab.verdict)."""
    text = visit(relative).page.evaluate(PROSE)
    internal = sorted({m.group(0) for m in INTERNAL.finditer(text)})
    assert internal == [], f"{relative}: words a reader cannot know: {internal}"
    by_hand = [m.group(0) for m in VERDICT_WORDS.finditer(text)]
    assert by_hand == [], f"{relative}: verdicts not written by infra_lab.verdict: {by_hand}"


PHONE = {"width": 390, "height": 844}
SMALLEST_TEXT_PX = 7  # the figures' smallest text is 9 pt (12 px at their natural size)
FIGURE_TEXT_PX = 12

FIGURE_SCALES = """() => Array.from(document.querySelectorAll("main img"))
  .filter(i => i.naturalWidth > 200 && /svg/.test(i.currentSrc || i.src))
  .map(i => ({alt: i.alt, shown: i.getBoundingClientRect().width, natural: i.naturalWidth}))"""

CLIPPED_MATH = """() => {
  const cut = [];
  for (const m of document.querySelectorAll("main mjx-container")) {
    const box = m.getBoundingClientRect();
    // the nearest box that hides, or scrolls, what overflows it, above MathJax's own wrapper
    let host = (m.closest(".math") || m).parentElement;
    while (host && !["hidden", "clip", "auto", "scroll"].includes(getComputedStyle(host).overflowX)
           && host.tagName !== "MAIN") host = host.parentElement;
    if (host && ["auto", "scroll"].includes(getComputedStyle(host).overflowX)) continue;  // it scrolls
    const edge = host ? host.getBoundingClientRect().right : window.innerWidth;
    const scrolls = ["auto", "scroll"].includes(getComputedStyle(m).overflowX);
    if (box.width > 0 && !scrolls && box.right > Math.min(edge, window.innerWidth) + 1)
      cut.push(m.textContent.slice(0, 40) +
               ` (${Math.round(box.right)} px > ${Math.round(Math.min(edge, window.innerWidth))} px)`);
  }
  return cut;
}"""


@pytest.fixture(scope="module")
def phone_visit(browser, site_url):
    """As `visit`, at a phone's 390 px width."""
    open_once, visits = visitor(browser, site_url, PHONE)
    yield open_once
    for one in visits.values():
        one.page.close()


@pytest.mark.parametrize("relative", TOC_PAGES)
def test_figure_text_stays_legible_on_a_phone(phone_visit, relative):
    scales = phone_visit(relative).page.evaluate(FIGURE_SCALES)
    small = [f"{f['alt']!r} at {f['shown'] / f['natural']:.0%}" for f in scales
             if f["shown"] / f["natural"] * FIGURE_TEXT_PX < SMALLEST_TEXT_PX]
    assert small == [], f"{relative} at 390 px: figures whose 9 pt text shows below {SMALLEST_TEXT_PX} px: {small}"


@pytest.mark.parametrize("relative", TOC_PAGES)
def test_no_math_is_cut_on_a_phone_or_a_laptop(visit, phone_visit, relative):
    for width, page in ((1280, visit(relative).page), (390, phone_visit(relative).page)):
        cut = page.evaluate(CLIPPED_MATH)
        assert cut == [], f"{relative} at {width} px: math cut at the column's edge: {cut}"
