"""Capacity planning and borrowing: traces, demand, forecast, capacity, borrowing, pools.

Pure logic (numpy, no database, no Celery): the simulator and the Celery tasks both drive it.
"""
