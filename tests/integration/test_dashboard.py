"""Issue 7, acceptance 4: the web dashboard in a real headless Chromium against a real cluster.

ZooKeeper, three ``steward broker`` processes and one ``steward worker``; Debian's
``chromium`` and ``chromium-driver`` driven by Selenium (both paths given, so Selenium
Manager never looks for a browser on the network). The page is loaded from a follower and
from the leader; the test waits (bounded) until it shows the three brokers with the leader
marked, the worker with its capacities, the tenant and the submitted tasks, opens a finished
task's and a failed task's detail, checks the browser console has no errors, and saves a
full-page screenshot to ``test-artifacts/dashboard.png`` (git-ignored; the path is printed).

Issue 17: the page's words are the API's (``max_waiting``, ``error``, ``0 (unlimited)``,
resources with units) and broker names are whole; a task's detail comes into view on a
fresh load of ``/#task-N``, on a hash change in the open tab and from the keyboard (Tab to
a task's link, Enter); axe-core, from npm (``scripts/test`` installs it under ``.cache/npm``),
finds no violation of impact serious or critical. A missing axe-core fails the test.
"""

from __future__ import annotations

import base64
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import BrokerNode, ClusterProcesses
from tests.support.dashboard_browser import (
    PAGE_WAIT_S,
    SMALL_WINDOW,
    active_href,
    axe_violations,
    console_errors,
    next_refresh,
    tab_to,
    wait_detail_in_view,
)
from tests.support.procs import BrokerProcess
from tests.support.worker_procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPO_ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO_ROOT / "test-artifacts" / "dashboard.png"
TENANT = "dashboard-demo"

# What the page shows, read in one call (no stale elements between several lookups).
PAGE_STATE_JS = """
const rows = (sel) => Array.from(document.querySelectorAll(sel));
return {
  brokers: rows('#brokers tr[data-broker]').map(r => ({
    id: r.dataset.broker, role: r.dataset.role, leader: r.dataset.leader === 'true',
    text: r.innerText})),
  workers: rows('#workers tr[data-worker]').map(r => ({id: r.dataset.worker, text: r.innerText})),
  tenants: rows('#tenants tr[data-tenant]').map(r => ({name: r.dataset.tenant, text: r.innerText})),
  tasks: rows('#tasks tr[data-task]').map(r => Number(r.dataset.task)),
  leaderCard: (document.getElementById('leader-card') || {}).innerText || '',
  // The leader's name is whole: its box holds its text (no ellipsis, nothing cut off).
  leaderCardFits: (v => !v || v.scrollWidth <= v.clientWidth)(
    document.querySelector('#leader-card .value')),
  tenantHeaders: rows('#tenants th').map(th => th.innerText),
  servedBy: document.getElementById('served-by').innerText,
  banner: (b => b.hidden ? '' : b.innerText)(document.getElementById('banner')),
  bars: Object.fromEntries(rows('.chart[data-chart]').map(c => [c.dataset.chart,
    c.querySelectorAll('rect').length])),
};
"""


def _submit(node: BrokerNode, **task: Any) -> int:
    response = httpx.post(node.url + "/api/v1/tasks", json=task, timeout=10)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def _task(node: BrokerNode, task_id: int) -> dict[str, Any]:
    response = httpx.get(f"{node.url}/api/v1/tasks/{task_id}", params={"wait_s": 1}, timeout=10)
    response.raise_for_status()
    task: dict[str, Any] = response.json()
    return task


def _page_state(driver: WebDriver) -> dict[str, Any]:
    state: dict[str, Any] = driver.execute_script(PAGE_STATE_JS)
    return state


