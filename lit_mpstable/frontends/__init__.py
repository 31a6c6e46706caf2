"""The front ends: thin Lightning adapters (Trainer, Fabric) over the numerics core."""

__all__: list[str] = []  # a folder, not a face: import from its modules
