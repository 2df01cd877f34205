"""Issue 18 on the dashboard (headless Chromium, tests/support/dashboard_browser.py): a
task's detail shows the tasks it runs ``after`` and those it is still waiting for, as
links; the schedules panel lists every schedule with its cron or interval, missed-tick
policy, next tick and last firing (a link to the task that tick created). A standalone
broker without workers, so the tasks stay queued; axe-core finds nothing serious.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.dashboard_browser import (
    PAGE_WAIT_S,
    axe_violations,
    console_errors,
    wait_detail_in_view,
)
from tests.support.procs import BrokerProcess
from tests.support.worker_procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TENANT = "dash-sched"
ROWS_JS = """
return Object.fromEntries(Array.from(document.querySelectorAll('#schedules tr[data-schedule]'))
  .map(r => [r.dataset.schedule, {text: r.innerText,
    links: Array.from(r.querySelectorAll('a[href]')).map(a => a.getAttribute('href'))}]));
"""


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(url + path, json=body, timeout=10)
    assert response.status_code == 201, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _schedule(url: str, name: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/api/v1/schedules/{name}", params={"tenant": TENANT}, timeout=10)
    response.raise_for_status()
    view: dict[str, Any] = response.json()
    return view


def test_dependencies_and_schedules_on_the_dashboard(tmp_path: Path, browser: WebDriver) -> None:
    with BrokerProcess(tmp_path / "data", log_path=tmp_path / "broker.log") as broker:
        broker.start()
        url = broker.url
        task = {"type": "noop"}
        _post(url, "/api/v1/schedules", {"name": "beat", "tenant": TENANT, "task": task,
                                         "interval_s": 1})  # fmt: skip
        _post(url, "/api/v1/schedules", {"name": "nightly", "tenant": TENANT, "task": task,
                                         "cron": "0 3 * * *", "missed": "run_once"})  # fmt: skip
        wait_until(lambda: _schedule(url, "beat")["recent"], 20, "a tick of schedule beat")
        first = _post(url, "/api/v1/tasks", {"type": "noop", "tenant": TENANT})["id"]
        second = _post(url, "/api/v1/tasks", {"type": "noop", "tenant": TENANT})["id"]
        dependant = _post(
            url, "/api/v1/tasks", {"type": "noop", "tenant": TENANT, "after": [first, second]}
        )["id"]

        browser.get(f"{url}/#task-{dependant}")
        wait_detail_in_view(browser, dependant, "on a fresh load of /#task-N")
        fields = browser.execute_script(
            "return Array.from(document.querySelectorAll('#detail-fields > div'))"
            ".map(d => [d.querySelector('dt').innerText, d.querySelector('dd').innerText,"
            " Array.from(d.querySelectorAll('a[href]')).map(a => a.getAttribute('href'))])"
        )
        by_name = {name: (text, links) for name, text, links in fields}
        expected_links = [f"#task-{first}", f"#task-{second}"]
        assert by_name["after"] == (f"#{first} #{second}", expected_links), fields
        assert by_name["waiting for"] == (f"#{first} #{second} to finish", expected_links), fields

        rows: dict[str, Any] = {}

        def shown(d: WebDriver) -> bool:
            nonlocal rows
            rows = d.execute_script(ROWS_JS)
            return len(rows) == 2 and bool(rows.get(f"{TENANT}/beat", {}).get("links"))

        try:
            WebDriverWait(browser, PAGE_WAIT_S, poll_frequency=0.2).until(shown)
        except TimeoutException:
            raise AssertionError(f"the schedules shown: {json.dumps(rows, indent=2)}") from None
        beat, nightly = rows[f"{TENANT}/beat"], rows[f"{TENANT}/nightly"]
        assert "every 1 s" in beat["text"] and "\tskip\t" in beat["text"], beat
        fired = {f"#task-{f['task_id']}" for f in _schedule(url, "beat")["recent"]}
        assert set(beat["links"]) <= fired, (beat, fired)
        assert "0 3 * * *" in nightly["text"] and "run_once" in nightly["text"], nightly
        assert "never" in nightly["text"] and " 03:00:00.000 UTC" in nightly["text"], nightly

        version, violations = axe_violations(browser)
        serious = [v for v in violations if v["impact"] in ("serious", "critical")]
        assert not serious, f"axe-core {version}:\n" + json.dumps(serious, indent=2)
        errors = console_errors(browser)
        assert not errors, f"browser console errors: {errors}"
