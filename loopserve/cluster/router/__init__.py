"""The router: `core.py` (streams, pumps, handoff forwarding), `policy.py` (which worker a
request goes to), `workers.py` (each worker's load and health as the router sees it),
`migration.py` (continuing a stream elsewhere), `prefix_index.py` (who caches which prefix)."""
