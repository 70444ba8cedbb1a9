"""Layer 4: it alone wires the loop. Its rooms: ``settings`` (the root settings tree), ``loop`` (the typed
loop: state, steps, the Celery app and tasks, jobs, borrowing), ``planner`` (capacity planning and the
simulator), ``api`` (the FastAPI control plane and dashboards), ``cli``, ``runtime`` (database, logging,
the embedded stack) and ``demo``."""
