"""Corrupted-checkpoint campaign: write a real Trainer checkpoint, corrupt its plugin and callback state one field at
a time, load each corruption through the public ``load_state_dict`` methods and count the outcomes.

Outcomes:
    clear     refused with a ValueError/TypeError/KeyError whose message names the corrupted field
    correct   loaded, and the loaded object's own state_dict gives back the (valid) corrupted value
    silent    loaded without a word although the value is invalid, or loaded as something else
    raw       any other exception (``int()``'s, ``NoneType``'s, ...): the user cannot tell what is wrong

Run: ``python bench/corrupt_checkpoint.py [--list]`` (CPU, about a minute). ``--list`` prints every case.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_mpstable import StablePrecision
from lit_mpstable.callbacks import AMPPreflight, OverflowMonitor, PrecisionFallback, PrecisionProbe, ScaleCheckpoint

INVALID = "invalid"
VALID = "valid"


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)),
                          batch_size=16)


_CALLBACKS: list[Callable[[], pl.Callback]] = [
    lambda: ScaleCheckpoint(every_n_steps=2), lambda: OverflowMonitor(window=8),
    lambda: PrecisionProbe(every_n_steps=2), PrecisionFallback, AMPPreflight,
]
# Corruptions that are legitimate values of their field: no scale bound, no unread flag, no cooldown or probe yet,
# a negative loss.
_LEGITIMATE = {("min_scale", "None"), ("max_scale", "None"), ("previous_nonfinite", "None"), ("cooldown_end", "-1"),
               ("last_probe_step", "-1"), ("losses", "[-1]")}


def _callbacks() -> list[pl.Callback]:
    return [make() for make in _CALLBACKS]


def _plugin(kind: str) -> StablePrecision:
    if kind == "16-mixed":
        return StablePrecision("16-mixed", scaler="adaptive")
    if kind == "bf16-true":
        return StablePrecision("bf16-true")
    return StablePrecision("bf16-true", master_weights="kahan")


def _fit(kind: str, directory: Path) -> tuple[StablePrecision, list[pl.Callback], dict[str, Any]]:
    plugin, callbacks = _plugin(kind), _callbacks()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, plugins=[plugin], callbacks=callbacks,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(_Module())
    path = directory / f"{kind}.ckpt"
    trainer.save_checkpoint(path)
    return plugin, callbacks, torch.load(path, weights_only=False)


# Records (reports kept for the user: probe history, rollback events, fallback decisions, the preflight result) are
# corrupted as a whole, not field by field.
RECORDS = {"history", "events", "decisions", "result"}


def _leaves(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Every field to corrupt: dicts are entered (a tensor dict by its first entry), lists and records are fields."""
    if isinstance(obj, dict) and obj and not (path and path[-1] in RECORDS):
        items = list(obj.items())
        if all(isinstance(v, torch.Tensor) for _, v in items):
            items = items[:1]
        for key, value in items:
            yield from _leaves(value, (*path, key))
    else:
        yield path, obj


def _mutations(value: Any) -> list[tuple[str, str, Any]]:
    """(name, valid or invalid, new value) for a leaf."""
    if isinstance(value, bool):
        return [("flip", VALID, not value), ("'False'", INVALID, "False"), ("None", INVALID, None)]
    if isinstance(value, int):
        return [("-1", INVALID, -1), ("'3'", INVALID, "3"), ("None", INVALID, None), ("1.5", INVALID, 1.5)]
    if isinstance(value, float):
        return [("nan", INVALID, math.nan), ("inf", INVALID, math.inf), ("'abc'", INVALID, "abc"),
                ("None", INVALID, None)]
    if isinstance(value, str):
        return [("'junk'", INVALID, "junk"), ("5", INVALID, 5)]
    if isinstance(value, torch.Tensor):
        out = [("None", INVALID, None)]
        if value.is_floating_point() and value.numel():
            out += [("nan", INVALID, torch.full_like(value, math.nan)), ("half", VALID, value * 0.5)]
        return out
    if isinstance(value, list):
        out = [("None", INVALID, None), ("'x'", INVALID, "x")]
        return out + ([("[-1]", INVALID, [-1] * len(value))] if value else [])
    if isinstance(value, dict):
        return [("None", INVALID, None), ("[]", INVALID, [])]
    if value is None:
        return [("'x'", INVALID, "x")]
    return []


def _set(state: Any, path: tuple, value: Any) -> Any:
    state = copy.deepcopy(state)
    if not path:
        return value
    target = state
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return state


def _get(state: Any, path: tuple) -> Any:
    for key in path:
        state = state[key]
    return state


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a.float(), b.float()))
    return type(a) is type(b) and a == b


def _targets(kind: str, directory: Path) -> Iterator[tuple[str, dict[str, Any], Callable[[], Any]]]:
    """(owner, saved state, a fresh object set up as a resume sets it up)."""
    plugin, callbacks, checkpoint = _fit(kind, directory)

    def fresh_plugin() -> StablePrecision:
        new = _plugin(kind)
        module = new.convert_module(_Module())
        new.stepper.setup_optimizers(module, [torch.optim.SGD(module.parameters(), lr=0.01)])
        return new

    yield f"StablePrecision[{kind}]", checkpoint[type(plugin).__qualname__], fresh_plugin
    if kind != "16-mixed":
        return
    for callback, make in zip(callbacks, _CALLBACKS):
        yield type(callback).__name__, checkpoint["callbacks"][callback.state_key], make


def run(verbose: bool) -> dict[str, int]:
    counts = dict(clear=0, correct=0, silent=0, raw=0)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        targets = [t for kind in ("16-mixed", "bf16-true", "kahan") for t in _targets(kind, Path(tmp))]
        for owner, saved, fresh in targets:
            cases = [((), "None", INVALID, None), ((), "'junk'", INVALID, "junk")]
            cases += [(path, name, validity, new) for path, value in _leaves(saved)
                      for name, validity, new in _mutations(value)]
            for path, name, validity, new in cases:
                corrupted = _set(saved, path, new)
                target = fresh()
                field = str(path[-1]) if path else "state_dict"
                if (field, name) in _LEGITIMATE:
                    validity = VALID
                try:
                    target.load_state_dict(corrupted)
                except (ValueError, TypeError, KeyError) as error:
                    named = (field in str(error) or not path) and "load_state_dict" in str(error)
                    outcome = "clear" if named else "raw"
                    detail = f"{type(error).__name__}: {str(error)[:150]}"
                except Exception as error:  # noqa: BLE001 - the campaign counts every failure
                    outcome, detail = "raw", f"{type(error).__name__}: {str(error)[:150]}"
                else:
                    if validity == INVALID:
                        outcome, detail = "silent", "loaded"
                    else:
                        try:
                            back = _get(target.state_dict(), path)
                        except Exception as error:  # noqa: BLE001
                            outcome, detail = "silent", f"state_dict after load: {error!r}"
                        else:
                            outcome = "correct" if _same(back, new) else "silent"
                            detail = "round trip" if outcome == "correct" else f"loaded as {back!r}"[:150]
                counts[outcome] += 1
                if verbose or outcome in ("silent", "raw"):
                    print(f"{outcome:8s} {owner}.{'.'.join(map(str, path)) or '<state>'} = {name}: {detail}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every case, not only the bad ones")
    args = parser.parse_args(argv)
    counts = run(args.list)
    total = sum(counts.values())
    print(f"{total} corrupted states: refused clearly {counts['clear']}, loaded correctly {counts['correct']},"
          f" silently wrong {counts['silent']}, raw errors {counts['raw']}")
    return 0 if counts["silent"] == counts["raw"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
