"""Headless Chromium on the dashboard, for the tests that look at it (test_dashboard.py,
test_newcomer_dashboard.py): the ``browser`` fixture (Debian's ``chromium`` driven through
``chromium-driver`` by Selenium, both paths given, so it never downloads a browser) and
what those tests ask the page: where the task detail is, the keyboard focus, a refresh,
the console's errors, and axe-core's violations.

axe-core comes from npm: ``scripts/test`` installs it under the git-ignored ``.cache/npm``. A
test that asks for it fails, never skips, when it is missing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REPO_ROOT = Path(__file__).resolve().parents[2]
AXE_CORE = REPO_ROOT / ".cache" / "npm" / "node_modules" / "axe-core" / "axe.min.js"
AXE_INSTALL = (
    "npm install --prefix .cache/npm --no-save --no-package-lock axe-core@4.14.1"
    " (what scripts/test does)"
)
# The window: a task's detail once opened 1,234 px down a 757 px high window.
SMALL_WINDOW = (1280, 757)
PAGE_WAIT_S = 20.0  # the page refreshes every 2 s; this is many refreshes


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        assert path.is_file(), f"{path} is missing: apt-get install -y {package}"
    options = Options()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1440,1000",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(argument)
    # Console messages, and network events (to see the headers the page sends).
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: WebDriver) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = driver.get_log("browser")  # type: ignore[no-untyped-call]
    return [entry for entry in entries if entry.get("level") == "SEVERE"]


# Where the task detail is: shown, for which task, and whether its title is inside the window.
DETAIL_JS = """
const d = document.getElementById('task-detail');
const t = document.getElementById('detail-title').getBoundingClientRect();
return {task: d.dataset.task || null, hidden: d.hidden, titleTop: t.top, titleBottom: t.bottom,
  window: window.innerHeight, focused: (document.activeElement || {}).id || '',
  loaded: view.loaded, rows: document.querySelectorAll('#tasks tr[data-task]').length};
"""


def wait_detail_in_view(driver: WebDriver, task_id: int, what: str) -> dict[str, Any]:
    """Wait until task ``task_id``'s detail is shown with its title inside the window,
    after the page's first refresh filled the tables above it."""
    last: dict[str, Any] = {}

    def ready(d: WebDriver) -> bool:
        nonlocal last
        last = d.execute_script(DETAIL_JS)
        return bool(
            last["task"] == str(task_id)
            and not last["hidden"]
            and last["loaded"]
            and last["rows"] > 0
            and last["titleTop"] >= 0
            and last["titleBottom"] <= last["window"]
        )

    try:
        WebDriverWait(driver, PAGE_WAIT_S, poll_frequency=0.2).until(ready)
    except TimeoutException:
        raise AssertionError(
            f"task {task_id}'s detail was not in view {what} within {PAGE_WAIT_S} s: {last}"
        ) from None
    return last


def active_href(driver: WebDriver) -> str:
    href: str = driver.execute_script(
        "const a = document.activeElement; return a && a.getAttribute('href') || '';"
    )
    return href


def tab_to(driver: WebDriver, selector: str, most: int = 150) -> None:
    """Press Tab (a real key event) until the focus is on ``selector``'s element."""
    for _ in range(most):
        if driver.execute_script(f"return document.activeElement.matches({json.dumps(selector)})"):
            return
        ActionChains(driver).send_keys(Keys.TAB).perform()
    raise AssertionError(f"{most} Tab presses never reached {selector}: it is not focusable")


def next_refresh(driver: WebDriver) -> None:
    """Wait (bounded) until the page has refreshed once more."""
    before = driver.find_element(By.ID, "updated").text
    WebDriverWait(driver, PAGE_WAIT_S, poll_frequency=0.2).until(
        lambda d: d.find_element(By.ID, "updated").text != before
    )


def axe_violations(driver: WebDriver) -> tuple[str, list[dict[str, Any]]]:
    """axe-core's version and the violations it finds on the page as it is (auto refresh
    off, so the page does not change under it)."""
    assert AXE_CORE.is_file(), f"axe-core is missing ({AXE_CORE}): {AXE_INSTALL}"
    checkbox = driver.find_element(By.ID, "auto-refresh")
    if checkbox.is_selected():
        checkbox.click()
    WebDriverWait(driver, PAGE_WAIT_S, poll_frequency=0.2).until(
        lambda d: d.execute_script("return !view.busy")
    )
    driver.execute_script(AXE_CORE.read_text())
    driver.set_script_timeout(60)
    result: dict[str, Any] = driver.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        axe.run(document, {resultTypes: ['violations']}).then(
          (r) => done({version: axe.version, violations: r.violations.map((v) => ({
            id: v.id, impact: v.impact, help: v.help,
            nodes: v.nodes.map((n) => n.target.join(' ') + ': ' + n.failureSummary)}))}),
          (e) => done({error: String(e)}));
        """
    )
    driver.set_script_timeout(10)
    assert "error" not in result, f"axe-core failed: {result}"
    return result["version"], result["violations"]
