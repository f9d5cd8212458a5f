"""The events outbox: every state change merchants hear about, written in the same transaction."""
