"""The status page in a real headless browser: Debian's ``chromium``, driven through
``chromium-driver`` (selenium), against ``anarchon serve`` on seeded PostgreSQL stores.

The page's three views are checked (the overview with its filters, search and pages; one
job's runs; one run's steps and recovery log), that a refresh sends one request, and a
store of 1,000 jobs, whose render time is in the terminal summary. With
``ANARCHON_SCREENSHOTS=DIR`` the screenshots are also written to ``DIR``
(``docs/pages/images`` holds the committed ones: ``make screenshots``).

``.ci/system-deps.sh`` installs both packages; without them the test skips, or fails under
``CI=true``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

from backends.embedded.postgres import find_free_port
from backends.postgres import PostgresBackend
from tests.stores import missing_service
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.test_http import NEXT, SLOT, seed

TOKEN = "page-Test-t0ken"
REPORTED = "reported"  # printed in the terminal summary (tests/conftest.py)
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1200,1500")


async def _seed(dsn: str, table: str) -> None:
    import json

    from lease_core.schedules import CronSchedule, IntervalSchedule

    backend = PostgresBackend(dsn, table=table)
    await backend.start()
    try:
        await seed(backend)
        # Schedules as a scheduler records them (a workflow's at its first step), so the
        # overview shows each one and its next slot.
        await backend.register_schedules({
            "export": json.dumps(IntervalSchedule("15m").spec()),
            "close/snapshot": json.dumps(CronSchedule("30 2 * * *").spec())})
    finally:
        await backend.close()


async def _add_job(dsn: str, table: str, job: str, failed: bool = False) -> None:
    """A run of ``job`` held by c; ``failed``: its attempt failed, its retry waits."""
    from lease_core.abc import ClaimRequest, Lease, Outcome

    backend = PostgresBackend(dsn, table=table)
    await backend.start()
    try:
        await backend.claim(ClaimRequest(job, SLOT, "c", "t-" + job, 60_000))
        if failed:
            assert await backend.retry_later([(Lease(job, SLOT, "t-" + job, 60_000),
                                               Outcome.FAILED, "boom", [3_600_000])]) == [1]
    finally:
        await backend.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """A headless chromium with a fresh profile, driven by chromium-driver."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        missing_service("Debian's chromium and chromium-driver "
                        "(apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing_service("selenium (pip install selenium)")
    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(options=options, service=Service(executable_path=str(driver)))
    try:
        yield chrome
    finally:
        chrome.quit()


@contextmanager
def _serve(server: PgServer, tmp_path: Path, token: str | None) -> Iterator[tuple[str, str]]:
    """``anarchon serve`` on 127.0.0.1 over a seeded table (with ``token`` when given)."""
    table = unique_table()
    anyio.run(_seed, server.dsn, table)
    port = find_free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / f"serve-{port}.log").open("w")
    env = {k: v for k, v in os.environ.items() if k != "ANARCHON_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lease_core.cli", "serve", "--url", server.dsn,
         "--table", table, "--port", str(port)],
        env=env if token is None else {**env, "ANARCHON_TOKEN": token},
        stdout=log, stderr=subprocess.STDOUT)
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx2.get(f"{base}/jobs", headers=headers)
                if response.status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                output = (tmp_path / f"serve-{port}.log").read_text()
                pytest.fail(f"anarchon serve did not answer: {output}")
            time.sleep(0.1)
        yield base, table
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        anyio.run(drop_tables, server.admin_dsn, table)


