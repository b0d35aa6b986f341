"""The status page in a real headless browser: Debian's ``chromium``, driven through
``chromium-driver`` (selenium), against ``anarchon serve`` on a seeded PostgreSQL store.

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
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1200,1500")


async def _seed(dsn: str, table: str) -> None:
    backend = PostgresBackend(dsn, table=table)
    await backend.start()
    try:
        await seed(backend)
    finally:
        await backend.close()


async def _add_job(dsn: str, table: str, job: str) -> None:
    from lease_core.abc import ClaimRequest

    backend = PostgresBackend(dsn, table=table)
    await backend.start()
    try:
        await backend.claim(ClaimRequest(job, SLOT, "c", "t-" + job, 60_000))
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


@pytest.fixture
def served(pg16_server: PgServer, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """``anarchon serve`` on 127.0.0.1 over a seeded table: its base URL and the table."""
    table = unique_table()
    anyio.run(_seed, pg16_server.dsn, table)
    port = find_free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lease_core.cli", "serve", "--url", pg16_server.dsn,
         "--table", table, "--port", str(port)],
        env={**os.environ, "ANARCHON_TOKEN": TOKEN}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx2.get(f"{base}/jobs",
                                      headers={"Authorization": f"Bearer {TOKEN}"})
                if response.status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                output = (tmp_path / "serve.log").read_text()
                pytest.fail(f"anarchon serve did not answer: {output}")
            time.sleep(0.1)
        yield base, table
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        anyio.run(drop_tables, pg16_server.admin_dsn, table)


_READ_PAGE = """
const all = (root, selector) => Array.from(root.querySelectorAll(selector));
const run = (id) => {
  const card = document.querySelector(`[data-run="${id}"]`);
  if (!card) return null;
  return {
    status: card.dataset.status,
    steps: all(card, "tr[data-step]").map((row) => ({
      step: row.dataset.step, status: row.dataset.status,
      cells: all(row, "td").slice(0, 4).map((td) => td.textContent.trim()),
    })),
    events: all(card, "tr[data-event]").map((row) => row.dataset.event),
  };
};
return {runs: Array.from(arguments).map(run),
        state: document.getElementById("state").textContent};
"""


def test_page_shows_workflow_steps_and_recovery_log(
        browser: Any, served: tuple[str, str], pg16_server: PgServer, tmp_path: Path) -> None:
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, table = served
    wait = WebDriverWait(browser, 30, ignored_exceptions=(StaleElementReferenceException,))

    # Without the token the page says how to give it.
    browser.get(f"{base}/")
    wait.until(lambda d: "#token=" in d.find_element(By.ID, "state").text)
    assert "error" in browser.find_element(By.ID, "state").get_attribute("class")

    browser.get(f"{base}/#token={TOKEN}")
    failed_run = f'[data-run="close@{SLOT}"]'
    try:
        failed = wait.until(lambda d: d.find_element(
            By.CSS_SELECTOR, f'{failed_run}:has([data-event="escalated"])'))
    except TimeoutException:
        state = browser.find_element(By.ID, "state").text
        shown = browser.find_element(By.ID, "jobs").get_attribute("innerHTML")
        pytest.fail(f"the page did not show {failed_run}: {state!r}, {shown[:2000]}")
    # One script reads the whole page at once: the page redraws itself every few seconds,
    # and an element read across a redraw would be stale.
    page = browser.execute_script(_READ_PAGE, f"close@{SLOT}", f"close@{NEXT}", f"export@{SLOT}")
    failed = page["runs"][0]
    assert failed["status"] == "failed"
    assert {row["step"]: row["status"] for row in failed["steps"]} == {
        "snapshot": "completed", "interest": "escalated", "publish": "pending"}
    interest = next(row for row in failed["steps"] if row["step"] == "interest")
    assert interest["cells"] == ["interest", "escalated", "1", "a"]
    assert failed["events"] == ["started", "completed", "started", "escalated"]

    running = page["runs"][1]
    assert running["status"] == "running"
    assert [row["status"] for row in running["steps"]] == ["completed", "running", "pending"]
    holder = next(row for row in running["steps"] if row["step"] == "interest")["cells"][3]
    assert holder == "b"
    assert page["runs"][2]["status"] == "completed"
    assert "store time" in page["state"]

    screenshot = tmp_path / "status-page.png"
    assert browser.save_screenshot(str(screenshot))
    assert screenshot.read_bytes().startswith(b"\x89PNG") and screenshot.stat().st_size > 10_000

    # The page refreshes itself: a job recorded now appears without a reload.
    anyio.run(_add_job, pg16_server.dsn, table, "report")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '[data-job="report"]'))
