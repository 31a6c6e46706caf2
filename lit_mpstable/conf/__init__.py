"""The Hydra configs, shipped as package data: ``pkg://lit_mpstable.conf``
(see ``hydra_plugins/lit_mpstable_searchpath``).
"""
