"""costd: the billing daemon — OTLP receiver → usage processor → idempotent ledger, behind CostService."""
