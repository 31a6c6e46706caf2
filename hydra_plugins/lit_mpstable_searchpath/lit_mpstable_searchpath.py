"""Puts lit_mpstable's config groups (``precision``, ``scaler``, ``fp8``, ``callbacks``, ...) on every Hydra app's
search path, so an installed package is all a user's app needs to compose them.

Hydra imports every module under the ``hydra_plugins`` namespace when an app starts, so this one imports Hydra only
(not lit_mpstable, torch or Lightning): the configs are read from the package when a group is composed.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

CONF = "pkg://lit_mpstable.conf"


class LitMPStableSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # Appended, so the app's own configs win when a name is in both (a template's `callbacks/default.yaml`).
        # lit-mpstable-train already has it as its primary config path: added once.
        if all(element.path != CONF for element in search_path.get_path()):
            search_path.append(provider="lit_mpstable", path=CONF)
