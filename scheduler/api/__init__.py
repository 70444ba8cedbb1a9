"""The control plane: a FastAPI app (``/api/v1``) with bearer-token roles, an audit log, and
server-rendered reward dashboards whose charts are drawn server-side as SVG by matplotlib.

Build it with :func:`scheduler.api.app.create_app`; serve it with ``undertow api``.
"""
