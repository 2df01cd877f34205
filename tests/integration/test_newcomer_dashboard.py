"""Issue 17, friction 9, as a newcomer meets it: the README's ``steward standalone`` with a
worker, tasks submitted with ``steward submit``, and the dashboard opened at ``/#task-4`` in
the issue's 757 px high window (headless Chromium, tests/support/dashboard_browser.py).

Before: the leader's name read "standal…", the detail of task 4 was 1,234 px down the
window, changing the hash did nothing, a worker read "* \u00d7 2" and "memory_mb 24105", the
tenant "MAX QUEUED \u221e" and "FAILED", a task row could not be reached from the keyboard, and
axe-core found serious violations. Every wait is bounded.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tests.support.dashboard_browser import (
    SMALL_WINDOW,
    active_href,
    axe_violations,
    console_errors,
    tab_to,
    wait_detail_in_view,
)
from tests.support.procs import BrokerProcess, steward_command
from tests.support.worker_procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# What the page shows of the brokers, the worker and the tenant, read in one call.
TEXTS_JS = """
const text = (sel) => (document.querySelector(sel) || {}).innerText || '';
const value = document.querySelector('#leader-card .value');
return {leader: value ? value.innerText : '',
  leaderFits: !!value && value.scrollWidth <= value.clientWidth,
  worker: text('#workers tbody'), tenants: text('#tenants'), charts: text('#charts')};
"""


def _steward(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*steward_command(), "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "STEWARD_URL": url},
    )
    assert done.returncode == 0, f"steward {' '.join(args)}: {done.returncode}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_a_newcomer_opens_a_task_on_the_dashboard(tmp_path: Path, browser: WebDriver) -> None:
    with BrokerProcess(
        tmp_path / "data", log_path=tmp_path / "broker.log", extra_args=("--workers", "1")
    ) as broker:
        broker.start()
        wait_until(
            lambda: httpx.get(broker.url + "/api/v1/workers", timeout=5).json()["workers"],
            45,
            "the standalone broker's worker connected",
        )
        _steward(broker.url, "submit", "sleep", "--params", '{"seconds": 0.1}', "--count", "5")
        _steward(broker.url, "submit", "fail", "--params", '{"message": "newcomer boom"}')
        _steward(broker.url, "submit", "sleep", "--params", '{"seconds": 0.1}', "--wait")

        browser.set_window_size(*SMALL_WINDOW)
        browser.get(broker.url + "/#task-4")
        wait_detail_in_view(browser, 4, "on a fresh load of /#task-4")

        texts = browser.execute_script(TEXTS_JS)
        assert texts["leader"] == "standalone" and texts["leaderFits"], texts
        # The worker's default capacity ("*": any type) and resources, in words and units.
        assert "any type: " in texts["worker"] and "\u00d7" not in texts["worker"], texts
        assert "cpu: " in texts["worker"] and " MB" in texts["worker"], texts
        for word in ("max_waiting", "max_running", "0 (unlimited)", "error"):
            assert word in texts["tenants"], (word, texts["tenants"])
        for word in ("MAX QUEUED", "\u221e", "FAILED", "Failed"):
            assert word not in texts["tenants"], (word, texts["tenants"])

        # The hash changed in the open tab: task 6 (the failed one) comes into view.
        browser.execute_script("location.hash = '#task-6'")
        wait_detail_in_view(browser, 6, "after the hash changed to #task-6")
        assert "newcomer boom" in browser.find_element(By.ID, "detail-error").text

        # From the keyboard: Tab from the search form to the newest task's row, Enter.
        browser.execute_script("document.getElementById('search-reset').focus()")
        ActionChains(browser).send_keys(Keys.TAB).perform()
        assert active_href(browser) == "#task-7", active_href(browser)
        tab_to(browser, '#tasks a[href="#task-2"]')
        ActionChains(browser).send_keys(Keys.ENTER).perform()
        shown = wait_detail_in_view(browser, 2, "after Enter on its row")
        assert shown["focused"] == "detail-title", shown

        version, violations = axe_violations(browser)
        serious = [v for v in violations if v["impact"] in ("serious", "critical")]
        assert not serious, f"axe-core {version}: {serious}"
        assert not console_errors(browser)
