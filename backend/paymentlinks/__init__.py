"""Payment links: a fixed price at a shareable URL; each visit makes a fresh intent and sends the buyer to its
checkout (``services``; the API in ``views``, the public visit in ``pages``)."""
