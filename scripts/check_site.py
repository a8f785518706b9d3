"""`make book-check`: the built site (build/site) opened in a real browser.

Debian's chromium, headless, driven by Playwright (Playwright's own browser is never downloaded),
reads the site from a Python http.server on loopback. It fails on:

* a console error or an uncaught page error on the front page, the search page or any chapter;
* a request that leaves the local server (a CDN font or script: the site must work offline);
* a resource or an internal link that does not answer 200, or a link to an anchor the target
  page does not have;
* a chapter page with fewer figures (img elements) than its notebook has image outputs, or a
  figure that does not load or renders with zero width or height;
* a solution cell (tag `solution`) that is not collapsed when the page opens;
* a search for a word of the book that finds nothing.

It saves a screenshot of chapter 01 to build/site-check/ch01.png.

    python scripts/check_site.py [--site build/site] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urldefrag

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_site import CHAPTERS  # noqa: E402  (the chapter registry, without importing torch)

SITE_DIR = ROOT / "build" / "site"
SHOT_DIR = ROOT / "build" / "site-check"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")
SEARCH_WORD = "paged"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # The browser drops connections it no longer needs (a page closed mid-download): not a
        # fault of the site. Statuses are checked from the browser's side.
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """http.server on 127.0.0.1, an ephemeral port, in a daemon thread."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def notebook_figures(notebook: Path) -> int:
    """How many image outputs the stored notebook has (each becomes one img on its page)."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    return sum(1 for cell in nb["cells"] for out in cell.get("outputs", [])
               if any(m in out.get("data", {}) for m in IMAGE_MIMES))


def _built_from(notebook: str) -> Path:
    """The notebook as the site was built from it (the staged copy, when the stage is still
    there: chapters/ may have been re-executed since), else the one in chapters/."""
    staged = ROOT / "build" / "site-src" / "chapters" / notebook
    return staged if staged.is_file() else ROOT / "chapters" / notebook


def pages(base: str) -> list[tuple[str, str, int | None]]:
    """(name, url, figures expected) of every page the browser opens."""
    out = [("index", base + "index.html", None)]
    out += [(f"chapter {ch.number}", f"{base}chapters/{ch.slug}.html",
             notebook_figures(_built_from(ch.notebook))) for ch in CHAPTERS.values()]
    out.append(("search", base + "search.html", None))
    return out


# Everything measured in the page, in one evaluation: figures (after opening every <details>, so
# a figure behind a toggle is measured too, and put back), links, solution toggles.
_INSPECT_JS = """() => {
  const article = document.querySelector('article') || document.body;
  const solutions = [...document.querySelectorAll('.tag_solution, details.solution')].map(el => {
    const d = el.tagName === 'DETAILS' ? el : el.querySelector('details');
    return d ? d.open : true;   // a solution outside any <details> is shown: an error
  });
  const closed = [...document.querySelectorAll('details')].filter(d => !d.open);
  closed.forEach(d => { d.open = true; });
  const imgs = [...article.querySelectorAll('img')].map(img => {
    const r = img.getBoundingClientRect();
    return {src: img.currentSrc || img.src, complete: img.complete,
            natural: img.naturalWidth, width: r.width, height: r.height};
  });
  closed.forEach(d => { d.open = false; });
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  return {imgs, links, solutions};
}"""


# Loopback only: no proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _fetch(url: str) -> tuple[int, str]:
    try:
        with _OPENER.open(url, timeout=30) as r:
            body = r.read()
            kind = r.headers.get_content_type()
            return r.status, body.decode("utf-8", "replace") if kind == "text/html" else ""
    except urllib.error.HTTPError as e:
        return e.code, ""


def check_links(base: str, links: dict[str, set[str]]) -> list[str]:
    """Every internal link answers 200, and its #anchor exists on the page it names."""
    errors: list[str] = []
    bodies: dict[str, tuple[int, str]] = {}
    for link, found_on in sorted(links.items()):
        url, frag = urldefrag(link)
        if not url.startswith(base):
            continue
        if url not in bodies:
            bodies[url] = _fetch(url)
        status, body = bodies[url]
        where = ", ".join(sorted(found_on))
        if status != 200:
            errors.append(f"broken link ({status}) {link[len(base):]} on {where}")
        elif frag and body and f'id="{frag}"' not in body and f"name=\"{frag}\"" not in body:
            errors.append(f"link to a missing anchor {link[len(base):]} on {where}")
    return errors


