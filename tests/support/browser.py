"""Headless Chromium for the settings page's browser tests (Debian's ``chromium`` and
``chromium-driver``; ``make test`` apt-installs them when it runs as root).

Skipped only where they cannot be there: not installed AND not root (CI runs as root
with apt, so a missing browser there fails the test instead of hiding it).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--window-size=1280,1000")


def require_chromium() -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if not missing:
        return
    if os.geteuid() != 0:
        pytest.skip(f"{', '.join(missing)} missing and not root: apt-get install chromium chromium-driver "
                    "(make test does it as root)")
    pytest.fail(f"{', '.join(missing)} missing though running as root: make test-unit installs "
                "chromium and chromium-driver with apt-get")


@contextlib.contextmanager
def chromium() -> Iterator["object"]:
    """A headless Chromium WebDriver with its own throw-away profile, always quit."""
    require_chromium()
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (the dev extra) is not installed")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="ace-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