def _wait_page(
    driver: WebDriver, check: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    """Wait until ``check`` accepts what the page shows; on timeout, say what it showed."""
    last: dict[str, Any] = {}

    def ready(d: WebDriver) -> bool:
        nonlocal last
        last = _page_state(d)
        return check(last)

    try:
        WebDriverWait(driver, PAGE_WAIT_S, poll_frequency=0.2).until(ready)
    except TimeoutException:
        raise AssertionError(
            f"the dashboard did not show {what} within {PAGE_WAIT_S} s; it showed:\n"
            + json.dumps(last, indent=2)
        ) from None
    return last


def _shows_cluster(
    state: dict[str, Any], leader_id: str, broker_ids: set[str], task_ids: set[int]
) -> bool:
    brokers = state["brokers"]
    return (
        {b["id"] for b in brokers} == broker_ids
        and [b["id"] for b in brokers if b["leader"]] == [leader_id]
        and any(w["id"] == "w1" and "connected" in w["text"] for w in state["workers"])
        and any(t["name"] == TENANT for t in state["tenants"])
        and task_ids <= set(state["tasks"])
    )


def _table_is_the_cluster_view(state: dict[str, Any], node: BrokerNode, dead: str) -> bool:
    """The page's broker table says what ``GET /api/v1/cluster`` of ``node`` says (roles,
    positions, in sync or not), and both have ``dead`` unreachable."""
    response = httpx.get(node.url + "/api/v1/cluster", timeout=10)
    response.raise_for_status()
    view = {b["id"]: b for b in response.json()["brokers"]}
    page = {b["id"]: b for b in state["brokers"]}
    if set(page) != set(view) or view[dead]["reachable"] or page[dead]["role"] != "unreachable":
        return False
    for broker_id, row in page.items():
        broker = view[broker_id]
        cells = row["text"].split("\t")
        position = broker["position"]
        shown = f"{position['ledger_id']}:{position['entry_id']}" if position else "\u2014"
        in_sync = cells[3] == "in sync"
        if row["role"] != broker["role"] or cells[2] != shown:
            return False
        if not broker["is_leader"] and in_sync != (broker["lag_entries"] == 0):
            return False
    return "last seen" in page[dead]["text"]


def _open_detail(driver: WebDriver, task_id: int) -> dict[str, str]:
    driver.find_element(By.CSS_SELECTOR, f'#tasks tr[data-task="{task_id}"]').click()

    def shown(d: WebDriver) -> dict[str, str] | Literal[False]:
        detail = d.find_element(By.ID, "task-detail")
        if detail.get_attribute("data-task") != str(task_id) or not detail.is_displayed():
            return False
        texts: dict[str, str] = d.execute_script(
            "const t = (id) => document.getElementById(id).textContent;"
            "return {title: t('detail-title'), fields: t('detail-fields'),"
            " params: t('detail-params'), result: t('detail-result'), error: t('detail-error')};"
        )
        return texts if texts["params"] else False

    try:
        found: dict[str, str] = WebDriverWait(driver, PAGE_WAIT_S, poll_frequency=0.2).until(shown)
    except TimeoutException:
        raise AssertionError(f"task {task_id}'s detail did not open") from None
    return found


def _wait_detail_text(driver: WebDriver, element_id: str, text: str) -> str:
    """The shown text of a part of the open detail, once it holds ``text`` (bounded)."""
    script = (
        f"const e = document.getElementById('{element_id}'); return e.hidden ? '' : e.innerText;"
    )
    try:
        found: str = WebDriverWait(driver, PAGE_WAIT_S, poll_frequency=0.2).until(
            lambda d: (shown := d.execute_script(script)) and text in shown and shown
        )
    except TimeoutException:
        raise AssertionError(
            f"{element_id} did not show {text!r}; it showed {driver.execute_script(script)!r}"
        ) from None
    return found


def _api_requests(driver: WebDriver) -> list[tuple[str, str | None]]:
    """(URL, Authorization header) of the API requests the page sent since the last call."""
    found: list[tuple[str, str | None]] = []
    entries: list[dict[str, Any]] = driver.get_log("performance")  # type: ignore[no-untyped-call]
    for entry in entries:
        message = json.loads(entry["message"])["message"]
        if message.get("method") != "Network.requestWillBeSent":
            continue
        request = message["params"]["request"]
        if "/api/v1/" not in request["url"]:
            continue
        headers = {name.lower(): value for name, value in request.get("headers", {}).items()}
        found.append((request["url"], headers.get("authorization")))
    return found


def _wait_requests(
    driver: WebDriver, check: Callable[[list[tuple[str, str | None]]], bool], what: str
) -> None:
    seen: list[tuple[str, str | None]] = []

    def ready(d: WebDriver) -> bool:
        seen.extend(_api_requests(d))
        return check(seen)

    try:
        WebDriverWait(driver, PAGE_WAIT_S, poll_frequency=0.2).until(ready)
    except TimeoutException:
        raise AssertionError(f"the page sent no {what}; it sent {seen[-20:]}") from None


def _all_with_token(seen: list[tuple[str, str | None]], token: str) -> bool:
    """From the first call with the token on (a refresh may have started before it was
    set), every call has it, and a whole refresh's calls were seen."""
    bearer = f"Bearer {token}"
    first = next((i for i, (_, auth) in enumerate(seen) if auth == bearer), None)
    if first is None:
        return False
    since = seen[first:]
    assert all(auth == bearer for _, auth in since), f"a call without the token: {since}"
    endpoints = {url.split("?")[0].split("/api/v1/")[1] for url, _ in since}
    return endpoints >= {
        "workers",
        "cluster/brokers",
        "tenants",
        "stats/throughput",
        "tasks/recent",
    }


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_dashboard_shows_the_cluster_in_headless_chromium(
    zookeeper: ZooKeeperServer, tmp_path: Path, browser: WebDriver
) -> None:
    with ClusterProcesses(zookeeper.connect_string, tmp_path, brokers=3) as cluster:
        cluster.start_worker(
            "w1", "--task-type", "sleep=2", "--task-type", "fail=1", "--task-type", "noop=4"
        )
        leader = cluster.wait_workers_connected(["w1"], timeout_s=45)
        followers = [n for n in cluster.nodes.values() if n.broker_id != leader.broker_id]
        response = httpx.put(
            f"{leader.url}/api/v1/tenants/{TENANT}",
            json={"weight": 2, "max_running": 4},
            timeout=10,
        )
        assert response.status_code == 200, response.text
        # The root of a tracked tree (of one task), for the tree status in its detail.
        finished_id = _submit(
            leader,
            type="sleep",
            tenant=TENANT,
            params={"seconds": 0.2},
            track_tree=True,
        )
        failed_id = _submit(
            leader, type="fail", tenant=TENANT, params={"message": "dashboard boom"}
        )
        # Still running while the page is looked at: the worker shows a running task.
        running_id = _submit(leader, type="sleep", tenant=TENANT, params={"seconds": 120})
        for task_id, final in ((finished_id, "finished"), (failed_id, "error")):
            wait_until(
                lambda t=task_id, s=final: _task(followers[0], t)["state"] == s,  # type: ignore[misc]
                30,
                f"task {task_id} {final} on follower {followers[0].broker_id}",
            )
        wait_until(
            lambda: _task(leader, running_id)["state"] == "running", 30, "the long task running"
        )
        broker_ids = set(cluster.nodes)
        task_ids = {finished_id, failed_id, running_id}

        # A follower serves the page and its data from its own replica.
        browser.get(followers[0].url + "/")
        state = _wait_page(
            browser,
            lambda s: _shows_cluster(s, leader.broker_id, broker_ids, task_ids),
            f"3 brokers with {leader.broker_id} as leader, worker w1, tenant {TENANT}, "
            f"tasks {sorted(task_ids)}",
        )
        assert followers[0].broker_id in state["servedBy"]
        assert "follower" in state["servedBy"]
        assert state["banner"] == ""
        follower_rows = {b["id"]: b for b in state["brokers"]}
        assert follower_rows[leader.broker_id]["role"] == "leader"
        for follower in followers:
            assert follower_rows[follower.broker_id]["role"] == "follower"

        detail = _open_detail(browser, finished_id)
        assert '"seconds": 0.2' in detail["params"]
        assert '"slept": 0.2' in detail["result"]
        assert "finished" in detail["title"]
        assert "tree" in detail["fields"] and "completed" in detail["fields"], detail["fields"]
        # Issue 18: the tree it roots, from GET /api/v1/trees/{root} (a follower's replica).
        tree_box = _wait_detail_text(browser, "detail-tree-box", "1 finished")
        assert f"#{finished_id}" in tree_box and "completed" in tree_box, tree_box
        assert "awaited acks" in tree_box and "none" in tree_box, tree_box

        # A token typed in is kept in sessionStorage and sent on every API call; Clear stops it.
        token = "dashboard-test-token"
        browser.find_element(By.ID, "token-input").send_keys(token)
        _api_requests(browser)  # drop what was sent before
        browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
        _wait_requests(browser, lambda seen: _all_with_token(seen, token), "calls with the token")
        assert browser.execute_script("return sessionStorage.getItem('steward.apiToken')") == token
        browser.find_element(By.ID, "token-clear").click()
        _api_requests(browser)
        _wait_requests(
            browser,
            lambda seen: any(u.endswith("/api/v1/tenants") and a is None for u, a in seen),
            "API call without a token after Clear",
        )
        assert browser.execute_script("return sessionStorage.getItem('steward.apiToken')") is None

        # And the leader; the screenshot shows its page with the failed task's detail.
        browser.get(leader.url + "/")
        state = _wait_page(
            browser,
            lambda s: (
                _shows_cluster(s, leader.broker_id, broker_ids, task_ids)
                and s["bars"].get("finished", 0) > 0
                and s["bars"].get("error", 0) > 0
            ),
            "the cluster and non-empty throughput charts",
        )
        assert "leader" in state["servedBy"]
        # The leader's name whole (it was "standal\u2026"), and the API's words.
        assert state["leaderCard"].split("\n")[0] == leader.broker_id, state["leaderCard"]
        assert state["leaderCardFits"], "the leader's name does not fit its card"
        worker = next(w for w in state["workers"] if w["id"] == "w1")
        assert "sleep: 2 at once" in worker["text"], worker  # task_types: sleep, 2 at a time
        assert "\u00d7" not in worker["text"], worker
        assert " cores" in worker["text"] and " MB" in worker["text"], worker  # units
        assert f"#{running_id}" in worker["text"], worker
        assert state["tenantHeaders"] == [
            "Tenant", "weight", "max_waiting", "max_running",
            "queued", "running", "finished", "error",
        ], state["tenantHeaders"]  # fmt: skip
        tenant = next(t for t in state["tenants"] if t["name"] == TENANT)
        assert tenant["text"].split()[:2] == [TENANT, "2"], tenant
        # max_waiting 0 as the API says it (PUT /api/v1/tenants: 0 = unlimited); max_running 4.
        assert tenant["text"].split("\t")[2:4] == ["0 (unlimited)", "4"], tenant
        assert "\u221e" not in tenant["text"], tenant

        # The keyboard: a running task's chip is a link Tab reaches; Enter opens its detail,
        # in view, with the focus on it.
        browser.set_window_size(*SMALL_WINDOW)
        next_refresh(browser)
        # Nothing wider than the window (a cut-off column or name).
        widths = browser.execute_script(
            "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]"
        )
        assert widths[0] <= widths[1], f"the page is {widths[0]} px wide in a {widths[1]} px window"
        browser.execute_script("window.scrollTo(0, 0); document.activeElement.blur();")
        tab_to(browser, f'#workers a[href="#task-{running_id}"]')
        ActionChains(browser).send_keys(Keys.ENTER).perform()
        shown = wait_detail_in_view(browser, running_id, "after Enter on its chip")
        assert shown["focused"] == "detail-title", shown
        # Issue 18: its progress (the built-in sleep reports once a second), from the leader.
        fields = _wait_detail_text(browser, "detail-fields", "of 120 s")
        assert "progress" in fields and "% slept " in fields, fields
        assert (
            browser.execute_script(
                "return document.querySelectorAll('#detail-fields progress').length"
            )
            == 1
        )
        # A task row's link: Tab from the search form reaches the newest row first, the focus
        # stays on it across a refresh (the rows are redrawn), and Enter opens it.
        browser.execute_script("document.getElementById('search-reset').focus()")
        ActionChains(browser).send_keys(Keys.TAB).perform()
        assert active_href(browser) == f"#task-{running_id}", active_href(browser)
        tab_to(browser, f'#tasks a[href="#task-{finished_id}"]')
        next_refresh(browser)
        assert active_href(browser) == f"#task-{finished_id}", "a refresh took the focus"
        ActionChains(browser).send_keys(Keys.ENTER).perform()
        wait_detail_in_view(browser, finished_id, "after Enter on its row")
        assert browser.execute_script("return location.hash") == f"#task-{finished_id}"

        # A fresh load of /#task-N (the 757 px window), then a hash change in the
        # open tab: each time the detail comes into view.
        browser.get("about:blank")
        browser.get(f"{leader.url}/#task-{finished_id}")
        wait_detail_in_view(browser, finished_id, "on a fresh load of /#task-N")
        browser.execute_script(f"location.hash = '#task-{failed_id}'")
        wait_detail_in_view(browser, failed_id, "after a hash change")

        detail = _open_detail(browser, failed_id)
        assert "dashboard boom" in detail["error"]
        assert "Traceback" in detail["error"]
        assert "error" in detail["title"]
        assert "1 of 1" in detail["fields"]

        # The broker table is the cluster view's (GET /api/v1/cluster, issue 17): a follower
        # in sync shows lag 0 ("in sync"), and a killed follower stays in it, unreachable,
        # with when it was last seen.
        victim = followers[1]
        cluster.kill9(victim.broker_id)
        state = _wait_page(
            browser,
            lambda s: (
                _table_is_the_cluster_view(s, leader, victim.broker_id)
                and "\tin sync\t"
                in next(b["text"] for b in s["brokers"] if b["id"] == followers[0].broker_id)
            ),
            f"the broker table of GET /api/v1/cluster: {followers[0].broker_id} in sync,"
            f" {victim.broker_id} unreachable",
        )
        cells = {b["id"]: b["text"].split("\t") for b in state["brokers"]}
        assert cells[victim.broker_id][4].startswith("last seen "), cells

        version, violations = axe_violations(browser)
        print(f"\naxe-core {version}: {len(violations)} violations (none serious or critical)")
        for violation in violations:
            print(f"  {violation['impact']}: {violation['id']} ({violation['help']})")
        serious = [v for v in violations if v["impact"] in ("serious", "critical")]
        assert not serious, "axe-core:\n" + json.dumps(serious, indent=2)
        headings = browser.execute_script("return document.querySelectorAll('h1').length")
        assert headings == 1, f"{headings} <h1> elements"
        charts = browser.execute_script(
            "return Array.from(document.querySelectorAll('.chart svg'))"
            ".map(s => s.getAttribute('aria-label'))"
        )
        assert len(charts) == 3 and all(c and "tasks " in c for c in charts), charts

        errors = console_errors(browser)
        assert not errors, f"browser console errors: {errors}"

        # The whole page, beyond the window (Chrome DevTools Protocol).
        size = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        shot = browser.execute_cdp_cmd(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"]}
                | {"scale": 1},
            },
        )
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        SCREENSHOT.write_bytes(base64.b64decode(shot["data"]))
        print(f"\ndashboard screenshot: {SCREENSHOT}")

    data = SCREENSHOT.read_bytes()
    width, height = _png_size(data)
    assert width >= 1000 and height >= 800, (width, height)
    assert len(data) > 50_000, f"the screenshot is only {len(data)} bytes"


