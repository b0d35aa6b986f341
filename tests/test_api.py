"""The public API: fixed names, StrEnums, and a docstring on every public name."""

from __future__ import annotations

import inspect

import lease_core
from lease_core import Outcome, Reason


def test_fixed_public_names_import_from_lease_core() -> None:
    for name in ("Scheduler", "MemoryBackend", "PostgresBackend", "RedisBackend",
                 "backend_from_url", "Attempt", "RunContext", "AnarchonError",
                 "ConfigurationError", "LeaseLost", "StoreFormatError", "BackendUnavailable"):
        assert getattr(lease_core, name) is not None


def test_reasons_and_outcomes_compare_equal_to_strings() -> None:
    assert Reason.HAND_OVER == "hand-over" and Reason.CATCH_UP == "catch-up"
    assert {o.value for o in Outcome} == {
        "completed", "failed", "timed_out", "lost", "handed_over", "escalated", "skipped",
        "cancelled",
    }
    assert {r.value for r in Reason} == {
        "scheduled", "takeover", "hand-over", "catch-up", "retry", "manual"}  # DESIGN 2.6


def test_every_public_name_has_a_docstring() -> None:
    missing = []
    for name in lease_core.__all__:
        obj = getattr(lease_core, name)
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(name)
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not (
                    inspect.isfunction(member) or isinstance(member, property)
                ):
                    continue
                if not (inspect.getdoc(member) or "").strip():
                    missing.append(f"{name}.{attr}")
    assert not missing, missing
