"""Idempotency-Key handling for create calls, as merchants know it from card APIs."""
