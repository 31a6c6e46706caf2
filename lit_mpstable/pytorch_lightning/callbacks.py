"""The lit_mpstable callbacks as ``pytorch_lightning.Callback`` subclasses (see ``lit_mpstable.pytorch_lightning``).

Each is generated from its ``lit_mpstable.callbacks`` class, never copied: the class itself with
``pytorch_lightning.Callback`` added to its bases, so a ``pytorch_lightning.Trainer`` accepts it.
"""

from __future__ import annotations

import pytorch_lightning as pl

from lit_mpstable import callbacks as _callbacks

__all__ = list(_callbacks.__all__)


def _on_pytorch_lightning(cls: type) -> type:
    return type(cls.__name__, (cls, pl.Callback), {"__module__": __name__, "__qualname__": cls.__qualname__,
                                                    "__doc__": cls.__doc__})


globals().update({name: _on_pytorch_lightning(getattr(_callbacks, name)) for name in __all__})
