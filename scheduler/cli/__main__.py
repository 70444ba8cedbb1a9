"""``python -m scheduler.cli``: the same as the ``undertow`` command."""

from scheduler.cli import main

main()
