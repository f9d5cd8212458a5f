"""Webhooks: endpoints, signed deliveries retried on schedule from the database, replay."""
