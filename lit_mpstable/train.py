"""Public face: re-exports the Hydra entry point (main, run, build) from lit_mpstable.app.train.

``python -m lit_mpstable.train [group=option ...]`` runs it.
"""

from __future__ import annotations

from lit_mpstable.app.train import Built, build, main, run

__all__ = ["Built", "build", "main", "run"]

if __name__ == "__main__":
    main()
