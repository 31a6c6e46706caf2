"""Hydra discovers this package because ``hydra_plugins`` is a namespace package shared by every installed plugin."""
