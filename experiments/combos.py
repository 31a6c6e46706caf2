"""Where the repairs meet: short training runs over a sampled matrix of combinations, checked against invariants.

Front ends: the Lightning Trainer (``lit_mpstable.StablePrecision``), Fabric (``lit_mpstable.fabric.StablePrecision``)
and a plain ``PrecisionStepper`` loop. Factors: precision, SpikeGuard, growth telemetry, FP8, callbacks (Trainer
only), ``model.compile(backend="eager")`` and an injected event (a NaN gradient at step 4, a loss x1e3 at step 6).

Sampling: for each front end, a greedy all-pairs cover of its factors (every pair of levels of every two factors
appears in at least one run), deterministic; ``--full`` runs the full product instead (slow).

Invariants per run (a broken one is a FINDING): no exception (a refusal is a PASS when it is a ValueError/TypeError
raised at construction or setup); finite final weights; the skipped steps are exactly the injected ones; Adam's
``state["step"]`` equals the applied steps; the LR schedule held on skipped steps; a checkpoint taken at step 10 and
resumed (fresh objects, other initial weights) gives bit-identical weights at step 16; no warning from
lit_mpstable's own code that the combination does not explain (listed for review); with compile, few unique graphs
and no graph break.

    PYTHONPATH=. python experiments/combos.py [--only trainer|fabric|plain] [--limit N] [--full]

Writes experiments/results/combos.md.
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import random
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

torch.set_num_threads(1)

STEPS, SAVE_AT, NAN_AT, SPIKE_AT = 16, 10, 4, 6
SPIKES = range(6, 9)
STORM = range(4, 8)  # an overflow storm in fc2's gradient: enough consecutive skips for PrecisionFallback(patience=3)
LR, GAMMA = 1e-2, 0.9
MAX_GRAPHS = 6
# Warnings the product documents for a combination (not findings): FP16 on the CPU is emulated and slow.
# Lightning/torch notices unrelated to the product (left out of the table).
NOISE = ("LeafSpec", "callbacks used to create the checkpoint", "torch.jit.script_method")
EXPECTED_WARNINGS = ("FP16 arithmetic is emulated",
                     "FaultTriage cannot replay steps in this run: gradient accumulation")
PKG = str(Path(__file__).resolve().parents[1] / "lit_mpstable")

FACTORS: dict[str, list[Any]] = {
    "precision": ["bf16-mixed", "16-mixed", "bf16-true+kahan"],
    "guard": ["off", "on"],
    "growth": [None, 3],
    "fp8": [None, "current"],
    "callbacks": ["none", "fallback+monitor", "scale_ckpt"],
    "compile": ["off", "on"],
    "event": ["none", "nan@4", "spike@6", "storm@4-7"],
}

# --extended: more precisions, gradient accumulation, clipping, and every repair at once (a fallback whose
# cooldown ends after the checkpoint, snapshots, triage).
EXTENDED: dict[str, list[Any]] = {
    "precision": ["bf16-mixed", "16-mixed", "bf16-true+kahan", "bf16-true+stochastic", "16-true", "bf16-true+False"],
    "callbacks": ["none", "fallback+monitor", "scale_ckpt", "all", "cooldown+snapshots"],
    "accum": [1, 2],
    "clip": [None, 1.0],
    # a global fallback after step 6, active at the checkpoint; three loss spikes in a row (ScaleCheckpoint rolls back)
    "event": [*FACTORS["event"], "fallback@6", "spikes@6-8"],
    "fp8": [None, "current", "delayed"],
    "optimizer_state": ["fp32", "bf16"],  # BF16 moments need masters or compact weights: refused otherwise
}
FALLBACK_AFTER = 6


class Refused(Exception):
    """A ValueError/TypeError raised while building or setting up the run (before the first step)."""


# --------------------------------------------------------------------------------------------------- sampling
def all_pairs(factors: dict[str, list[Any]], seed: int = 0) -> list[dict[str, Any]]:
    """A greedy pairwise cover: every level pair of every two factors appears at least once."""
    names = list(factors)
    uncovered = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
                 for va in factors[a] for vb in factors[b]}
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    while uncovered:
        best, best_gain = None, -1
        for _ in range(150):
            cand = {n: rng.choice(factors[n]) for n in names}
            # seed the candidate with an uncovered pair so every pick makes progress
            (a, va), (b, vb) = rng.choice(sorted(uncovered, key=repr))
            cand[a], cand[b] = va, vb
            gain = sum(((x, cand[x]), (y, cand[y])) in uncovered for x, y in itertools.combinations(names, 2))
            if gain > best_gain:
                best, best_gain = cand, gain
        rows.append(best)
        uncovered -= {((x, best[x]), (y, best[y])) for x, y in itertools.combinations(names, 2)}
    return rows


def plan(front: str, full: bool, extended: bool = False, covers: int = 1) -> list[dict[str, Any]]:
    factors = {**FACTORS, **(EXTENDED if extended else {})}
    if front != "trainer":
        factors["callbacks"] = ["none"]  # Lightning callbacks need the Trainer
    if full:
        names = list(factors)
        return [dict(zip(names, vals)) for vals in itertools.product(*factors.values())]
    rows: list[dict[str, Any]] = []
    for k in range(covers):  # more covers: more distinct triples, still every pair in each
        rows += [r for r in all_pairs(factors, seed={"trainer": 1, "fabric": 2, "plain": 3}[front] + 10 * k)
                 if r not in rows]
    return rows


def label(c: dict[str, Any]) -> str:
    quiet = {"callbacks": "none", "accum": 1, "clip": None, "optimizer_state": "fp32"}
    return " ".join(f"{k}={v}" for k, v in c.items() if quiet.get(k, "-") != v)


# --------------------------------------------------------------------------------------------------- pieces
def plugin_kwargs(c: dict[str, Any]) -> dict[str, Any]:
    from lit_mpstable import SpikeGuard

    precision = c["precision"]
    kw: dict[str, Any] = {}
    if "+" in precision:
        precision, mode = precision.split("+")
        kw["master_weights"] = {"False": False, "True": True}.get(mode, mode)
    kw["precision"] = precision
    if c["guard"] == "on":
        # warmup 3 so the spike at step 6 is judged inside a 16-step run (the default warmup is 20)
        kw["spike_guard"] = SpikeGuard(clip_zscore=2.5, warmup=3, window=16)
    if c["growth"] is not None:
        kw["growth_every_n_steps"] = c["growth"]
    if c["fp8"] is not None:
        kw["fp8"] = c["fp8"]
    if c.get("optimizer_state", "fp32") != "fp32":
        kw["optimizer_state"] = c["optimizer_state"]
    return kw


def data(c: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    from lit_mpstable.app.fault_demos import regression_data

    # one optimizer step per epoch (batches of 16, `accum` of them): exact Trainer resume needs epoch ends
    return regression_data(16 * c.get("accum", 1))


def micro(c: dict[str, Any]) -> list[slice]:
    return [slice(16 * i, 16 * (i + 1)) for i in range(c.get("accum", 1))]


def loss_of(out: torch.Tensor, y: torch.Tensor, step: int, c: dict[str, Any]) -> torch.Tensor:
    loss = F.mse_loss(out.float(), y)
    spiked = (c["event"] == "spike@6" and step == SPIKE_AT) or (c["event"] == "spikes@6-8" and step in SPIKES)
    return loss * 1e3 if spiked else loss


def poison_(model: nn.Module, step: int, c: dict[str, Any]) -> None:
    if c["event"] == "nan@4" and step == NAN_AT:
        model.fc2.weight.grad.view(-1)[0] = float("nan")
    if c["event"] == "storm@4-7" and step in STORM:
        model.fc2.weight.grad.view(-1)[0] = float("inf")


def opt_steps(opt: torch.optim.Optimizer) -> list[int]:
    return sorted({int(s["step"]) for s in opt.state.values() if "step" in s})


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def refusal(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as err:
        raise Refused(f"{type(err).__name__}: {err}") from err


# --------------------------------------------------------------------------------------------------- front ends
def run_plain(c: dict[str, Any], load: bytes | None = None) -> dict[str, Any]:
    from lit_mpstable.app.fault_demos import TinyMLP
    from lit_mpstable.core.step.stepper import PrecisionStepper

    torch.manual_seed(0 if load is None else 123)
    model = TinyMLP()
    stepper = refusal(PrecisionStepper, device="cpu", **plugin_kwargs(c))
    refusal(stepper.setup_module, model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
    refusal(stepper.setup_optimizers, model, [opt], [sched])
    if c["compile"] == "on":
        model.compile(backend="eager")
    start = 0
    if load is not None:
        state = torch.load(io.BytesIO(load), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        stepper.load_state_dict(state["stepper"])
        start = SAVE_AT
    x, y = data(c)
    out: dict[str, Any] = {"skipped": [], "lrs": []}
    for step in range(start, STEPS):
        for i, b in enumerate(micro(c)):
            with stepper.forward_context():
                loss = loss_of(model(stepper.convert_input(x[b])), y[b], step, c) / len(micro(c))
            stepper.scale_loss(loss).backward()
            if i == 0:
                poison_(model, step, c)
        if c.get("clip"):
            stepper.clip_grad_norm_(opt, c["clip"])
        stepper.step(opt)
        if c["event"] == "fallback@6" and step == FALLBACK_AFTER:
            stepper.fallback()
        opt.zero_grad()
        sched.step()  # held by the stepper on a skipped step
        out["skipped"].append(bool(stepper.last_step_skipped))
        out["lrs"].append(opt.param_groups[0]["lr"])
        if step + 1 == SAVE_AT and load is None:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "stepper": stepper.state_dict()}, buf)
            out["ckpt"] = buf.getvalue()
    out.update(weights=weights(model), opt=opt, sched=sched)
    return out


def run_fabric(c: dict[str, Any], load: str | None = None, save: str | None = None) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lit_mpstable.app.fault_demos import TinyMLP
    from lit_mpstable.fabric import StablePrecision

    plugin = refusal(StablePrecision, **plugin_kwargs(c))
    fabric = refusal(Fabric, accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0 if load is None else 123)
    model = TinyMLP()
    if c["compile"] == "on":
        model.compile(backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
    model, opt = refusal(fabric.setup, model, opt)
    refusal(plugin.setup_optimizers, opt)
    plugin.hold_schedulers(sched)
    state = {"model": model, "optimizer": opt, "precision": plugin, "scheduler": sched}
    start = 0
    if load is not None:
        fabric.load(load, state, weights_only=True)
        start = SAVE_AT
    x, y = data(c)
    out: dict[str, Any] = {"skipped": [], "lrs": []}
    for step in range(start, STEPS):
        opt.zero_grad()
        for i, b in enumerate(micro(c)):
            fabric.backward(loss_of(model(x[b]), y[b], step, c) / len(micro(c)))
            if i == 0:
                poison_(model.module if hasattr(model, "module") else model, step, c)
        if c.get("clip"):
            fabric.clip_gradients(model, opt, max_norm=c["clip"])
        opt.step()
        if c["event"] == "fallback@6" and step == FALLBACK_AFTER:
            plugin.fallback(None, reason="combos")
        sched.step()
        out["skipped"].append(bool(plugin.last_step_skipped))
        out["lrs"].append(opt.param_groups[0]["lr"])
        if step + 1 == SAVE_AT and save is not None:
            fabric.save(save, state)
            out["ckpt"] = save
    out.update(weights=weights(model), opt=opt.optimizer if hasattr(opt, "optimizer") else opt, sched=sched)
    return out


def run_trainer(c: dict[str, Any], load: str | None = None, ckpt_dir: str | None = None) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lit_mpstable import StablePrecision
    from lit_mpstable.app.fault_demos import TinyMLP
    from lit_mpstable.callbacks import FaultTriage, OverflowMonitor, PrecisionFallback, ScaleCheckpoint

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyMLP()
            if c["compile"] == "on":
                self.model.compile(backend="eager")
            self.fired: set[int] = set()

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            step = self.trainer.global_step
            spike = step not in self.fired  # each step's fault fires once (a skipped batch does not repeat it)
            self.fired.add(step)
            x, y = batch
            return loss_of(self(x), y, step if spike else -1, c)

        def on_after_backward(self) -> None:
            step = self.trainer.global_step
            if ("grad", step) not in self.fired:
                self.fired.add(("grad", step))
                poison_(self.model, step, c)

        def train_dataloader(self):
            x, y = data(c)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=LR)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.skipped: list[bool] = []
            self.lrs: list[float] = []
            self.before = 0
            self.fell = False

        def on_train_batch_start(self, trainer, *args) -> None:
            self.before = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if (batch_idx + 1) % c.get("accum", 1):
                return  # a micro-batch: no optimizer step is due
            moved = trainer.global_step > self.before
            self.skipped.append(bool(trainer.precision_plugin.last_step_skipped) or not moved)
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
            if c["event"] == "fallback@6" and trainer.global_step == FALLBACK_AFTER + 1 and not self.fell:
                self.fell = True
                trainer.precision_plugin.fallback(None, reason="combos")

    plugin = refusal(StablePrecision, **plugin_kwargs(c))
    cbs: list[Any] = []
    if c["callbacks"] == "fallback+monitor":
        cbs = [refusal(PrecisionFallback, patience=3, on_growth=True), refusal(OverflowMonitor)]
    elif c["callbacks"] == "scale_ckpt":
        cbs = [refusal(ScaleCheckpoint)]
    elif c["callbacks"] == "cooldown+snapshots":  # a fallback that ends after the checkpoint; snapshots, rollback
        cbs = [refusal(PrecisionFallback, patience=3, cooldown=5), refusal(ScaleCheckpoint, every_n_steps=4)]
    elif c["callbacks"] == "all":
        cbs = [refusal(OverflowMonitor), refusal(PrecisionFallback, patience=3, cooldown=4),
               refusal(ScaleCheckpoint, every_n_steps=4), refusal(FaultTriage)]
    record = Record()
    extra: dict[str, Any] = {}
    if ckpt_dir is not None:
        cbs.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_AT, save_top_k=-1))
        extra["enable_checkpointing"] = True
    torch.manual_seed(0 if load is None else 123)
    module = Module()
    trainer = refusal(
        pl.Trainer, accelerator="cpu", devices=1, max_steps=STEPS, plugins=[plugin], callbacks=[*cbs, record],
        enable_progress_bar=False, enable_model_summary=False, logger=False, num_sanity_val_steps=0,
        log_every_n_steps=1, accumulate_grad_batches=c.get("accum", 1), gradient_clip_val=c.get("clip"),
        **{"enable_checkpointing": False, **extra})
    try:
        trainer.fit(module, ckpt_path=load)
    except (ValueError, TypeError) as err:
        if trainer.global_step == 0 and not record.skipped:
            raise Refused(f"{type(err).__name__} (at setup): {err}") from err
        raise
    rollbacks = sum(getattr(cb, "rollbacks", 0) for cb in cbs if isinstance(cb, ScaleCheckpoint))
    out = {"skipped": record.skipped, "lrs": record.lrs, "weights": weights(module), "rollbacks": rollbacks,
           "opt": trainer.optimizers[0], "sched": trainer.lr_scheduler_configs[0].scheduler}
    if ckpt_dir is not None:
        found = sorted(Path(ckpt_dir).glob(f"*step={SAVE_AT}*.ckpt"))
        out["ckpt"] = str(found[0]) if found else None
    return out


# --------------------------------------------------------------------------------------------------- checks
def expected_skips(c: dict[str, Any]) -> tuple[set[int], set[int]]:
    """(must be skipped, may be skipped) step indices."""
    must, may = set(), set()
    if c["event"] == "nan@4":
        must.add(NAN_AT)
    if c["event"] == "storm@4-7":
        must.update(STORM)
    if c["event"] == "spikes@6-8":
        (must if c["guard"] == "on" else may).update(SPIKES)
    if c["event"] == "spike@6":
        # unguarded, the spike may still overflow FP16 (a routine skip) or be skipped by ScaleCheckpoint
        (must if c["guard"] == "on" else may).add(SPIKE_AT)
    if c.get("callbacks") == "all":
        # FaultTriage replays a rejected step; a fault injected once is clean in the replay ("transient"): applied
        may |= must
        must = set()
    return must, may


def check(front: str, c: dict[str, Any]) -> tuple[str, list[str], list[str]]:
    from torch._dynamo.utils import counters

    problems: list[str] = []
    notes: list[str] = []
    torch._dynamo.reset()
    counters.clear()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if front == "plain":
                full = run_plain(c)
                resumed = run_plain(c, load=full["ckpt"])
            elif front == "fabric":
                full = run_fabric(c, save=os.path.join(tmp, "f.ckpt"))
                resumed = run_fabric(c, load=full["ckpt"])
            else:
                full = run_trainer(c, ckpt_dir=tmp)
                resumed = run_trainer(c, load=full["ckpt"]) if full["ckpt"] else None
        except Refused as err:
            return "REFUSED", [], [str(err).splitlines()[0][:300]]
        except Exception as err:  # noqa: BLE001  (every exception is a finding)
            tb = traceback.extract_tb(err.__traceback__)
            where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if PKG in f.filename), "?")
            return "FINDING", [f"exception {type(err).__name__} at {where}: {str(err).splitlines()[0][:300]}"], []
        graphs = counters["stats"]["unique_graphs"]
        breaks = dict(counters["graph_break"])

    skipped = {i for i, s in enumerate(full["skipped"]) if s}
    must, may = expected_skips(c)
    if full.get("rollbacks"):
        # ScaleCheckpoint rolled back to its snapshot: weights, optimizer and schedule went back with it, so the
        # counters are checked against each other, and the spike that triggered it need not be skipped
        notes.append(f"rollbacks={full['rollbacks']}")
        may |= must
        must = set()
    if not must <= skipped or not skipped <= must | may:
        maybe = f" (+maybe {sorted(may)})" if may else ""
        problems.append(f"skipped steps {sorted(skipped)}, expected {sorted(must)}{maybe}")
    batches = len(full["skipped"])
    applied = batches - len(skipped)
    steps = opt_steps(full["opt"])
    if full.get("rollbacks"):
        applied = full["sched"].last_epoch
    if steps and steps != [applied]:
        problems.append(f"Adam state['step'] {steps} != applied steps {applied}")
    if full["sched"].last_epoch != applied:
        problems.append(f"scheduler last_epoch {full['sched'].last_epoch} != applied steps {applied}")
    for i in sorted(skipped) if not full.get("rollbacks") else ():
        if i > 0 and full["lrs"][i] != full["lrs"][i - 1]:
            problems.append(f"LR moved on skipped step {i}")
    bad = [k for k, v in full["weights"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        problems.append(f"non-finite weights: {bad}")
    if resumed is None:
        problems.append(f"no checkpoint at step {SAVE_AT}")
    else:
        diff = [k for k, v in full["weights"].items() if not torch.equal(v, resumed["weights"][k])]
        if diff:
            err = max(float((full["weights"][k].float() - resumed["weights"][k].float()).abs().max()) for k in diff)
            problems.append(f"resume at {SAVE_AT} not bit-identical at {STEPS}: {diff} (max |diff| {err:.3g})")
        if resumed["skipped"] != full["skipped"][-len(resumed["skipped"]):]:
            problems.append(f"resumed skips {resumed['skipped']} vs {full['skipped'][SAVE_AT:]}")
    if c["compile"] == "on":
        notes.append(f"unique_graphs={graphs}")
        if graphs > MAX_GRAPHS:
            problems.append(f"recompile storm: {graphs} unique graphs")
        if breaks:
            problems.append(f"graph breaks: {breaks}")
    seen = set()
    for w in caught:
        text = f"{w.category.__name__}: {str(w.message).splitlines()[0][:200]}"
        if text in seen:
            continue
        seen.add(text)
        if any(n in text for n in NOISE):
            continue
        if any(e in text for e in EXPECTED_WARNINGS):
            notes.append(f"(expected) {text[:60]}")
        elif PKG in str(w.filename) and c["event"] != "none" and (
                any(f"step {i}" in text for i in sorted(must | may))
                or (c["event"] == "fallback@6" and f"fallback at step {FALLBACK_AFTER + 1}" in text)):
            notes.append(f"(reports the event) {text[:160]}")
        elif PKG in str(w.filename) and c["compile"] == "on" and "a compiled model recompiles once" in text:
            notes.append(f"(reports the event) {text[:160]}")
        elif PKG in str(w.filename):
            problems.append(f"warning from {Path(w.filename).name}: {text}")
        else:
            notes.append(f"(ext) {text[:120]}")
    return ("FINDING" if problems else "PASS"), problems, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["trainer", "fabric", "plain"], action="append")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--covers", type=int, default=1, help="union of this many all-pairs covers (seeds)")
    parser.add_argument("--extended", action="store_true",
                        help="more precisions, accumulation, clipping, every callback, a fallback event")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "combos.md"))
    args = parser.parse_args()
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    rows = []
    t0 = time.time()
    print(f"load average {os.getloadavg()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    for front in args.only or ["plain", "fabric", "trainer"]:
        for c in plan(front, args.full, args.extended, args.covers)[: args.limit]:
            t = time.time()
            verdict, problems, notes = check(front, c)
            details = "; ".join(problems + notes) or "-"
            rows.append((label(c), front, verdict, details))
            print(f"[{time.time() - t:5.1f}s] {front:7s} {verdict:8s} {label(c)} | {details}", flush=True)
    header = ("| combination | front end | verdict | details |\n| --- | --- | --- | --- |\n")
    body = "".join(f"| {a} | {b} | {v} | {d.replace('|', '/')} |\n" for a, b, v, d in rows)
    counts = {v: sum(r[2] == v for r in rows) for v in ("PASS", "REFUSED", "FINDING")}
    text = (f"# Combination matrix\n\n`PYTHONPATH=. python experiments/combos.py {' '.join(sys.argv[1:])}`; "
            f"{len(rows)} runs in {time.time() - t0:.0f} s; {counts}. Sampling: "
            f"{'full product' if args.full else f'union of {args.covers} greedy all-pairs cover(s) per front end'}"
            f"{' (extended factors)' if args.extended else ''}.\n\n{header}{body}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(counts)


if __name__ == "__main__":
    main()