@pytest.fixture
def served(pg16_server: PgServer, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """``anarchon serve`` on 127.0.0.1 over a seeded table: its base URL and the table."""
    with _serve(pg16_server, tmp_path, TOKEN) as found:
        yield found


_READ_RUN = """
const all = (root, selector) => Array.from(root.querySelectorAll(selector));
const card = document.querySelector(`section[data-run="${arguments[0]}"]`);
if (!card) return null;
return {
  status: card.dataset.status,
  steps: all(card, "tr[data-step]").map((row) => ({
    step: row.dataset.step, status: row.dataset.status,
    cells: all(row, "td").slice(0, 4).map((td) => td.textContent.trim()),
  })),
  events: all(card, "tr[data-event]").map((row) => row.dataset.event),
  state: document.getElementById("state").textContent,
};
"""

_ROWS = """
return Array.from(document.querySelectorAll("#view tr[data-job]")).map((row) => ({
  name: row.dataset.job, kind: row.dataset.kind, state: row.dataset.state,
  running: Number(row.dataset.running),
  cells: Array.from(row.querySelectorAll("td")).map((td) => td.textContent.trim()),
}));
"""


def _shoot(browser: Any, tmp_path: Path, name: str) -> None:
    """A screenshot of the page as it is, kept in tmp_path and in $ANARCHON_SCREENSHOTS."""
    screenshot = tmp_path / name
    assert browser.save_screenshot(str(screenshot))
    assert screenshot.read_bytes().startswith(b"\x89PNG") and screenshot.stat().st_size > 10_000
    if os.environ.get("ANARCHON_SCREENSHOTS"):
        shutil.copy(screenshot, Path(os.environ["ANARCHON_SCREENSHOTS"]) / name)


def _rows(browser: Any, wait: Any, names: list[str]) -> list[dict[str, Any]]:
    """The overview's rows, once they are exactly ``names``."""
    found: list[dict[str, Any]] = []

    def shown(driver: Any) -> bool:
        found[:] = driver.execute_script(_ROWS)
        return [row["name"] for row in found] == names

    try:
        wait.until(shown)
    except Exception:
        pytest.fail(f"the overview showed {[r['name'] for r in found]}, not {names}: "
                    f"{browser.find_element('id', 'state').text!r}")
    return found


def test_page_overview_drill_down_and_recovery_log(
        browser: Any, served: tuple[str, str], pg16_server: PgServer, tmp_path: Path) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, table = served
    wait = WebDriverWait(browser, 30, ignored_exceptions=(StaleElementReferenceException,))

    # Without the token the page says how to give it.
    browser.get(f"{base}/")
    wait.until(lambda d: "#token=" in d.find_element(By.ID, "state").text)
    assert "error" in browser.find_element(By.ID, "state").get_attribute("class")

    # The overview: one row per job and workflow, the steps folded into their workflow.
    browser.get(f"{base}/#token={TOKEN}")
    rows = {row["name"]: row for row in _rows(browser, wait, ["close", "export"])}
    assert rows["close"]["kind"] == "workflow" and rows["close"]["state"] == "failed"
    assert rows["close"]["running"] == 1
    assert "attempt 1 by b" in rows["close"]["cells"][7]  # interest@NEXT, held by b
    assert rows["export"]["state"] == "ok" and (
        "handed over at a stop or retried, next attempt not claimed yet"
        in rows["export"]["cells"][7])
    assert "store time" in browser.find_element(By.ID, "state").text
    # The recorded schedules, and the next slot of each.
    assert rows["export"]["cells"][2] != "-" and rows["close"]["cells"][2] != "-"
    assert rows["export"]["cells"][6] != "-" and rows["close"]["cells"][6] != "-"
    _shoot(browser, tmp_path, "status-overview.png")

    # Filters and search narrow the rows; the fragment keeps the token.
    _press(wait, '[data-filter="failed"]')
    _rows(browser, wait, ["close"])
    assert "token=" in browser.current_url and "status=failed" in browser.current_url
    _press(wait, '[data-filter="all"]')
    _rows(browser, wait, ["close", "export"])
    browser.find_element(By.ID, "search").send_keys("EXP")
    _rows(browser, wait, ["export"])
    browser.find_element(By.ID, "search").clear()
    browser.find_element(By.ID, "search").send_keys(" ")
    _rows(browser, wait, ["close", "export"])

    # A refresh sends one request.
    before = browser.execute_script("return [anarchonRequests, anarchonRefreshes]")
    wait.until(lambda d: d.execute_script("return anarchonRefreshes") >= before[1] + 2)
    after = browser.execute_script("return [anarchonRequests, anarchonRefreshes]")
    assert after[0] - before[0] == after[1] - before[1] >= 2

    # Drill down: the workflow's runs, then the failed run's steps and recovery log.
    _press(wait, 'tr[data-job="close"] td a')
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-run="close@{NEXT}"]'))
    statuses = browser.execute_script(
        "return Array.from(document.querySelectorAll('tr[data-run]'))"
        ".map((row) => [row.dataset.run, row.dataset.status])")
    assert statuses == [[f"close@{NEXT}", "running"], [f"close@{SLOT}", "failed"]]
    _shoot(browser, tmp_path, "status-job.png")
    _press(wait, f'tr[data-run="close@{SLOT}"] a')
    wait.until(lambda d: d.find_elements(
        By.CSS_SELECTOR, f'section[data-run="close@{SLOT}"] [data-event="escalated"]'))
    failed = browser.execute_script(_READ_RUN, f"close@{SLOT}")
    assert failed["status"] == "failed"
    assert {row["step"]: row["status"] for row in failed["steps"]} == {
        "snapshot": "completed", "interest": "escalated", "publish": "pending"}
    interest = next(row for row in failed["steps"] if row["step"] == "interest")
    assert interest["cells"] == ["interest", "escalated", "1", "a"]
    assert failed["events"] == ["started", "completed", "started", "escalated"]
    _shoot(browser, tmp_path, "status-run.png")

    browser.get(f"{base}/#token={TOKEN}&run=close@{NEXT}")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'section[data-run="close@{NEXT}"]'))
    running = browser.execute_script(_READ_RUN, f"close@{NEXT}")
    assert running["status"] == "running"
    assert [row["status"] for row in running["steps"]] == ["completed", "running", "pending"]
    assert next(r for r in running["steps"] if r["step"] == "interest")["cells"][3] == "b"

    # The overview refreshes itself: a job recorded now appears without a reload.
    browser.get(f"{base}/#token={TOKEN}")
    _rows(browser, wait, ["close", "export"])
    anyio.run(_add_job, pg16_server.dsn, table, "report")
    _rows(browser, wait, ["close", "export", "report"])

    # A run waiting for its retry holds no lease: it is in progress, not expired.
    anyio.run(_add_job, pg16_server.dsn, table, "flaky", True)
    rows = {row["name"]: row for row in _rows(browser, wait,
                                               ["close", "export", "flaky", "report"])}
    assert "attempt 1 by c, failed, retry at " in rows["flaky"]["cells"][7]
    assert rows["flaky"]["state"] == "never" and rows["flaky"]["running"] == 1


