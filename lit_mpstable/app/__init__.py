"""The app: the Hydra entry point, its configs, the report, the showcase and the demo models."""
