"""Two-phase-commit sinks: transactional Kafka, files, PostgreSQL, Redis, console, dead letters.

Reserved for the sinks milestone (see CHANGELOG.md); nothing is exported yet.
"""

__all__: list[str] = []
