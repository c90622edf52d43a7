"""costd: the billing daemon — OTLP receiver → usage processor → idempotent ledger, priced on read
by the price book into invoices, FOCUS / CloudEvents exports and what-if answers (CostService)."""
