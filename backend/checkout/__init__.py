"""The public checkout API: what a buyer's browser needs to pay one intent, with no merchant key."""
