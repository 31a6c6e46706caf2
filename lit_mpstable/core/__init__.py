"""The numerics core: pure PyTorch, no Lightning."""

__all__: list[str] = []  # a folder, not a face: import from its modules
