"""Reconciliation of Redis's settlements and billing records with the ledger (issue 13)."""
from costd.reconcile.reconciler import (MISMATCH, UNBILLED, UNKNOWN, Gap, Reconciler, Report,
                                        usage_record_of)

__all__ = ["Gap", "MISMATCH", "Reconciler", "Report", "UNBILLED", "UNKNOWN", "usage_record_of"]