async def _seed_many(dsn: str, table: str, jobs: int) -> None:
    """``jobs`` jobs every minute: a third completed, a third failed, a third running."""
    import json

    from lease_core.abc import ClaimRequest, Lease, Outcome
    from lease_core.schedules import IntervalSchedule

    backend = PostgresBackend(dsn, table=table)
    await backend.start()
    try:
        names = [f"job-{i:04d}" for i in range(jobs)]
        spec = json.dumps(IntervalSchedule("1m").spec())
        await backend.register_schedules({name: spec for name in names})
        requests = [ClaimRequest(name, SLOT, "host-" + str(i % 5), f"t-{name}", 600_000)
                    for i, name in enumerate(names)]
        for start in range(0, jobs, 250):
            await backend.claim_many(requests[start:start + 250])
        done = [(Lease(r.job, r.slot, r.token, 600_000),
                 Outcome.COMPLETED if i % 3 == 0 else Outcome.FAILED, None)
                for i, r in enumerate(requests) if i % 3 != 2]
        for start in range(0, len(done), 250):
            await backend.finish_many(done[start:start + 250])
    finally:
        await backend.close()


@pytest.fixture
def served_many(pg16_server: PgServer, tmp_path: Path) -> Iterator[str]:
    """``anarchon serve`` over a store of 1,000 jobs: its base URL."""
    table = unique_table()
    anyio.run(_seed_many, pg16_server.dsn, table, 1000)
    port = find_free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve-many.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lease_core.cli", "serve", "--url", pg16_server.dsn,
         "--table", table, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx2.get(f"{base}/overview?per_page=1").status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                output = (tmp_path / "serve-many.log").read_text()
                pytest.fail(f"anarchon serve did not answer: {output}")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        anyio.run(drop_tables, pg16_server.admin_dsn, table)


