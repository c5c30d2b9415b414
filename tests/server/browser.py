"""Headless Chromium for the chat page's tests (and scripts/screenshot_chat.py): Debian's `chromium`
and `chromium-driver` driven by selenium. `chromium_or_skip()` names what is missing."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

CHROMIUM_CANDIDATES = ["/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"]
DRIVER_CANDIDATES = ["/usr/bin/chromedriver"]
BROWSER_HINT = "make browser, i.e. apt-get install -y chromium chromium-driver (as .ci/run does)"
# No network besides our server, no first-run UI, a throwaway profile: the page must work offline.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1"]


def find_browser() -> tuple[str, str] | str:
    """(chromium, chromedriver) paths, or a sentence saying what is missing."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: pip install -e '.[test]'"
    browser = next((p for p in CHROMIUM_CANDIDATES if Path(p).exists()), shutil.which("chromium"))
    driver = next((p for p in DRIVER_CANDIDATES if Path(p).exists()), shutil.which("chromedriver"))
    if browser is None or driver is None:
        return f"no headless Chromium here (chromium: {browser}, chromedriver: {driver}): {BROWSER_HINT}"
    return browser, driver


def chromium_or_skip() -> tuple[str, str]:
    found = find_browser()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@contextlib.contextmanager
def chromium(browser: str, driver: str, width: int = 1100, height: int = 800) -> Iterator:
    """A selenium WebDriver on a fresh headless Chromium profile, quit (and the profile removed) after."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="verispec-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={profile}", f"--window-size={width},{height}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console errors, CSP violations
    # The explicit driver path keeps selenium from looking for (downloading) one itself.
    web = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield web
    finally:
        web.quit()
        shutil.rmtree(profile, ignore_errors=True)


def console_errors(web) -> list[str]:
    """The page's console errors since the last call (script errors, CSP violations, failed loads)."""
    return [entry["message"] for entry in web.get_log("browser") if entry["level"] == "SEVERE"]
