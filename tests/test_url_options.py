"""Options through ``backend_from_url``: keywords, URL query parameters, ``namespace``."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from backends.embedded.redis import EmbeddedRedis
from backends.memory import MemoryBackend
from backends.postgres import PostgresBackend
from backends.redis import RedisBackend
from lease_core import ConfigurationError, backend_from_url
from lease_core._registry import known_schemes
from lease_core._structures import ClaimRequest, ClaimStatus
from tests.helpers import install_toy_backend
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.stores.redis import delete_prefix

# --- no server needed ---------------------------------------------------------------------


def test_table_and_prefix_from_the_query_the_keyword_or_namespace() -> None:
    pg = "postgresql://app@db/app"
    for url, options in ((f"{pg}?table=jobs", {}), (pg, {"table": "jobs"}),
                         (pg, {"namespace": "jobs"}), (f"{pg}?namespace=jobs", {}),
                         (f"{pg}?table=jobs", {"namespace": "jobs"}),
                         ("host=db user=app table=jobs", {})):
        backend = backend_from_url(url, **options)
        assert isinstance(backend, PostgresBackend) and backend.table == "jobs", url
    for url, options in (("redis://db/0?prefix=p1", {}), ("redis://db/0", {"prefix": "p1"}),
                         ("redis://db/0", {"namespace": "p1"}),
                         ("redis://db/0?namespace=p1", {"prefix": "p1"})):
        backend = backend_from_url(url, **options)
        assert isinstance(backend, RedisBackend) and backend.prefix == "p1", url
    assert isinstance(backend_from_url("memory://", namespace="x"), MemoryBackend)
    assert isinstance(backend_from_url("memory://?namespace=x"), MemoryBackend)


def test_backend_level_parameters_are_taken_out_of_the_url() -> None:
    backend = backend_from_url("postgresql://app@db/app?table=jobs&sslmode=disable"
                               "&min_size=2&max_size=3&timeout=2s&application_name=x")
    assert isinstance(backend, PostgresBackend)
    assert backend._connection == "postgresql://app@db/app?sslmode=disable&application_name=x"
    assert backend._options == {"min_size": 2, "max_size": 3, "timeout": 2.0}
    redis = backend_from_url("redis://db/0?prefix=p&wait_replicas=1&wait_timeout=2s"
                             "&socket_timeout=5")
    assert isinstance(redis, RedisBackend)
    assert redis._connection == "redis://db/0?socket_timeout=5"
    assert (redis.prefix, redis.wait_replicas, redis.wait_timeout) == ("p", 1, 2.0)


def test_the_driver_gets_its_parameters_as_written() -> None:
    """A space written %20 stays %20 (re-encoded it became '+', which libpq does not
    decode: ``options=-c+statement_timeout...`` failed to connect)."""
    from backends.postgres import driver_dsn
    from lease_core._registry import split_url_options

    kept = "options=-c%20statement_timeout%3D5000&application_name=my%20app&sslmode=disable"
    url = f"postgresql+psycopg://app@db/app?table=jobs&{kept}&max_size=3"
    assert driver_dsn(url) == f"postgresql://app@db/app?{kept}"
    assert split_url_options("redis://db/0?client_name=a%20b&prefix=p", ["prefix"]) == (
        "redis://db/0?client_name=a%20b", {"prefix": "p"})


def test_a_redis_url_s_bad_ssl_cert_reqs_is_refused_before_connecting() -> None:
    """redis-py refuses it only as it first connects, which looked like a store that
    cannot be reached."""
    with pytest.raises(ConfigurationError,
                       match="ssl_cert_reqs='bogus' must be one of none, optional"):
        backend_from_url("rediss://db/0?ssl_cert_reqs=bogus")
    assert isinstance(backend_from_url("rediss://db/0?ssl_cert_reqs=none"), RedisBackend)


@pytest.mark.parametrize("url", ["redis://:secret@db/0?ssl_ca_certs=/etc/ssl/ca.pem",
                                 "unix:///run/redis.sock?db=1&ssl_cert_reqs=none"])
def test_tls_options_on_a_url_without_tls_are_refused_before_connecting(url: str) -> None:
    """redis-py keeps them for its plain connection, which refused them with a TypeError
    at start(): a URL meant for TLS (rediss://) that says nothing of it."""
    with pytest.raises(ConfigurationError, match=r"apply to TLS only.*write rediss://") as caught:
        backend_from_url(url)
    assert "secret" not in str(caught.value)
    assert isinstance(backend_from_url("rediss://:secret@db/0?ssl_cert_reqs=none"),
                      RedisBackend)


def test_a_rediss_url_s_missing_tls_file_or_bad_tls_version_is_refused_before_connecting(
    tmp_path: Path,
) -> None:
    """A missing CA file failed each connection with "Error 2 connecting to host:port.
    No such file or directory" (the store said to be unreachable, exit 1), and a
    ssl_min_version that is no TLS version with a bare ValueError at start()."""
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    for query, must in ((f"ssl_ca_certs={tmp_path}/none.pem", "not a readable file"),
                        (f"ssl_certfile={tmp_path}", "not a readable file"),
                        (f"ssl_ca_path={ca}", "not a readable directory"),
                        ("ssl_min_version=99", "must be a number of Python's ssl.TLSVersion")):
        for scheme in ("rediss://:secret@db/0", "rediss+cluster://:secret@db:7000"):
            with pytest.raises(ConfigurationError, match=must) as caught:
                backend_from_url(f"{scheme}?{query}")
            assert "secret" not in str(caught.value)
    assert isinstance(backend_from_url(
        f"rediss://db/0?ssl_ca_certs={ca}&ssl_ca_path={tmp_path}&ssl_min_version=771"),
        RedisBackend)


@pytest.mark.parametrize(("url", "must"), [
    ("redis://db/0?max_connections=4&max_connections=32",
     "gives 'max_connections' twice, as '4' and '32'; give it once"),
    ("redis://db/0?password=s3cr3t&password=0th3r", "gives 'password' twice; give it once"),
    ("rediss://db:6380/2?db=3", "names database 2 in its path and 3 in ?db=; name it once"),
    ("redis://:s3cr3t@db/0?password=0th3r", "gives a password before the host and another"),
    ("redis://alice:pw@db/0?username=bob", "gives a username before the host and another"),
])
def test_a_redis_url_that_says_two_things_is_refused(url: str, must: str) -> None:
    """redis-py reads the first of a repeated parameter (a Sentinel URL, and libpq for
    PostgreSQL, the last), lets ?db= win over the path and the user and password before
    the host win over the query's: the pool was silently 4 connections, the database 3,
    the password the first."""
    with pytest.raises(ConfigurationError, match=re.escape(must)) as caught:
        backend_from_url(url)
    assert "s3cr3t" not in str(caught.value) and "0th3r" not in str(caught.value)
    for same in ("redis://db/0?max_connections=4&max_connections=4", "redis://db/3?db=3",
                 "redis://db?db=3", "unix:///run/redis.sock?db=3",
                 "redis://:p%40ss@db/0?password=p%40ss", "redis://db/0?password=x"):
        assert isinstance(backend_from_url(same), RedisBackend)


@pytest.mark.parametrize("url", ["postgresql://app:secret@[::1/db",
                                 "redis://:secret@[fe80::1:6379/0",
                                 "postgresql+pg8000://app:secret@db]/app"])
def test_a_url_that_cannot_be_read_is_refused_naming_it_without_its_password(
        url: str) -> None:
    with pytest.raises(ConfigurationError, match="cannot be read") as info:
        backend_from_url(url)
    assert "secret" not in str(info.value) and "***" in str(info.value)


@pytest.mark.parametrize(
    ("url", "options", "named", "accepted"),
    [
        ("memory://", {"table": "x"}, "'table'", "namespace"),
        ("memory://?table=x", {}, "'table'", "namespace"),
        ("postgresql://db/app", {"prefix": "x"}, "'prefix'", "table"),
        ("postgresql://db/app", {"pool_size": 3}, "'pool_size'", "max_size"),
        ("redis://db/0", {"table": "x"}, "'table'", "prefix"),
        ("redis://db/0?table=x", {}, "'table'", "socket_timeout"),
        ("redis://db/0?max_size=3", {}, "'max_size'", "max_connections"),
    ],
)
def test_an_unknown_option_is_named_with_the_accepted_ones(
    url: str, options: dict[str, object], named: str, accepted: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        backend_from_url(url, **options)
    assert named in str(info.value) and accepted in str(info.value)


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("postgresql://db/app?table=a", {"table": "b"}),
        ("postgresql://db/app?table=a&namespace=b", {}),
        ("postgresql://db/app", {"table": "a", "namespace": "b"}),
        ("postgresql://db/app?timeout=a", {"timeout": "b"}),
        ("redis://db/0?prefix=a", {"namespace": "b"}),
        ("redis://db/0?prefix=a", {"prefix": "b"}),
        ("redis://db/0?prefix=a&prefix=b", {}),
    ],
)
def test_one_option_given_two_different_values_is_refused(
    url: str, options: dict[str, object]
) -> None:
    with pytest.raises(ConfigurationError, match=r"'a'.*'b'|'b'.*'a'"):
        backend_from_url(url, **options)


