"""A private PostgreSQL schema per test, on the server this machine runs; skip when there is none."""
from __future__ import annotations

import os
import uuid
from urllib.parse import quote

import pytest

# The machine's PostgreSQL 15 (trust auth); override to test against another server.
POSTGRES_URL = os.environ.get("LLMMESH_TEST_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test")


def postgres_url_or_skip():
    """Yields a URL whose search_path is a fresh schema, dropped afterwards."""
    psycopg = pytest.importorskip("psycopg")
    try:
        admin = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=2)
    except psycopg.Error as error:
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_URL}: {error}")
    schema = f"llmmesh_test_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE SCHEMA {schema}")
    separator = "&" if "?" in POSTGRES_URL else "?"
    try:
        yield f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"
    finally:
        admin.execute(f"DROP SCHEMA {schema} CASCADE")
        admin.close()