def test_page_with_1000_jobs(browser: Any, served_many: str, tmp_path: Path,
                            record_property: Any) -> None:
    """A store of 1,000 jobs: pages of 50 rows, filters with their counts; the render time
    is reported in pytest's terminal summary ("reported measurements"), not asserted (speed
    is measured in benchmarks/, not in tests)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60, ignored_exceptions=(StaleElementReferenceException,))
    started = time.monotonic()
    browser.get(f"{served_many}/")
    wait.until(lambda d: len(d.execute_script(_ROWS)) == 50)
    shown = time.monotonic() - started
    assert _text(wait, "#page") == "page 1 of 20, 1000 jobs"
    counts = {b.get_attribute("data-filter"): b.text
              for b in browser.find_elements(By.CSS_SELECTOR, "#filters button")}
    assert counts == {"all": "all (1000)", "running": "running (333)", "failed": "failed (333)",
                      "ok": "ok (334)", "never": "never (333)"}
    render_ms = browser.execute_script("return anarchonRenderMs")
    record_property(REPORTED, f"1,000 jobs: first page shown {shown * 1000:.0f} ms after "
                              f"navigation, rendered in {render_ms:.1f} ms")
    _shoot(browser, tmp_path, "status-1000-jobs.png")
    _press(wait, "#next")
    wait.until(lambda d: d.execute_script(_ROWS)[0]["name"] == "job-0050")
    _press(wait, '[data-filter="running"]')
    wait.until(lambda d: d.find_element(By.ID, "page").text == "page 1 of 7, 333 jobs")
    rows = browser.execute_script(_ROWS)
    assert len(rows) == 50 and all(row["running"] == 1 for row in rows)


def _press(wait: Any, selector: str) -> None:
    """Click the element ``selector`` (CSS) finds. The view redraws itself every few
    seconds: an element found just before a redraw is stale when clicked, so finding and
    clicking are tried again together (``wait`` ignores stale elements)."""
    from selenium.webdriver.common.by import By

    def press(driver: Any) -> bool:
        driver.find_element(By.CSS_SELECTOR, selector).click()
        return True

    wait.until(press)


def _text(wait: Any, selector: str) -> str:
    """The text of the element ``selector`` (CSS) finds, read again if a redraw made the
    element stale as it was read."""
    from selenium.webdriver.common.by import By

    found: list[str] = []

    def read(driver: Any) -> bool:
        found[:] = [driver.find_element(By.CSS_SELECTOR, selector).text]
        return True

    wait.until(read)
    return found[0]


def _click(wait: Any, operation: str, within: str = "") -> str:
    """Press the operation's button (inside the CSS selector ``within``, when given); what
    the page answered (``"<operation>: ..."``)."""
    from selenium.webdriver.common.by import By

    # The view redraws itself every few seconds: a button found just before a redraw
    # is stale when clicked, so finding and clicking are tried again together.
    def press(driver: Any) -> bool:
        driver.find_element(By.CSS_SELECTOR,
                            f'{within} button[data-operation="{operation}"]'.strip()).click()
        return True

    wait.until(press)
    shown: list[str] = []

    def answered(driver: Any) -> bool:
        found = driver.find_elements(By.ID, "op-result")
        shown[:] = [found[0].text] if found else []
        return bool(shown) and shown[0].startswith(operation + ":")

    wait.until(answered)
    return shown[0]


def test_page_operations_buttons_act_through_the_store(
        browser: Any, served: tuple[str, str], pg16_server: PgServer) -> None:
    """With the token: trigger/pause/resume on a job, retry/cancel on a run, paused rows."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, table = served
    wait = WebDriverWait(browser, 30, ignored_exceptions=(StaleElementReferenceException,))

    def click(operation: str, within: str = "") -> str:
        return _click(wait, operation, within)

    browser.get(f"{base}/#token={TOKEN}&job=export")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, 'button[data-operation="pause"]'))
    assert click("pause") == "pause: done"
    browser.get(f"{base}/#token={TOKEN}")
    rows = {row["name"]: row for row in _rows(browser, wait, ["close", "export"])}
    assert rows["export"]["cells"][0] == "export paused"
    assert rows["close"]["cells"][0] == "close"

    browser.get(f"{base}/#token={TOKEN}&job=export")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, 'button[data-operation="trigger"]'))
    text = click("trigger")
    assert text.startswith("trigger: done (export@")
    triggered = text.split("(", 1)[1].rstrip(")")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-run="{triggered}"]'))
    assert click("resume") == "resume: done"

    # A completed run cannot be retried: the answer (409) is shown, nothing changes.
    # (Only the hash changes, so the view of the previous address stays until the new one
    # is drawn: each button is looked for inside the section of its own run.)
    browser.get(f"{base}/#token={TOKEN}&run=export@{SLOT}")
    done_run = f'section[data-run="export@{SLOT}"]'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR,
                                         f'{done_run} button[data-operation="retry"]'))
    assert "it is completed" in click("retry", done_run)
    # The handed-over run is cancelled.
    browser.get(f"{base}/#token={TOKEN}&run=export@{NEXT}")
    next_run = f'section[data-run="export@{NEXT}"]'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR,
                                         f'{next_run} button[data-operation="cancel"]'))
    assert click("cancel", next_run) == f"cancel: done (export@{NEXT})"
    wait.until(lambda d: d.find_elements(
        By.CSS_SELECTOR, f'section[data-run="export@{NEXT}"] .status.cancelled'))

    async def stored() -> tuple[dict[int, str], dict[str, str]]:
        backend = PostgresBackend(pg16_server.dsn, table=table)
        await backend.start()
        try:
            runs = {r.slot: str(r.status) for r in await backend.runs("export")}
            return runs, await backend.paused()
        finally:
            await backend.close()

    runs, paused = anyio.run(stored)
    assert paused == {}
    assert runs[SLOT] == "completed" and runs[NEXT] == "cancelled"
    assert runs[int(triggered.split("@")[1])] == "handed_over"

    # The overview no longer marks the job.
    browser.get(f"{base}/#token={TOKEN}")
    rows = {row["name"]: row for row in _rows(browser, wait, ["close", "export"])}
    assert rows["export"]["cells"][0] == "export"


