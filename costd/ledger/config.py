"""Where the ledger lives (SQLite file or PostgreSQL URL) and how it commits, validated once."""
from __future__ import annotations

from dataclasses import dataclass

SQLITE = "sqlite"
POSTGRESQL = "postgresql"


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    """`path` is the SQLite file, or the full PostgreSQL URL when `backend` is postgresql.

    Group commits: concurrent exports are written in one transaction of at most
    `max_group_records` records; a lone export never waits for company (no linger), so the
    group size grows only with load, which is when fewer fsyncs matter.
    """

    path: str
    backend: str = SQLITE
    synchronous: str = "NORMAL"
    busy_timeout_s: float = 5.0
    max_group_records: int = 4096

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("ledger path is empty")
        if self.backend not in (SQLITE, POSTGRESQL):
            raise ValueError(f"ledger backend must be sqlite or postgresql, got {self.backend!r}")
        if self.synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, got {self.synchronous!r}")
        if self.busy_timeout_s < 0:
            raise ValueError("busy_timeout_s must be >= 0")
        if self.max_group_records < 1:
            raise ValueError("max_group_records must be >= 1")

    @classmethod
    def from_url(cls, url: str) -> LedgerConfig:
        """`sqlite:///relative/path`, `sqlite:////absolute/path`, a bare file path, or
        `postgresql://user@host:port/dbname` (also `postgres://`)."""
        if url.startswith("sqlite:///"):
            return cls(path=url[len("sqlite:///"):])
        if url.startswith(("postgresql://", "postgres://")):
            return cls(path=url, backend=POSTGRESQL)
        if "://" in url:
            scheme = url.split("://", 1)[0]
            raise ValueError(f"ledger URL scheme {scheme!r} is not supported "
                             "(use sqlite:/// or postgresql://)")
        return cls(path=url)

    @property
    def display(self) -> str:
        """Where the ledger is, without a password that a PostgreSQL URL may carry."""
        if self.backend == SQLITE:
            return self.path
        scheme, _, rest = self.path.partition("://")
        credentials, at, host = rest.rpartition("@")
        user = credentials.split(":", 1)[0]
        return f"{scheme}://{user}{at}{host}"