def check(site: Path = SITE_DIR, chromium: str = CHROMIUM, shot_dir: Path = SHOT_DIR,
          log=print) -> list[str]:
    """Open every page; return the errors found (empty: the site passes)."""
    from playwright.sync_api import sync_playwright

    if not (site / "index.html").is_file():
        return [f"no site at {site} (run `make book`)"]
    server, base = serve(site)
    errors: list[str] = []
    links: dict[str, set[str]] = {}
    shot_dir.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS,
                                        headless=True)
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            outside: list[str] = []

            def route(r):
                if r.request.url.startswith(base) or r.request.url.startswith("data:"):
                    r.continue_()
                else:
                    outside.append(r.request.url)
                    r.abort()

            context.route("**/*", route)
            for name, url, figures in pages(base):
                t0 = time.perf_counter()
                page = context.new_page()  # a fresh page each time: its listeners go with it
                console: list[str] = []
                bad: list[str] = []
                page.on("console", lambda m, c=console: c.append(m.text)
                        if m.type == "error" else None)
                page.on("pageerror", lambda e, c=console: c.append(f"uncaught: {e}"))
                page.on("response", lambda r, b=bad: b.append(f"{r.status} {r.url}")
                        if r.status >= 400 else None)
                outside.clear()
                response = page.goto(url, wait_until="load")
                page.wait_for_load_state("networkidle")
                if response is None or response.status != 200:
                    errors.append(f"{name}: {url} answered "
                                  f"{response.status if response else 'nothing'}")
                    page.close()
                    continue
                if name == "search":
                    page.goto(f"{url}?q={SEARCH_WORD}", wait_until="load")
                    try:
                        page.wait_for_selector("ul.search li", timeout=20_000)
                    except Exception:  # noqa: BLE001
                        errors.append(f"search: '{SEARCH_WORD}' found nothing")
                found = page.evaluate(_INSPECT_JS)
                for link in found["links"]:
                    links.setdefault(link, set()).add(name)
                errors += [f"{name}: console error: {c}" for c in console]
                errors += [f"{name}: resource failed: {b}" for b in bad]
                errors += [f"{name}: request outside the site (blocked): {u}" for u in outside]
                if figures is not None and len(found["imgs"]) < figures:
                    errors.append(f"{name}: {len(found['imgs'])} figures on the page, its "
                                  f"notebook has {figures}")
                for img in found["imgs"]:
                    if not (img["complete"] and img["natural"] > 0 and img["width"] > 0
                            and img["height"] > 0):
                        errors.append(f"{name}: figure not shown: {img}")
                if any(found["solutions"]):
                    errors.append(f"{name}: {sum(found['solutions'])} solution(s) shown "
                                  f"open when the page loads")
                if name == "chapter 01":
                    page.screenshot(path=str(shot_dir / "ch01.png"))
                log(f"check_site: {name}: {len(found['imgs'])} figures, "
                    f"{len(found['links'])} links, {time.perf_counter() - t0:.1f} s")
                page.close()
            browser.close()
        errors += check_links(base, links)
    finally:
        server.shutdown()
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=SITE_DIR)
    parser.add_argument("--chromium", default=CHROMIUM)
    parser.add_argument("--shots", type=Path, default=SHOT_DIR)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    errors = check(args.site, args.chromium, args.shots)
    for e in errors:
        print(f"check_site: FAIL {e}", file=sys.stderr)
    print(f"check_site: {len(errors)} problem(s), screenshot {args.shots / 'ch01.png'}, "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