def test_page_says_a_triggered_run_is_queued_not_held(
        browser: Any, served: tuple[str, str]) -> None:
    """A trigger's run has no attempt yet, and its instance_id names who asked (``http``):
    the page said "attempt 0 by http, handed over, waiting for a backup" (overview) and
    "attempt 0 by http" (its job's and its own view), a holder that never held it, where
    ``anarchon status`` says "queued by http, not claimed yet"."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, _ = served
    wait = WebDriverWait(browser, 30, ignored_exceptions=(StaleElementReferenceException,))
    answer = httpx2.post(f"{base}/jobs/export/trigger",
                         headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200, answer.text
    triggered = answer.json()["id"]
    queued = "queued by http, not claimed yet"

    browser.get(f"{base}/#token={TOKEN}")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-job="export"]'))
    cell = _text(wait, 'tr[data-job="export"] td:nth-child(8)')
    assert queued in cell and "attempt 0" not in cell, cell

    browser.get(f"{base}/#token={TOKEN}&job=export")
    row = f'tr[data-run="{triggered}"]'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, row))
    assert _text(wait, f"{row} td:nth-child(3)") == queued

    browser.get(f"{base}/#token={TOKEN}&run={triggered}")
    card = f'section[data-run="{triggered}"]'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, card))
    text = _text(wait, f"{card} p.muted")
    assert text.startswith(queued), text


async def _add_retrying_step(dsn: str, table: str) -> None:
    """Workflow ``books``: its step ``post`` at SLOT failed, its retry due in an hour."""
    from lease_core.abc import ClaimRequest, Lease, Outcome

    backend = PostgresBackend(dsn, table=table)
    await backend.start()
    try:
        await backend.register_workflows({"books": ["post"]})
        await backend.claim(ClaimRequest("books/post", SLOT, "c", "t-books", 60_000))
        assert await backend.retry_later([(Lease("books/post", SLOT, "t-books", 60_000),
                                           Outcome.FAILED, "boom", [3_600_000])]) == [1]
    finally:
        await backend.close()


def test_page_shows_when_a_waiting_retry_is_due(
        browser: Any, served: tuple[str, str], pg16_server: PgServer) -> None:
    """A run (or a workflow's step) waiting for its retry holds no lease: the page said
    "failed, waiting for its retry" and showed no time. It shows "retry at HH:MM:SSZ"
    (the API's ``retry_at``) in the overview, the job's runs, the run's view and the
    step's lease column."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, table = served
    wait = WebDriverWait(browser, 30, ignored_exceptions=(StaleElementReferenceException,))
    anyio.run(_add_job, pg16_server.dsn, table, "flaky", True)
    anyio.run(_add_retrying_step, pg16_server.dsn, table)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    run = httpx2.get(f"{base}/jobs/flaky@{SLOT}", headers=headers).json()
    assert run["store_status"] == "retrying" and run["lease_expires_at"] is None
    due = run["retry_at"]
    (step,) = httpx2.get(f"{base}/jobs/books@{SLOT}", headers=headers).json()["steps"]
    step_due = step["retry_at"]
    assert step["store_status"] == "retrying" and step["lease_expires_at"] is None
    assert due is not None and step_due is not None

    def retry_at(selector: str, when: str) -> str:
        """The text of ``selector``, once it shows the retry due at ``when``."""
        def shown(driver: Any) -> bool:
            found = driver.find_elements(By.CSS_SELECTOR, f"{selector} .retry-at time")
            return bool(found) and found[0].get_attribute("datetime") == when

        wait.until(shown)
        text = _text(wait, selector)
        assert f"retry at {when[11:19]}" in text, text  # HH:MM:SS, with its date if not today
        return str(text)

    browser.get(f"{base}/#token={TOKEN}")
    text = retry_at('tr[data-job="flaky"] td:nth-child(8)', due)
    assert text.startswith("attempt 1 by c, failed, retry at "), text
    text = retry_at('tr[data-job="books"] td:nth-child(8)', step_due)
    assert text.startswith("post: attempt 1 by c, failed, retry at "), text
    held = _text(wait, 'tr[data-job="close"] td:nth-child(8)')
    assert "lease" in held and "retry at" not in held, held  # a running run: its lease

    browser.get(f"{base}/#token={TOKEN}&job=flaky")
    text = retry_at(f'tr[data-run="flaky@{SLOT}"] td:nth-child(3)', due)
    assert text.startswith("attempt 1 by c, retry at "), text

    browser.get(f"{base}/#token={TOKEN}&run=flaky@{SLOT}")
    text = retry_at(f'section[data-run="flaky@{SLOT}"] p.muted', due)
    assert text.startswith("attempt 1 by c (retrying), retry at "), text

    browser.get(f"{base}/#token={TOKEN}&run=books@{SLOT}")
    text = retry_at(f'section[data-run="books@{SLOT}"] tr[data-step="post"] td:nth-child(7)',
                    step_due)
    assert text.startswith("retry at "), text
    browser.get(f"{base}/#token={TOKEN}&run=close@{NEXT}")
    cell = f'section[data-run="close@{NEXT}"] tr[data-step="interest"] td:nth-child(7)'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, cell))
    lease = _text(wait, cell)
    assert lease != "-" and "retry" not in lease, lease  # running: when its lease expires


