"""Layer 0: the telemetry wire contract, producer SDK, Kafka consumer, dead letters, late-signal
joins, and the database foundation (SQLAlchemy ``Base``, engine and session factories)."""
