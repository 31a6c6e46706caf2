"""Corrupted-checkpoint campaign: write a real Trainer checkpoint, corrupt its plugin and callback state one field at
a time, load each corruption through the public ``load_state_dict`` methods and count the outcomes.

Outcomes:
    clear     refused with a ValueError/TypeError/KeyError whose message names the corrupted field
    correct   loaded, and the loaded object's own state_dict gives back the (valid) corrupted value
    silent    loaded without a word although the value is invalid, or loaded as something else
    raw       any other exception (``int()``'s, ``NoneType``'s, ...): the user cannot tell what is wrong

The numeric campaign (issue #46) corrupts whole Trainer checkpoints in their numbers (a weight row scaled, masters
round-tripped through BF16, an FP8 scale history zeroed, a Kahan compensation dropped, another recipe, a bit flipped in
the optimizer state) and resumes from each: before (its fingerprint removed), after (``on_fingerprint_mismatch=
"raise"``) and with ``"previous"``.

Run: ``python bench/corrupt_checkpoint.py [--list] [--numbers] [--out DIR]`` (CPU, a few minutes). ``--list`` prints
every case; ``--numbers`` runs only the numeric campaign; ``--out`` writes its table (numbers.json, numbers.md).
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
from lit_mpstable.core.fingerprint import checkpoint_trees, checksums

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
# corrupted as a whole, not field by field. The numeric fingerprint too: its numbers are what the numeric campaign
# (--numbers) corrupts, through whole checkpoints.
RECORDS = {"history", "events", "decisions", "result", "fingerprint"}


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


# ------------------------------------------------------------------------------------ the numbers (issue #46)
# Whole checkpoints written by a Trainer (ModelCheckpoint, every step), the newest corrupted in its *numbers*, resumed
# through Trainer.fit(ckpt_path=...). "before": the same corrupted file with its fingerprint removed (the load path of
# a checkpoint without one is the code before the fingerprint existed); "after": with it, on_fingerprint_mismatch=
# "raise"; "previous": with it, on_fingerprint_mismatch="previous" (repaired: resumed from the newest earlier passing
# checkpoint). Outcomes: refused (named: the message names what differs), repaired, silent (trained on), raw.
NUMERIC_KINDS: dict[str, tuple[dict[str, Any], dict[str, Any] | None, Callable[[dict[str, Any]], None], str]] = {}


def _numeric(name: str, plugin: dict[str, Any], resumed: dict[str, Any] | None, named: str
             ) -> Callable[[Callable[[dict[str, Any]], None]], Callable[[dict[str, Any]], None]]:
    def register(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        NUMERIC_KINDS[name] = (plugin, resumed, change, named)
        return change
    return register


@_numeric("weight row scaled", {"precision": "bf16-true"}, None, "weight `state_dict['model.fc2.weight']`")
def _row_scaled(c: dict[str, Any]) -> None:
    c["state_dict"]["model.fc2.weight"][3] *= 2


@_numeric("masters round-tripped through BF16", {"precision": "bf16-true"}, None, "round-tripped through BF16")
def _masters_bf16(c: dict[str, Any]) -> None:
    masters = c["StablePrecision"]["masters"]
    for key, value in masters.items():
        if isinstance(value, torch.Tensor):
            masters[key] = value.bfloat16().float()


@_numeric("FP8 scale history zeroed", {"precision": "bf16-mixed", "fp8": "delayed"}, None,
          "FP8 scaling state `plugin['layout']['fp8']['model.fc2.amax_history']`")
def _history_zeroed(c: dict[str, Any]) -> None:
    c["StablePrecision"]["layout"]["fp8"]["model.fc2.amax_history"].zero_()


@_numeric("Kahan compensation dropped", {"precision": "bf16-true", "master_weights": "kahan"}, None,
          "Kahan compensation `plugin['compact']['compensation']")
def _compensation_dropped(c: dict[str, Any]) -> None:
    for value in c["StablePrecision"]["compact"]["compensation"].values():
        value.zero_()


@_numeric("loaded under another recipe (current -> mxfp8)", {"precision": "bf16-mixed", "fp8": "current"},
          {"precision": "bf16-mixed", "fp8": "mxfp8"},
          "checkpoint trained `model.fc2` in fp8 current (hybrid), this run has it in mxfp8")
def _other_recipe(c: dict[str, Any]) -> None:
    pass


@_numeric("loaded under another recipe (current -> none)", {"precision": "bf16-mixed", "fp8": "current"},
          {"precision": "bf16-mixed"},
          "checkpoint trained `model.fc2` in fp8 current (hybrid), this run has it in bf16")
def _no_recipe(c: dict[str, Any]) -> None:
    pass


@_numeric("bit flipped in the optimizer state", {"precision": "bf16-true"}, None,
          "optimizer state `optimizer_states[0]['state'][0]['exp_avg_sq']`")
def _bit_flipped(c: dict[str, Any]) -> None:
    c["optimizer_states"][0]["state"][0]["exp_avg_sq"].view(-1).view(torch.int32)[5] ^= 1 << 3


@_numeric("two sign bits flipped in the optimizer state", {"precision": "bf16-true"}, None,
          "optimizer state `optimizer_states[0]['state'][0]['exp_avg']`")
def _sign_pair_flipped(c: dict[str, Any]) -> None:
    # The sign bits of two 64-bit words' upper FP32 halves: 2**63 + 2**63 wraps to 0 in one sum of all words.
    words = c["optimizer_states"][0]["state"][0]["exp_avg"].view(-1).view(torch.int32)
    words[1] ^= -(1 << 31)
    words[3] ^= -(1 << 31)


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from lit_mpstable.app.fault_demos import TinyMLP

        torch.manual_seed(0)
        self.model = TinyMLP()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        from lit_mpstable.app.fault_demos import regression_data

        return DataLoader(TensorDataset(*regression_data(64)), batch_size=16)


def _numeric_fit(plugin: dict[str, Any], steps: int, directory: Path | None = None, ckpt: Path | None = None,
                 on_mismatch: str = "raise") -> pl.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint

    args = dict(plugin)
    callbacks = [ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1)] if directory else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=bool(directory),
                         callbacks=callbacks,
                         plugins=[StablePrecision(args.pop("precision"), on_fingerprint_mismatch=on_mismatch, **args)])
    trainer.fit(_Tiny(), ckpt_path=ckpt)
    return trainer


def _resume_outcome(plugin: dict[str, Any], path: Path, named: str, on_mismatch: str) -> tuple[str, str]:
    from lit_mpstable.core.fingerprint import FingerprintMismatch

    try:
        trainer = _numeric_fit(plugin, 4, ckpt=path, on_mismatch=on_mismatch)
    except FingerprintMismatch as error:
        return ("refused (named)" if named in str(error) else "refused (not named)"), str(error)[:300]
    except (ValueError, TypeError, KeyError) as error:
        return "refused (field check)", f"{type(error).__name__}: {str(error)[:300]}"
    except Exception as error:  # noqa: BLE001 - the campaign counts every failure
        return "raw", f"{type(error).__name__}: {str(error)[:300]}"
    events = trainer.precision_plugin.fingerprint.events  # type: ignore[attr-defined]
    fallback = next((e["fallback"] for e in events if "fallback" in e), None)
    if fallback is not None:
        return "repaired", f"resumed from {Path(fallback).name}: {'; '.join(events[0]['differences'])[:300]}"
    return "silent", "trained on"


def run_numbers(verbose: bool) -> list[dict[str, str]]:
    """One row per kind of numeric corruption: the outcome before (no fingerprint), after ("raise") and with
    "previous"."""
    import logging
    import os

    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index, (kind, (plugin, resumed, change, named)) in enumerate(NUMERIC_KINDS.items()):
            directory = Path(tmp) / str(index)
            _numeric_fit(plugin, 3, directory)
            written = sorted(directory.glob("*.ckpt"), key=lambda p: int(p.stem.rpartition("=")[2]))
            clean = written[-1].read_bytes()
            row = {"kind": kind}
            for column, strip, on_mismatch in (("before", "all", "raise"), ("version 1", "v1", "raise"),
                                               ("version 2", "v2", "raise"), ("after", "", "raise"),
                                               ("previous", "", "previous")):
                written[-1].write_bytes(clean)
                checkpoint = torch.load(written[-1], weights_only=True)
                if strip in ("v1", "v2"):  # as earlier releases wrote it: 1, one sum of all words a tensor; 2, the
                    version = int(strip[1])  # lanes zero-padded to 509 before the hash
                    checkpoint["StablePrecision"]["fingerprint"].update(version=version, checksums=checksums(
                        checkpoint_trees(checkpoint, "StablePrecision"), version=version))
                change(checkpoint)
                if strip == "all":
                    checkpoint["StablePrecision"].pop("fingerprint")
                torch.save(checkpoint, written[-1])
                for step, path in enumerate(written):  # "earlier" is by modification time
                    os.utime(path, ns=(10**9 * (step + 1),) * 2)
                row[column], row[f"{column}_detail"] = _resume_outcome(resumed or plugin, written[-1], named,
                                                                       on_mismatch)
            rows.append(row)
            if verbose:
                print(f"{kind}: before {row['before']}, version 1 {row['version 1']}, version 2 {row['version 2']},"
                      f" after {row['after']},"
                      f" previous {row['previous']}\n"
                      f"    {row['after_detail'][:240]}")
    return rows


def numbers_table(rows: list[dict[str, str]]) -> str:
    lines = ["| corruption | before (no fingerprint) | fingerprint version 1 | version 2 | after (`\"raise\"`) |"
             " `\"previous\"` | what the refusal names |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        detail = row["after_detail"].split("fingerprint: ", 1)[-1].replace("|", "\\|")[:160]
        lines.append(f"| {row['kind']} | {row['before']} | {row['version 1']} | {row['version 2']} | {row['after']} |"
                     f" {row['previous']} | {detail} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every case, not only the bad ones")
    parser.add_argument("--numbers", action="store_true",
                        help="only the numeric campaign (weights, masters, FP8 state, compensation, recipe, bit flips)")
    parser.add_argument("--out", type=Path, default=None, help="write numbers.json and numbers.md there")
    args = parser.parse_args(argv)
    rows = run_numbers(args.list)
    print(numbers_table(rows))
    # "previous" repairs where an earlier checkpoint passes; under another recipe none does (they share it): refused.
    bad = sum(row["after"] != "refused (named)" or row["version 2"] != "refused (named)"
              or row["previous"] not in ("repaired", "refused (named)") for row in rows)
    print(f"{len(rows)} numeric corruptions: refused and named {sum(r['after'] == 'refused (named)' for r in rows)},"
          f" repaired by 'previous' {sum(r['previous'] == 'repaired' for r in rows)}, silent before the fingerprint"
          f" {sum(r['before'] == 'silent' for r in rows)}, silent after {sum(r['after'] == 'silent' for r in rows)}")
    if args.out is not None:
        import json

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "numbers.json").write_text(json.dumps(rows, indent=1))
        (args.out / "numbers.md").write_text(numbers_table(rows) + "\n")
    if args.numbers:
        return 0 if bad == 0 else 1
    counts = run(args.list)
    total = sum(counts.values())
    print(f"{total} corrupted states: refused clearly {counts['clear']}, loaded correctly {counts['correct']},"
          f" silently wrong {counts['silent']}, raw errors {counts['raw']}")
    return 0 if counts["silent"] == counts["raw"] == 0 and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
