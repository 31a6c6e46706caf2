"""The app: the Hydra entry point, its configs, the report, the showcase and the demo models."""

__all__: list[str] = []  # a folder, not a face: import from its modules
