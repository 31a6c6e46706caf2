"""lit_mpstable for projects written against the standalone ``pytorch_lightning`` package.

``lit_mpstable.StablePrecision`` and ``lit_mpstable.callbacks.*`` are ``lightning.pytorch`` classes, which a
``pytorch_lightning.Trainer`` refuses (the two packages are separate class trees). These are the same classes on
``pytorch_lightning``'s tree: the same adapter (``lit_mpstable.frontends.trainer.TrainerPrecision``) over the same
precision core, and the same callbacks. Import from here when the project imports ``pytorch_lightning``::

    import pytorch_lightning as pl
    from lit_mpstable.pytorch_lightning import StablePrecision
    from lit_mpstable.pytorch_lightning.callbacks import OverflowMonitor

    trainer = pl.Trainer(plugins=[StablePrecision("16-mixed")], callbacks=[OverflowMonitor()])
"""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.plugins.precision import Precision

import lit_mpstable.frontends.trainer
from lit_mpstable.frontends.trainer import TrainerPrecision

__all__ = ["StablePrecision"]


# TrainerPrecision's optimizer_step is narrower than Precision's signature on purpose (as in
# lit_mpstable.frontends.trainer.StablePrecision); a subclass of both inherits that deliberate mismatch.
class StablePrecision(TrainerPrecision, Precision):  # type: ignore[misc]
    __doc__ = lit_mpstable.frontends.trainer.StablePrecision.__doc__
    _pl = pl
