"""Relay spending on merchants' behalf: the ledger and the budget (see services)."""