def test_page_without_a_token_shows_no_operations(
        browser: Any, pg16_server: PgServer, tmp_path: Path) -> None:
    """A server without a token (127.0.0.1): the page reads, but offers no operation."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 30)
    with _serve(pg16_server, tmp_path, None) as (base, _):
        browser.get(f"{base}/#job=export")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-run="export@{SLOT}"]'))
        assert browser.find_elements(By.CSS_SELECTOR, "button[data-operation]") == []
        browser.get(f"{base}/#run=export@{SLOT}")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'section[data-run="export@{SLOT}"]'))
        assert browser.find_elements(By.CSS_SELECTOR, "button[data-operation]") == []
        response = httpx2.post(f"{base}/jobs/export/pause")
        assert response.status_code == 403 and "ANARCHON_TOKEN" in response.json()["error"]


def test_page_takes_a_base64_token_with_plus_signs_as_typed(
        browser: Any, pg16_server: PgServer, tmp_path: Path) -> None:
    """``#token=`` as pasted from ``openssl rand -base64``: its "+" is not a space (the
    page sent "Bearer a b..." and every request got 401). A search with a space still
    goes through the fragment and back."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    token = "Zm9v+YmFy/w+=="
    wait = WebDriverWait(browser, 30)
    with _serve(pg16_server, tmp_path, token) as (base, _):
        browser.get(f"{base}/#token={token}&job=export")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-run="export@{SLOT}"]'))
        assert browser.find_elements(By.CSS_SELECTOR, "button[data-operation]") != []
        browser.execute_script("go({q: 'no such'})")
        wait.until(lambda d: "q=no%20such" in d.current_url)
        assert browser.execute_script("return params().get('q')") == "no such"
        assert browser.execute_script("return params().get('token')") == token


def test_page_takes_a_token_with_an_ampersand_as_typed(
        browser: Any, pg16_server: PgServer, tmp_path: Path) -> None:
    """A token from a password generator, with "&" in it, given as typed
    (``#token=p&ss=w0rd``): the page sent only "p" (the "&" ended the value) and every read
    got 401. The token keeps its "&" across a change of view, and the view's key after it
    is still read."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    token = "p&ss=w0rd&x"
    wait = WebDriverWait(browser, 30)
    with _serve(pg16_server, tmp_path, token) as (base, _):
        browser.get(f"{base}/#token={token}&job=export")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-run="export@{SLOT}"]')
                   or "401" in d.find_element(By.ID, "state").text
                   or "bearer token" in d.find_element(By.ID, "state").text)
        assert browser.find_elements(By.CSS_SELECTOR, f'tr[data-run="export@{SLOT}"]'), \
            browser.find_element(By.ID, "state").text
        browser.execute_script("go({})")
        _rows(browser, wait, ["close", "export"])
        assert browser.execute_script("return params().get('token')") == token


async def _stored(dsn: str, table: str, jobs: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """``job@slot -> status`` of every run of ``jobs``, and the paused jobs by their names."""
    from lease_core.operations import Admin

    backend = PostgresBackend(dsn, table=table)
    await backend.start()
    try:
        runs = {f"{job}@{r.slot}": str(r.status) for job in jobs for r in await backend.runs(job)}
        return runs, await Admin(backend).paused()
    finally:
        await backend.close()


def test_page_workflow_operations_act_through_the_store(
        browser: Any, served: tuple[str, str], pg16_server: PgServer) -> None:
    """A workflow's view has trigger/pause/resume, a workflow run's view retry/cancel: each
    acts on the workflow by its name (the operations find the step)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, table = served
    wait = WebDriverWait(browser, 30, ignored_exceptions=(StaleElementReferenceException,))
    steps = ["close/snapshot", "close/interest", "close/publish"]

    browser.get(f"{base}/#token={TOKEN}&job=close")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, 'button[data-operation="pause"]'))
    assert _click(wait, "pause") == "pause: done"
    assert anyio.run(_stored, pg16_server.dsn, table, steps)[1] == {"close": "http"}
    text = _click(wait, "trigger")
    assert text.startswith("trigger: done (close@"), text
    triggered = int(text.split("@", 1)[1].rstrip(")"))
    runs = anyio.run(_stored, pg16_server.dsn, table, steps)[0]
    assert runs[f"close/snapshot@{triggered}"] == "handed_over"  # waits for an instance
    assert _click(wait, "resume") == "resume: done"
    assert anyio.run(_stored, pg16_server.dsn, table, steps)[1] == {}

    # The failed run resumes at the step that escalated; the running one is cancelled at
    # its step in progress.
    browser.get(f"{base}/#token={TOKEN}&run=close@{SLOT}")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, 'button[data-operation="retry"]'))
    assert _click(wait, "retry") == f"retry: done (close@{SLOT})"
    browser.get(f"{base}/#token={TOKEN}&run=close@{NEXT}")
    # The view of close@SLOT, redrawn after the retry, has a cancel button too (its run is
    # open again) until this view replaces it: the button is looked for in this view.
    view = f'section[data-run="close@{NEXT}"]'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR,
                                         f'{view} button[data-operation="cancel"]'))
    assert _click(wait, "cancel", view) == f"cancel: done (close@{NEXT})"
    runs = anyio.run(_stored, pg16_server.dsn, table, steps)[0]
    assert runs[f"close/interest@{SLOT}"] not in ("escalated", "failed"), runs
    assert runs[f"close/snapshot@{SLOT}"] == "completed"
    assert runs[f"close/interest@{NEXT}"] == "cancelled"
    assert runs[f"close/snapshot@{NEXT}"] == "completed"


