"""Layer 4: root settings, the CLI, the Celery app and tasks, capacity planning and off-peak
borrowing, the FastAPI control plane with dashboards, and the demo. Only this layer wires the
loop together."""
