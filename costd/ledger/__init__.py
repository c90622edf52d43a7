"""The usage ledger: idempotent storage of request usage and worker capacity (SQLite or PostgreSQL)."""
from costd.ledger.config import LedgerConfig
from costd.ledger.ledger import UsageLedger, open_store
from costd.ledger.schema import SCHEMA_VERSION
from costd.ledger.store import (CapacityAggregate, TenantUsage, UsageAggregate, WriteResult,
                                HOUR_NS)

__all__ = ["CapacityAggregate", "HOUR_NS", "LedgerConfig", "SCHEMA_VERSION", "TenantUsage",
           "UsageAggregate", "UsageLedger", "WriteResult", "open_store"]