def test_page_shows_paused_without_a_token(
        browser: Any, pg16_server: PgServer, tmp_path: Path) -> None:
    """Paused is state, not an operation: the overview marks it without a token too."""
    from selenium.webdriver.support.ui import WebDriverWait

    from lease_core.operations import Admin

    async def pause(table: str) -> None:
        await Admin(PostgresBackend(pg16_server.dsn, table=table), by="ops").pause("close")

    wait = WebDriverWait(browser, 30)
    with _serve(pg16_server, tmp_path, None) as (base, table):
        browser.get(f"{base}/")
        rows = {row["name"]: row for row in _rows(browser, wait, ["close", "export"])}
        assert rows["close"]["cells"][0] == "close"
        anyio.run(pause, table)
        wait.until(lambda d: {r["name"]: r["cells"][0] for r in d.execute_script(_ROWS)}
                   == {"close": "close paused", "export": "export"})


#: Holds the page's next request to ``arguments[0]`` (a path prefix) until ``release()``;
#: ``hang`` holds it until the page aborts it, as an unanswered request is. Counts POSTs.
_HOLD = """
const real = window.fetch, prefix = arguments[0], hang = arguments[1];
let release;
const gate = new Promise((resolve) => { release = resolve; });
window.release = release;
window.posts = 0;
window.fetch = (path, init) => {
  if (init && init.method === "POST") window.posts += 1;
  if (!String(path).startsWith(prefix)) return real(path, init);
  if (!hang) window.fetch = real;
  return new Promise((resolve, reject) => {
    if (init.signal) {
      init.signal.addEventListener("abort", () => { if (hang) reject(init.signal.reason); });
    }
    gate.then(() => resolve(real(path, init)));
  });
};
window.unhold = () => { window.fetch = real; };
"""

#: ``document.hidden`` made settable (``setHidden``), as a tab in the background has it.
_VISIBILITY = """
let hidden = false;
Object.defineProperty(document, "hidden", { configurable: true, get: () => hidden });
window.setHidden = (value) => {
  hidden = value;
  document.dispatchEvent(new Event("visibilitychange"));
};
"""

#: The text of every live region (what screen readers announce when it changes).
_LIVE = """return Array.from(document.querySelectorAll('[role=status], [role=alert], [aria-live]'))
  .map((node) => node.textContent)"""