def test_the_same_value_given_both_ways_is_accepted() -> None:
    backend = backend_from_url("postgresql://db/app?table=a&max_size=2", table="a", max_size=2)
    assert isinstance(backend, PostgresBackend) and backend.table == "a"
    # The same number written another way (they were compared as text, and refused).
    backend_from_url("postgresql://db/app?timeout=10", timeout=10.0)
    with pytest.raises(ConfigurationError, match=r"timeout=10\.5 and timeout='10'"):
        backend_from_url("postgresql://db/app?timeout=10", timeout=10.5)


@pytest.mark.parametrize("bad", ["min_size=0", "max_size=x", "timeout=soon"])
def test_a_bad_pool_value_in_the_query_is_named(bad: str) -> None:
    with pytest.raises(ConfigurationError, match=bad.split("=")[0]):
        backend_from_url(f"postgresql://db/app?{bad}")


@pytest.mark.parametrize(
    ("url", "value", "must"),
    [
        ("redis://db/0?max_connections=abc", "max_connections='abc'", ", at least 1"),
        ("redis://db/0?max_connections=-1", "max_connections='-1'", ", at least 1"),
        ("redis://db/0?socket_timeout=abc", "socket_timeout='abc'", "a number"),
        ("redis://db/0?health_check_interval=x", "health_check_interval='x'", "a whole number"),
        # redis-py's own parsers took these, and start() raised the socket's ValueError,
        # or said the store could not be reached
        ("redis://db/0?socket_timeout=nan", "socket_timeout='nan'",
         "a number of seconds, more than 0"),
        ("rediss://db/0?socket_timeout=0", "socket_timeout='0'", "a number of seconds, more"),
        ("redis://db/0?socket_connect_timeout=-1", "socket_connect_timeout='-1'",
         "a number of seconds, more than 0"),
        ("redis://db/0?timeout=-1", "timeout='-1'", "a number of seconds, 0 or more"),
        ("redis+sentinel://s1/jobs/0?health_check_interval=-5", "health_check_interval='-5'",
         "a whole number of seconds, 0 or more"),
        ("redis+cluster://h:7000?socket_read_size=0", "socket_read_size='0'", ", at least 1"),
        ("redis://db/0?protocol=4", "protocol='4'", "2 or 3"),
        ("postgresql://db/app?max_size=-1", "max_size='-1'", ", at least 1"),
        ("postgresql://db/app?min_size=abc", "min_size='abc'", ", at least 1"),
        ("postgresql+pg8000://db/app?max_size=0", "max_size='0'", ", at least 1"),
    ],
)
def test_a_bad_value_reads_the_same_on_every_backend(url: str, value: str, must: str) -> None:
    """One wording, from the one check: the value, what it must be, the URL; never the
    parser's own text ("invalid literal for int() with base 10")."""
    with pytest.raises(ConfigurationError) as info:
        backend_from_url(url)
    text = str(info.value)
    says = value + " must be " + ("a whole number" + must if must.startswith(",") else must)
    assert text.startswith(says), text
    assert "invalid literal" not in text and "could not convert" not in text
    assert url.split("?")[0].split("://")[0] in text  # the URL is named


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/abc", "rediss://u:pw@db/1x",
                                 "redis://db/%31a"])
