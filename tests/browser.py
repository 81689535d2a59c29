"""Headless Chromium for the web UI's tests: Debian's browser driven by Playwright, and where its pictures go.

Playwright's own browser download does not work here, so it drives `/usr/bin/chromium`
(`./dev test` installs Debian's `chromium` when it is missing). Without the browser or the
`playwright` package the browser tests skip, saying which is missing and how to get it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

try:
    from playwright.sync_api import Browser, Page, sync_playwright
    from playwright.sync_api import TimeoutError as Timeout
except ImportError:  # the [test] extra brings it; without it the browser tests skip
    sync_playwright = None
    Timeout = TimeoutError  # never raised then: nothing runs a browser

CHROMIUM = Path("/usr/bin/chromium")
REPOSITORY = Path(__file__).resolve().parent.parent
VIEWPORT = {"width": 1280, "height": 800}  # the README's pictures are this size
PHONE = {"width": 390, "height": 844}
# Headless, and nothing that reaches for the internet (updates, sync, QUIC probes, first-run pages).
FLAGS = (
    "--no-sandbox",  # the tests run as root in CI, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def unavailable() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if sync_playwright is None:
        return "the playwright package is missing: .venv/bin/pip install -e '.[test]' (or run ./dev test)"
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} is missing: apt-get install --no-install-recommends chromium chromium-driver (./dev test does it as root)"
    return None


@contextmanager
def chromium() -> Iterator[Browser]:
    """One headless Chromium with a fresh profile; the browser and Playwright's driver are gone on exit, whatever happened."""
    assert sync_playwright is not None, unavailable()
    playwright = sync_playwright().start()
    try:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=list(FLAGS))
        try:
            yield browser
        finally:
            browser.close()
    finally:
        playwright.stop()


@dataclass
class Tab:
    """One node's UI in a browser context of its own; `errors` collects the page's uncaught JavaScript errors."""

    page: Page
    base: str
    errors: list[str] = field(default_factory=list)

    def open(self, path: str) -> Page:
        """Navigate to `path` on this node (a real page load, as a person following a link)."""
        self.page.goto(self.base + path)
        return self.page


def tab(browser: Browser, base: str, password: str | None = None, viewport: dict[str, int] = VIEWPORT, dark: bool = False) -> Tab:
    """A fresh context (cookies, storage) and page for the node at `base`, e.g. http://127.0.0.1:PORT, signed in
    through the login form when a password is given. Each node is an origin of its own, so a tab signs in once and
    every page it opens afterwards is signed in."""
    page = browser.new_context(viewport=viewport, color_scheme="dark" if dark else "light").new_page()
    found = Tab(page, base.rstrip("/"))
    page.on("pageerror", lambda error: found.errors.append(str(error)))
    if password is not None:
        page.goto(found.base + "/login")
        page.get_by_label("password").fill(password)
        page.get_by_role("button", name="sign in").click()
        page.wait_for_url(found.base + "/")
        assert page.locator(".sign-out").count() == 1, f"signing in to {base} did not work: {page.content()[:500]}"
    return found


def artifacts() -> Path:
    """Where screenshots go: $GPUBROKER_ARTIFACTS, else build/artifacts/ in the repository (ignored by git)."""
    folder = Path(os.environ.get("GPUBROKER_ARTIFACTS") or REPOSITORY / "build" / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def screenshot(page: Page, name: str) -> Path:
    """The viewport as `name` in the artifacts folder; with GPUBROKER_UPDATE_DOCS=1 also as docs/`name` (the README shows it)."""
    path = artifacts() / name
    page.screenshot(path=str(path))
    if os.environ.get("GPUBROKER_UPDATE_DOCS") == "1":
        shutil.copyfile(path, REPOSITORY / "docs" / name)
    return path
