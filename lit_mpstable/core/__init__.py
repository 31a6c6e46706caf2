"""The numerics core: pure PyTorch, no Lightning."""