def test_a_redis_database_that_is_not_a_number_is_refused(url: str) -> None:
    """redis-py reads a path that is not a number as database 0: a typo in the database
    wrote into database 0. It is refused, naming the path and not the password."""
    with pytest.raises(ConfigurationError, match="not a number: write redis://host:port/") as info:
        backend_from_url(url)
    assert "'abc'" in str(info.value) or "'1x'" in str(info.value) or "'1a'" in str(info.value)
    assert "pw@" not in str(info.value)
    for good in ("redis://db/3", "redis://db/", "redis://db", "rediss://db:6380/0"):
        assert isinstance(backend_from_url(good), RedisBackend), good


def test_the_cli_refuses_a_redis_database_that_is_not_a_number() -> None:
    """Exit 2 and one line naming the path, before any connection."""
    cli = str(Path(sys.executable).parent / "anarchon")
    out = subprocess.run([cli, "status", "--url", "redis://127.0.0.1:1/abc"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert out.stderr.count("\n") == 1 and "'abc'" in out.stderr, out.stderr


def test_a_bad_duration_in_the_query_is_worded_for_a_url() -> None:
    """``?timeout=`` names the value and what a URL may hold (no "timedelta")."""
    with pytest.raises(ConfigurationError) as info:
        backend_from_url("postgresql://db/app?timeout=soon")
    assert str(info.value) == ("timeout='soon' must be a duration such as 30s, 500ms or 1m, "
                               "or a number of seconds (?timeout=30s)")
    assert isinstance(backend_from_url("postgresql://db/app?timeout=2.5"), PostgresBackend)


def test_a_redis_wait_timeout_in_the_query_may_be_a_number_of_seconds() -> None:
    """``?wait_timeout=1`` was refused with "'1' is not a duration; use ... or a number of
    seconds": a URL's query is text, so a number of seconds could not be given there (as
    PostgreSQL's ``?timeout=2.5`` can)."""
    for text, ms in (("1", 1000), ("0.25", 250), ("1s", 1000), ("500ms", 500)):
        backend = backend_from_url(f"redis://db/0?wait_replicas=1&wait_timeout={text}")
        assert isinstance(backend, RedisBackend) and backend.wait_timeout == ms / 1000, text
    for bad, says in (("0", "greater than zero"), ("soon", "is not a duration"),
                      ("nan", "finite")):
        with pytest.raises(ConfigurationError, match=f"wait_timeout=.* {says}"):
            backend_from_url(f"redis://db/0?wait_replicas=1&wait_timeout={bad}")


@pytest.mark.parametrize("dsn", ["host=db port=abc dbname=app", "host=a,b port=5432,x",
                                 "host=db port=70000",
                                 # the query's port, which overrides the URL's own: with
                                 # pg8000, 0 and 99999 read as a server that cannot be
                                 # reached (exit 1, and a scheduler retrying for ever)
                                 "postgresql+pg8000://app@db/app?port=99999",
                                 "postgresql+pg8000://app@db:5432/app?port=0",
                                 "postgresql://app@db/app?port=5432,70000"])
def test_a_bad_port_in_a_dsn_or_a_url_s_query_is_refused_before_connecting(dsn: str) -> None:
    """As in a URL: a configuration error (exit 2), not "cannot reach" (exit 1)."""
    with pytest.raises(ConfigurationError, match="which is not a number from 1 to 65535"):
        backend_from_url(dsn)


def test_a_driver_keyword_that_contradicts_the_url_s_driver_is_refused() -> None:
    """postgresql+pg8000:// with driver="psycopg" made a pg8000 pool, postgresql+psycopg://
    with driver="pg8000" a pg8000 one: one of the two was dropped, silently."""
    for url, driver in (("postgresql+pg8000://app:s3cr3t@db/app", "psycopg"),
                        ("postgresql+psycopg://app:s3cr3t@db/app", "pg8000"),
                        ("postgres+pg8000://app@db/app?table=jobs", "psycopg")):
        with pytest.raises(ConfigurationError, match=f"driver='{driver}' contradicts") as info:
            backend_from_url(url, driver=driver)
        assert "s3cr3t" not in str(info.value)
    for url, driver in (("postgresql+pg8000://app@db/app", "pg8000"),
                        ("postgresql+psycopg://app@db/app", "psycopg"),
                        ("postgresql://app@db/app", "pg8000")):
        assert isinstance(backend_from_url(url, driver=driver), PostgresBackend)


def test_the_short_scheme_with_a_driver_is_known() -> None:
    """``postgres+pg8000://`` and ``postgres+psycopg://``, which PostgresBackend takes, are
    schemes of the registry too."""
    for scheme in ("postgres+pg8000", "postgres+psycopg"):
        assert scheme in known_schemes()
        assert isinstance(backend_from_url(f"{scheme}://db/app"), PostgresBackend), scheme


def test_memory_urls_go_through_the_one_check() -> None:
    """``memory://`` is checked by :func:`lease_core._registry.check_url`, as every backend's
    URL is: the same wording of an unknown parameter."""
    with pytest.raises(ConfigurationError) as memory:
        backend_from_url("memory://?bogus=1")
    with pytest.raises(ConfigurationError) as redis:
        backend_from_url("redis://db/0?bogus=1")
    assert str(memory.value) == (
        "the memory URL 'memory://?bogus=1' has the unknown parameter 'bogus'; "
        "anarchon's own: namespace")
    assert str(redis.value).startswith(
        "the Redis URL 'redis://db/0?bogus=1' has the unknown parameter 'bogus'; ")


# --- on real servers ----------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_postgres_url_options_reach_the_backend_and_the_driver(
    anyio_backend: str, pg16_server: PgServer
) -> None:
    table = unique_table()
    app = "anarchon_" + uuid.uuid4().hex[:8]
    backend = backend_from_url(f"{pg16_server.dsn}?table={table}&application_name={app}"
                               "&connect_timeout=5&max_size=2&timeout=5s")
    try:
        await backend.start()
        won = await backend.claim(ClaimRequest("job", 1, "i", "t", 60_000))
        assert won.status is ClaimStatus.WON
        with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
            rows = conn.execute(f"SELECT job FROM {table}").fetchall()
            apps = conn.execute("SELECT count(*) FROM pg_stat_activity "
                                "WHERE application_name = %s", (app,)).fetchone()
        assert rows == [("job",)]
        assert apps is not None and apps[0] >= 1
        assert backend._adapter.pool.max_size == 2  # type: ignore[attr-defined]
    finally:
        await backend.close()
        await drop_tables(pg16_server.admin_dsn, table)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("scheme", ["POSTGRESQL://", "PostgreSQL+pg8000://", "Postgres://"])
async def test_a_postgres_url_s_scheme_is_read_whatever_its_case(
    anyio_backend: str, pg16_server: PgServer, scheme: str
) -> None:
    """The registry reads a scheme in any case, as a URL's scheme is (Redis URLs too);
    PostgresBackend then refused it ('missing "=" after ...', 'unknown PostgreSQL URL
    scheme')."""
    table = unique_table()
    # (no query of the backend's: a URL rebuilt without it came back with a lower-case
    # scheme, and worked)
    backend = backend_from_url(pg16_server.dsn.replace("postgresql://", scheme, 1),
                               table=table)
    try:
        await backend.start()
        won = await backend.claim(ClaimRequest("job", 1, "i", "t", 60_000))
        assert won.status is ClaimStatus.WON
    finally:
        await backend.close()
        await drop_tables(pg16_server.admin_dsn, table)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_redis_url_options_reach_the_backend_and_the_driver(
    anyio_backend: str, valkey8_server: EmbeddedRedis
) -> None:
    prefix = "opt_" + uuid.uuid4().hex[:8]
    backend = backend_from_url(f"{valkey8_server.url}?namespace={prefix}&socket_timeout=7")
    try:
        await backend.start()
        won = await backend.claim(ClaimRequest("job", 1, "i", "t", 60_000))
        assert won.status is ClaimStatus.WON
        adapter = backend._adapter  # type: ignore[attr-defined]
        assert adapter.client.connection_pool.connection_kwargs["socket_timeout"] == 7.0
        await backend.close()
        assert delete_prefix(valkey8_server.url, prefix) > 0
    finally:
        delete_prefix(valkey8_server.url, prefix)


# --- a third-party backend through the entry point ------------------------------------------

TOY_BACKEND = '''
"""A third-party backend: a memory store per namespace, reached as myscheme://NAME."""

from urllib.parse import urlsplit

from backends.memory import MemoryBackend
from lease_core import ConfigurationError

_STORES = {}


class ToyBackend(MemoryBackend):
    schemes = ("myscheme",)

    @classmethod
    def from_url(cls, url, *, namespace=None, **options):
        if options:
            raise ConfigurationError(f"ToyBackend does not accept {sorted(options)}")
        name = namespace or urlsplit(url).netloc
        store = _STORES.setdefault(name, cls())
        store.name = name
        return store
'''

RUN_A_JOB = '''
import anyio
from lease_core import Scheduler, backend_from_url
from lease_core._registry import known_schemes

async def main():
    backend = backend_from_url("myscheme://shop", namespace="ns1")
    ran = anyio.Event()
    scheduler = Scheduler(backend, instance_id="one", lease="3s", heartbeat="1s")

    @scheduler.every("tick", "1s")
    async def tick(ctx):
        ran.set()

    async with scheduler:
        with anyio.fail_after(30):
            await ran.wait()
    history = await scheduler.history("tick")
    print(type(backend).__name__, backend.name, "myscheme" in known_schemes(),
          history[-1].outcome, history[-1].instance_id)

anyio.run(main)
'''


def test_third_party_backend_installed_as_a_distribution_runs_a_job(tmp_path: Path) -> None:
    """A distribution on sys.path declares scheme 'myscheme' in group anarchon.backends."""
    site = tmp_path / "site"
    site.mkdir()
    install_toy_backend(site, TOY_BACKEND, {"myscheme": "ToyBackend"})
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(site)!r})\n" + RUN_A_JOB],
        capture_output=True, text=True, timeout=90,
    )
    assert out.stdout.strip() == "ToyBackend ns1 True completed one", out.stderr


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(("query", "says"), [
    ("connect_timeout=abc", "connect_timeout 'abc' is not a number of seconds"),
    ("sslmode=bogus", 'invalid sslmode value: "bogus"'),
    ("keepalives=abc", 'invalid integer value "abc" for connection option "keepalives"'),
    ("target_session_attrs=bogus", 'invalid target_session_attrs value: "bogus"'),
])
async def test_a_driver_parameter_psycopg_refuses_is_a_configuration_error_at_start(
    anyio_backend: str, pg16_server: PgServer, query: str, says: str
) -> None:
    """A value of a libpq parameter that psycopg or libpq refuses before connecting was
    reported as the server's fault (``BackendUnavailable``, exit 1: "cannot reach
    PostgreSQL"); ``connect_timeout=abc`` was worse: the first connection overrides the
    timeout and succeeded, then every connection of the pool failed (logged) and start()
    said after 10 s that the pool was busy. It is a ``ConfigurationError`` (exit 2) naming
    the value, at once, and creates nothing."""
    import anyio

    from lease_core.cli import main

    table = unique_table()
    made = []
    with anyio.fail_after(5), pytest.raises(ConfigurationError) as info:
        made.append(backend_from_url(f"{pg16_server.dsn}?table={table}&{query}"))
        await made[0].start()  # connect_timeout is refused already by backend_from_url
    assert says in str(info.value), info.value
    for backend in made:
        await backend.close()
    with psycopg.connect(pg16_server.admin_dsn, autocommit=True) as conn:
        found = conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()
    assert found == (None,)
    with anyio.fail_after(30):
        code = await anyio.to_thread.run_sync(
            main, ["status", "--url", f"{pg16_server.dsn}?table={table}&{query}"])
    assert code == 2


@pytest.mark.anyio
@pytest.mark.asyncio_only
async def test_the_first_login_waits_as_long_as_the_dsns_connect_timeout() -> None:
    """The first connection of a DSN's pool (the login check) used a connect_timeout of
    its own, 10 seconds, over the one the DSN gives: a server that never answers was
    given up after 10 s with connect_timeout=1 (and a slow link's connect_timeout=30 cut
    to 10). A server that accepts and never answers: given up after about one second."""
    import socket
    import time

    import anyio

    from lease_core.errors import BackendUnavailable

    with socket.socket() as silent:  # the kernel accepts; nothing ever answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        backend = PostgresBackend(
            f"host=127.0.0.1 port={port} dbname=app sslmode=disable connect_timeout=1")
        began = time.monotonic()
        with anyio.fail_after(30), pytest.raises(BackendUnavailable):
            await backend.start()
        assert time.monotonic() - began < 6
