"""The loop: typed state (``state``), its steps (``steps``, ``training``), the Celery app and tasks
(``app``, ``tasks``), starting and cancelling jobs (``submit``), the job table's rules under faults
(``jobs``), and borrowing replicas for training (``planning``, ``borrowing``, ``leases``,
``preemptible``)."""
