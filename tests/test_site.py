"""Smoke test of the built site in headless Chromium: every page loads without console errors,
figures are present, launch buttons point at Colab, and the search page answers.

The site loads MathJax and the widget manager from CDNs; this machine has no internet, so
requests that leave localhost are aborted and their "Failed to load resource" lines ignored.
"""
import functools
import http.server
import shutil
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytestmark = pytest.mark.site
ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "_build" / "html"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-quic"]


@pytest.fixture(scope="module")
def site_url():
    if not (SITE / "index.html").is_file():
        pytest.fail("no built site: run `make book` first")
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


def open_page(browser, url):
    """Load `url`; return the page and the console errors of the site's own making."""
    page = browser.new_page()
    errors, external = [], []

    def route(request_route):
        if urlparse(request_route.request.url).hostname == "127.0.0.1":
            request_route.continue_()
        else:
            external.append(request_route.request.url)
            request_route.abort()

    page.route("**/*", route)
    page.on("console", lambda message: message.type == "error" and errors.append(message))
    page.on("pageerror", lambda error: errors.append(error))
    response = page.goto(url, wait_until="load")
    assert response is not None and response.ok, url
    page.wait_for_timeout(300)
    own = [e for e in errors if not (
        getattr(e, "text", "").startswith("Failed to load resource: net::ERR_FAILED")
        and urlparse(e.location.get("url", "")).hostname != "127.0.0.1")]
    return page, [getattr(e, "text", str(e)) for e in own]


def pages():
    return sorted(p.relative_to(SITE).as_posix() for p in SITE.rglob("*.html")
                  if "_static" not in p.parts and "_sources" not in p.parts)


def test_every_page_loads_without_console_errors(browser, site_url):
    found = pages()
    assert "book/ch00_stack.html" in found and "search.html" in found
    for relative in found:
        page, errors = open_page(browser, f"{site_url}/{relative}")
        assert errors == [], (relative, errors)
        page.close()


def test_chapter_figures_and_source_listings_are_present(browser, site_url):
    page, _ = open_page(browser, f"{site_url}/book/ch00_stack.html")
    widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.naturalWidth)")
    assert len([w for w in widths if w > 100]) >= 4, widths  # intensity, timeline, explorer
    assert page.locator(".infra-lab-source").count() >= 4
    assert "infra_lab/stack.py, lines" in page.inner_text("body")
    assert "Explorer." in page.inner_text("body")
    page.close()


@pytest.mark.parametrize("chapter", ["ch00_stack", "ch01_roofline", "ch02_attention", "ch03_paged_kv", "ch04_radix_kv"])
def test_every_chapter_has_figures_source_and_an_explorer(browser, site_url, chapter):
    page, _ = open_page(browser, f"{site_url}/book/{chapter}.html")
    widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.naturalWidth)")
    assert len([w for w in widths if w > 100]) >= 2, widths
    assert page.locator(".infra-lab-source").count() >= 2
    text = page.inner_text("body")
    assert "Explorer." in text and "infra_lab backend:" in text
    page.close()


def test_launch_buttons_go_to_colab_and_binder(browser, site_url):
    page, _ = open_page(browser, f"{site_url}/book/ch00_stack.html")
    links = page.eval_on_selector_all("a", "as => as.map(a => a.href)")
    colab = "https://colab.research.google.com/github/ai-infra-lab/ai-infra-lab/blob/main/book/ch00_stack.ipynb"
    assert colab in links
    assert any(link.startswith("https://mybinder.org/v2/gh/ai-infra-lab/ai-infra-lab/main") for link in links)
    page.close()


def test_search_answers(browser, site_url):
    page, errors = open_page(browser, f"{site_url}/search.html?q=intensity")
    page.wait_for_selector("#search-results ul.search li", timeout=15000)
    hits = page.locator("#search-results ul.search li a").all_inner_texts()
    assert any("stack" in hit.lower() for hit in hits), hits
    assert errors == []
    page.close()
