"""Whether a model runs through ``torch.compile``, and the eager switch for a forward that traces an overflow."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from lit_mpstable.base.notes import Notes

RECOMPILE_NOTE = ("a compiled model recompiles once after each fallback or restore (its graph holds the precision"
                  " layout); from then on it runs compiled again")

# Graphs torch.compile built for our own kernels (the fused Kahan Adam step), not for the user's model, and the
# process-wide count when last read (a drop means someone cleared torch._dynamo's counters: ours went with them).
_OWN = {"graphs": 0, "seen": 0}


_COUNTERS: Any = None  # torch._dynamo's counters (imported at the first use: not at this module's import)


def graph_count() -> int:
    """Graphs torch.compile has compiled in this process (~0.3 us: read around each call of our own kernels)."""
    global _COUNTERS
    if _COUNTERS is None:
        from torch._dynamo.utils import counters

        _COUNTERS = counters
    total = _COUNTERS["stats"]["unique_graphs"]
    if total < _OWN["seen"]:
        _OWN["graphs"] = 0
    _OWN["seen"] = total
    return total


def own_graphs_since(before: int) -> None:
    """Count the graphs compiled since :func:`graph_count` read ``before`` as ours (our own kernels': the fused
    Kahan Adam step), so :func:`is_compiled` does not take them for the model."""
    _OWN["graphs"] += max(0, graph_count() - before)


def eager() -> AbstractContextManager:
    """Run eagerly inside the block (a traced forward's hooks would break the graph and recompile it for one step)."""
    # Inside a region being compiled there is nothing to switch (and set_stance would refuse).
    return nullcontext() if torch.compiler.is_compiling() else torch.compiler.set_stance("force_eager")


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule runs through ``torch.compile`` (as Lightning unwraps it too: the module keeps
    a compiled ``forward``), or, for a model compiled from outside (``torch.compile(model)`` in a plain loop, which
    the model cannot see), whether torch.compile has compiled a graph in this process."""
    from torch._dynamo.eval_frame import OptimizedModule

    outside = graph_count() > _OWN["graphs"]  # graphs beyond our own kernels'
    return getattr(module, "_compiler_ctx", None) is not None or outside or any(
        isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
        or hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable") for m in module.modules()
    )


def recompile_note(step: int, warnings: Notes) -> None:
    """Note once that a compiled model recompiles after a change of the precision layout (at step ``step``)."""
    warnings.add_once("recompile", f"{RECOMPILE_NOTE} (step {step}).")
