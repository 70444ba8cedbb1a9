"""Alembic environment and versions: one branch per package, static and reversible."""
