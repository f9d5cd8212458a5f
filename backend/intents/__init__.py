"""Payment intents: creation, reads, listing, cancellation and expiry."""
