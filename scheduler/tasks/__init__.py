"""Celery tasks of the loop (``loop``), the job table they write (``base``), replica leases
(``leases``), borrowing through the serving fleet (``borrowing``), preemptible training
(``preemptible``) and the adapters that call the layer functions (``steps``)."""
