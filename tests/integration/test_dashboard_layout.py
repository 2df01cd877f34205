"""Issue 30, the dashboard in headless Chromium (tests/support/dashboard_browser.py) against
a real ``steward standalone``:

- at the common window widths from 1,280 to 1,920 px no panel overflows sideways: the
  tenants' eight columns, ``error`` last, are all in view (at 1,400 px the tenants table
  was 778 px wide in a 664 px panel that hid ``error`` behind a scroll bar);
- a task's detail shows its progress only while it runs: a task that failed (its deadline
  passed while it ran, after reporting progress) shows no progress bar any more, and its
  time queued and start.

Every wait is bounded.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.dashboard_browser import PAGE_WAIT_S, console_errors, wait_detail_in_view
from tests.support.procs import BrokerProcess
from tests.support.worker_procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

TENANT = "dashboard-demo"
WIDTHS = (1280, 1366, 1400, 1440, 1600, 1920)

# Every panel wider inside than its box (it would scroll sideways), and where the tenants'
# last header ends against the panel's visible right edge.
OVERFLOW_JS = """
const panels = Array.from(document.querySelectorAll('.panel')).filter(p => !p.hidden);
const panel = document.getElementById('tenants-panel').getBoundingClientRect();
const headers = document.querySelectorAll('#tenants th');
const last = headers[headers.length - 1];
return {
  overflowing: panels.filter(p => p.scrollWidth > p.clientWidth)
    .map(p => `${p.id}: ${p.scrollWidth} px in ${p.clientWidth} px`),
  page: [document.documentElement.scrollWidth, document.documentElement.clientWidth],
  lastHeader: last.innerText,
  lastHeaderRight: last.getBoundingClientRect().right,
  panelRight: panel.right,
};
"""

DETAIL_JS = """
const detail = document.getElementById('task-detail');
return {
  title: document.getElementById('detail-title').innerText,
  names: Array.from(document.querySelectorAll('#detail-fields dt')).map(d => d.innerText),
  fields: document.getElementById('detail-fields').innerText,
  bars: document.querySelectorAll('#detail-fields progress').length,
  task: detail.dataset.task,
};
"""


def _wait_detail(driver: WebDriver, check: Any, what: str) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def ready(d: WebDriver) -> bool:
        nonlocal last
        last = d.execute_script(DETAIL_JS)
        return bool(check(last))

    try:
        WebDriverWait(driver, PAGE_WAIT_S, poll_frequency=0.2).until(ready)
    except TimeoutException:
        raise AssertionError(f"the detail did not show {what}; it showed {last}") from None
    return last


def test_no_panel_overflows_from_1280_to_1920_px(tmp_path: Path, browser: WebDriver) -> None:
    with BrokerProcess(tmp_path / "data", log_path=tmp_path / "broker.log") as broker:
        broker.start()
        limits = {"weight": 2, "max_running": 4}  # max_waiting 0: "0 (unlimited)"
        put = httpx.put(f"{broker.url}/api/v1/tenants/{TENANT}", json=limits, timeout=10)
        assert put.status_code == 200, put.text
        submitted = httpx.post(
            f"{broker.url}/api/v1/tasks", json={"type": "noop", "tenant": TENANT}, timeout=10
        )
        assert submitted.status_code == 201, submitted.text
        browser.set_window_size(WIDTHS[0], 900)
        browser.get(broker.url + "/")
        WebDriverWait(browser, PAGE_WAIT_S, poll_frequency=0.2).until(
            lambda d: d.execute_script(
                f"return !!document.querySelector('#tenants tr[data-tenant=\"{TENANT}\"]')"
            )
        )
        for width in WIDTHS:
            browser.set_window_size(width, 900)
            shown = browser.execute_script(OVERFLOW_JS)
            assert browser.execute_script("return window.innerWidth") == width
            assert not shown["overflowing"], (width, shown)
            assert shown["page"][0] <= shown["page"][1], (width, shown)
            assert shown["lastHeader"] == "error"
            assert shown["lastHeaderRight"] <= shown["panelRight"], (width, shown)
        assert not console_errors(browser)


def test_a_failed_task_shows_no_progress(tmp_path: Path, browser: WebDriver) -> None:
    with BrokerProcess(
        tmp_path / "data", log_path=tmp_path / "broker.log", extra_args=("--workers", "1")
    ) as broker:
        broker.start()
        http = httpx.Client(base_url=broker.url, timeout=10)
        wait_until(lambda: http.get("/api/v1/workers").json()["workers"], 45, "the worker")
        # The built-in sleep reports progress once a second; its deadline ends it in error
        # while it sleeps (a deadline is a wall-clock time, which is what it is about).
        deadline = time.time() + 12
        body = {"type": "sleep", "params": {"seconds": 60}, "deadline": deadline}
        task_id = http.post("/api/v1/tasks", json=body).json()["id"]

        def view() -> dict[str, Any]:
            task: dict[str, Any] = http.get(f"/api/v1/tasks/{task_id}").json()
            return task

        wait_until(lambda: view()["progress"] is not None, 30, "a progress report")
        browser.get(f"{broker.url}/#task-{task_id}")
        wait_detail_in_view(browser, task_id, "on a fresh load of /#task-N")
        running = _wait_detail(
            browser, lambda d: d["bars"] == 1 or "error" in d["title"], "a progress bar"
        )
        # While it runs, its progress shows (unless it ended meanwhile, which the API says).
        assert running["bars"] == 1 or view()["state"] == "error", running

        wait_until(lambda: view()["state"] == "error", 30, "the deadline ending the task")
        failed = view()
        assert failed["progress"] is not None  # the API keeps the last report
        shown = _wait_detail(browser, lambda d: "error" in d["title"], "the task in error")
        assert shown["bars"] == 0 and "progress" not in shown["names"], shown
        assert "started" in shown["names"] and "queued" in shown["names"], shown
        http.close()