def test_page_keeps_its_view_focus_and_word_across_refreshes_and_errors(
        browser: Any, served: tuple[str, str], pg16_server: PgServer) -> None:
    """What a refresh must not do: draw a slower, older answer over a newer view (a click
    on a job during a slow overview read showed the overview again, with another job's
    buttons possible), take the keyboard's focus away, wait forever for a request that
    never answers, show a failed read's view as current, or announce the store time to
    screen readers every 3 s; and the words: a search matching nothing is not an empty
    store, an operation's answer stays with its view, a double click triggers once. Names
    are text, never HTML."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, table = served
    wait = WebDriverWait(browser, 20, poll_frequency=0.05,
                         ignored_exceptions=(StaleElementReferenceException,))
    html = '<img src=x onerror="window.pwned = 1">'
    anyio.run(_add_job, pg16_server.dsn, table, html)
    browser.get(f"{base}/#token={TOKEN}")
    _rows(browser, wait, [html, "close", "export"])
    assert browser.execute_script("return [window.pwned, document.querySelectorAll("
                                  "'#view img').length]") == [None, 0]

    # A search that matches nothing, in a store that has jobs.
    browser.execute_script("go({q: 'no such job'})")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#view p.empty"))
    assert _text(wait, "#view p.empty") == "no job matches"
    browser.execute_script("go({})")
    _rows(browser, wait, [html, "close", "export"])

    # The focused link is focused again in the next drawing; the live region says nothing
    # of a plain refresh, though the store time changes.
    old = browser.find_element(By.CSS_SELECTOR, 'tr[data-job="export"] td a')
    live, state = browser.execute_script(_LIVE), browser.find_element(By.ID, "state").text
    browser.execute_script("window.old = arguments[0]; old.focus(); refresh()", old)
    wait.until(lambda d: not d.execute_script("return old.isConnected"))
    focused = browser.execute_script("return document.activeElement.dataset.key")
    assert focused == 'go {"job":"export"}'
    wait.until(lambda d: d.find_element(By.ID, "state").text != state)
    assert browser.execute_script(_LIVE) == live

    # A slow overview read, then a click to a job: the overview never comes back.
    browser.execute_script(_HOLD + "window.slow = refresh();", "overview", False)
    browser.execute_script("go({job: 'export'})")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-run="export@{SLOT}"]'))
    browser.execute_async_script("release(); slow.then(arguments[arguments.length - 1])")
    assert browser.execute_script(_ROWS) == []
    assert browser.find_elements(By.CSS_SELECTOR, f'tr[data-run="export@{SLOT}"]')

    # A double click triggers once; the answer is shown and announced.
    posts = browser.execute_script(
        _HOLD + "const b = document.querySelector('button[data-operation=\"trigger\"]');"
        "b.click(); b.click(); return window.posts", "nothing", False)
    assert posts == 1
    wait.until(lambda d: d.find_element(By.ID, "op-result").text.startswith("trigger: done"))
    assert browser.find_element(By.ID, "op-result").text in browser.execute_script(_LIVE)
    assert len(anyio.run(_stored, pg16_server.dsn, table, ["export"])[0]) == 3

    # An operation never answered is reported after the timeout, and the buttons work
    # again (they stayed disabled for good).
    browser.execute_script(_HOLD + "TIMEOUT_MS = 300;", "jobs/export/pause", True)
    assert _click(wait, "pause").startswith("pause: no answer in 0.3 s; it may still have")
    browser.execute_script("unhold(); TIMEOUT_MS = 10000")
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, 'button[data-operation="pause"]')
               .get_attribute("aria-disabled") == "false")
    assert anyio.run(_stored, pg16_server.dsn, table, ["export"])[1] == {}

    # A hidden tab reads nothing; shown again, it reads at once.
    browser.execute_script(_VISIBILITY + "REFRESH_MS = 100; refresh()")
    counts = browser.execute_script("return [anarchonRefreshes, anarchonRequests]")
    wait.until(lambda d: d.execute_script("return anarchonRefreshes") >= counts[0] + 3)
    hidden = browser.execute_async_script(
        "const done = arguments[arguments.length - 1]; setHidden(true);"
        "const before = [anarchonRefreshes, anarchonRequests];"
        "setTimeout(() => done([before, [anarchonRefreshes, anarchonRequests]]), 1000)")
    assert hidden[1] == hidden[0], hidden  # ten refresh periods: no refresh, no request
    browser.execute_script("REFRESH_MS = 3000; setHidden(false)")
    assert browser.execute_script("return anarchonRefreshes") >= hidden[1][0] + 1

    # A run's answer is not shown in the job's view the browser goes back to.
    browser.execute_script(f"go({{run: 'export@{SLOT}'}})")
    done_run = f'section[data-run="export@{SLOT}"]'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'{done_run} button'))
    assert "it is completed" in _click(wait, "retry", done_run)
    browser.back()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-run="export@{SLOT}"]'))
    assert browser.find_elements(By.ID, "op-result") == []

    # A request that never answers is an error after the timeout, not a wait forever.
    browser.execute_script(_HOLD + "TIMEOUT_MS = 300; refresh();", "runs/", True)
    wait.until(lambda d: "no answer in 0.3 s" in d.find_element(By.ID, "state").text)
    browser.execute_script("unhold(); TIMEOUT_MS = 10000")

    # The store cannot be read (503): the view read before is dimmed and said to be;
    # another view's is not shown as this one's.
    anyio.run(drop_tables, pg16_server.admin_dsn, table)
    browser.execute_script("refresh()")
    wait.until(lambda d: "cannot read the store" in d.find_element(By.ID, "state").text)
    assert "earlier read" in browser.find_element(By.ID, "state").text
    assert "stale" in browser.find_element(By.ID, "view").get_attribute("class")
    assert browser.find_elements(By.CSS_SELECTOR, f'tr[data-run="export@{SLOT}"]')
    assert any("cannot read the store" in text for text in browser.execute_script(_LIVE))
    browser.execute_script("go({})")
    wait.until(lambda d: d.find_element(By.ID, "view").text == "")
    assert "cannot read the store" in browser.find_element(By.ID, "state").text
