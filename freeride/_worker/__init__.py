"""The side-task worker process (private). Entry point: ``python -m freeride._worker``."""
