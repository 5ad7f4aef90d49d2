"""Open the built documentation site in headless Chromium and check what a reader sees.

    mkdocs build && python tools/check_site.py site/ [OUT_DIR]

Serves the site on localhost, opens it in Chromium (Debian's /usr/bin/chromium, driven by
playwright-core through ``pip install playwright``; no browser download), and checks that the
gallery's images load (each <img> has a natural width), that the navigation reaches every page of
the nav, and that the search box finds a method. Writes screenshots of the home page, the gallery
and a search result to OUT_DIR (default: site-screenshots/) to look at.
"""

from __future__ import annotations

import functools
import http.server
import sys
import threading
from pathlib import Path

from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def main(site: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    server, address = serve(site)
    problems: list[str] = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(address)
            page.screenshot(path=str(out / "home.png"))
            links = page.eval_on_selector_all("nav.md-nav--primary a.md-nav__link[href]",
                                              "links => links.map(link => link.href)")
            visited = 0
            for link in dict.fromkeys(link.split("#")[0] for link in links):  # pages, not anchors
                response = page.goto(link)
                if response is None or response.status != 200:
                    problems.append(f"navigation: {link} answered {response and response.status}")
                visited += 1
            page.goto(address + "gallery/")
            page.wait_for_load_state("networkidle")
            sizes = page.eval_on_selector_all("article img", "images => images.map(image => image.naturalWidth)")
            if not sizes or min(sizes) == 0:
                problems.append(f"gallery: {sizes.count(0)} of {len(sizes)} images did not load")
            page.screenshot(path=str(out / "gallery.png"), full_page=False)
            page.goto(address)
            page.wait_for_load_state("networkidle")
            page.click("input.md-search__input")
            page.keyboard.type("IntegratedGradients", delay=50)
            page.wait_for_selector(".md-search-result__item", timeout=30000)
            results = page.eval_on_selector_all(".md-search-result__item", "items => items.length")
            if results == 0:
                problems.append("search: no result for IntegratedGradients")
            page.screenshot(path=str(out / "search.png"))
            browser.close()
    finally:
        server.shutdown()
    print(f"navigation: {visited} pages; gallery images: {len(sizes)} loaded, widths {sorted(set(sizes))}; "
          f"search results: {results}; screenshots in {out}")
    for problem in problems:
        print("PROBLEM:", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    arguments = sys.argv[1:]
    sys.exit(main(Path(arguments[0] if arguments else "site"), Path(arguments[1] if len(arguments) > 1
                                                                    else "site-screenshots")))