# --- 401 and 403 -------------------------------------------------------------------------------

ADMIN_TOKEN = "dashboard-admin-secret"


def _enter_token(driver: WebDriver, token: str) -> None:
    field = driver.find_element(By.ID, "token-input")
    field.clear()
    field.send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()


def test_dashboard_says_when_a_token_is_needed_or_not_enough(
    tmp_path: Path, browser: WebDriver
) -> None:
    with BrokerProcess(
        tmp_path / "data",
        log_path=tmp_path / "broker.log",
        env={
            **os.environ,
            "STEWARD_ADMIN_TOKEN": ADMIN_TOKEN,
            "STEWARD_WORKER_TOKEN": "dashboard-worker-secret",
        },
    ) as broker:
        broker.start()
        admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        response = httpx.post(
            broker.url + "/api/v1/tokens",
            json={"name": "acme-dashboard", "role": "tenant", "tenant": "acme"},
            headers=admin,
            timeout=10,
        )
        assert response.status_code == 201, response.text
        tenant_token = response.json()["token"]
        response = httpx.post(
            broker.url + "/api/v1/tasks",
            json={"type": "noop"},
            headers={"authorization": f"Bearer {tenant_token}"},
            timeout=10,
        )
        assert response.status_code == 201, response.text
        task_id = int(response.json()["id"])

        browser.get(broker.url + "/")  # the page itself needs no token
        state = _wait_page(
            browser, lambda s: "needs an API token (401)" in s["banner"], "that it needs a token"
        )
        assert state["brokers"] == [] and state["tasks"] == []
        assert "auth" in (browser.find_element(By.ID, "banner").get_attribute("class") or "")

        _enter_token(browser, "wrong")
        _wait_page(browser, lambda s: "token was refused (401)" in s["banner"], "a refusal")

        # A tenant's token reads its tasks and tenant, not the operator's views (403).
        _enter_token(browser, tenant_token)
        state = _wait_page(
            browser,
            lambda s: (
                "(403)" in s["banner"]
                and task_id in s["tasks"]
                and any(t["name"] == "acme" for t in s["tenants"])
            ),
            "the tenant's task and a 403 note",
        )
        assert "may not read everything" in state["banner"]
        assert state["brokers"] == []

        _enter_token(browser, ADMIN_TOKEN)
        state = _wait_page(
            browser,
            lambda s: (
                s["banner"] == ""
                and [b["leader"] for b in s["brokers"]] == [True]
                and task_id in s["tasks"]
            ),
            "everything, without a warning",
        )
        assert state["brokers"][0]["role"] == "standalone"
        # The "standal\u2026": a standalone broker's name, whole.
        assert state["leaderCard"].split("\n")[0] == "standalone", state["leaderCard"]
        assert state["leaderCardFits"], "the leader's name does not fit its card"

        # 401s and 403s are logged by Chrome as failed loads; no script error is allowed.
        script_errors = [e for e in console_errors(browser) if e.get("source") != "network"]
        assert not script_errors, f"browser console errors: {script_errors}"
