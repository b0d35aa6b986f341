"""Fixtures shared by the whole suite: the store matrix and the anyio event loops."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.stores import Store, StoreSpec, all_specs

# Session-scoped server fixtures of each backend family (each module lists them in __all__).
try:
    from tests.stores.postgres import *  # noqa: F403
except ModuleNotFoundError as exc:  # pragma: no cover - module not written yet
    if not (exc.name or "").startswith("tests.stores"):
        raise
try:
    from tests.stores.redis import *  # noqa: F403
except ModuleNotFoundError as exc:  # pragma: no cover - module not written yet
    if not (exc.name or "").startswith("tests.stores"):
        raise

SPECS = {spec.id: spec for spec in all_specs()}
# Modules that run whole schedulers: only on stores with ``scenarios=True``.
SCENARIO_MODULES = ("test_scenarios", "test_lifecycle", "test_events", "test_workflows",
                    "test_retention", "test_burst", "test_fleet", "test_retries",
                    "test_operations", "test_retry_at")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run tests using ``store`` on every (store, event loop) pair the store supports."""
    if "store" not in metafunc.fixturenames:
        if "anyio_backend" in metafunc.fixturenames and not _parametrizes_loop(metafunc):
            asyncio_only = metafunc.definition.get_closest_marker("asyncio_only")
            loops = ["asyncio"] if asyncio_only else ["asyncio", "trio"]
            metafunc.parametrize("anyio_backend", loops)
        return
    scenario_module = (metafunc.module.__name__.endswith(SCENARIO_MODULES)
                       or metafunc.definition.get_closest_marker("server_timing") is not None)
    combos = [
        pytest.param(loop, spec.id, id=f"{spec.id}-{loop}")
        for spec in SPECS.values()
        for loop in spec.anyio_backends
        if spec.scenarios or not scenario_module
    ]
    metafunc.parametrize(("anyio_backend", "store_id"), combos)


def _parametrizes_loop(metafunc: pytest.Metafunc) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "anyio_backend" in names:
            return True
    return False


@pytest.fixture
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The event loop of an async test: asyncio and trio (see pytest_generate_tests)."""
    return str(request.param)


@pytest.fixture
async def store(request: pytest.FixtureRequest, store_id: str) -> AsyncIterator[Store]:
    """An isolated store of the kind named by ``store_id``."""
    spec: StoreSpec = SPECS[store_id]
    made = await spec.make(request)
    try:
        yield made
    finally:
        await made.cleanup()


#: A test's ``record_property("reported", text)`` is printed in the terminal summary, so
#: a measurement a test does not assert (the status page's render time) shows in every
#: run's output, not only in a captured print; under xdist the workers' reports carry it.
REPORTED = "reported"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print what tests reported through ``record_property("reported", ...)``."""
    lines = [f"{report.nodeid}: {value}"
             for reports in terminalreporter.stats.values() for report in reports
             if getattr(report, "when", None) == "call"
             for name, value in getattr(report, "user_properties", ()) if name == REPORTED]
    if lines:
        terminalreporter.section("reported measurements")
        for line in lines:
            terminalreporter.write_line(line)


#: Modules whose tests each load the CPU for many seconds (whole fleets in subprocesses,
#: fault storms): under ``make test``'s ``--dist loadgroup`` they share one worker, so two
#: of them never starve each other's deadlines while the other workers run the rest.
HEAVY_MODULES = ("tests/chaos/test_chaos.py", "tests/test_demo_namespace.py",
                 "tests/test_differential.py", "tests/test_testing_kit.py",
                 "tests/test_pg_storm.py", "tests/test_cli.py", "tests/test_bank_close.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the tests of :data:`HEAVY_MODULES` in one xdist group (``heavy``)."""
    for item in items:
        if item.nodeid.split("::", 1)[0] in HEAVY_MODULES:
            item.add_marker(pytest.mark.xdist_group("heavy"))
