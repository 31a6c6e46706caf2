"""Configs: schemas match the constructors, every group option composes and instantiates (in our app and, through
the search-path plugin, in any Hydra app), the entry point runs, and config mistakes fail early with the fix."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import re
import subprocess
import sys
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, Optional

import pytest
import torch
from cli_batch import run_batch
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.utils import get_class, instantiate
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ValidationError
from torch import nn

import lit_mpstable.conf
from lit_mpstable import StablePrecision
from lit_mpstable.app.config import SCHEMAS, derive_schema, register_configs
from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler, StaticLossScaler

CONF = Path(lit_mpstable.conf.__file__).parent


# ------------------------------------------------------------------------------------------ schema vs constructor
def _expected_type(hint: Any) -> Any:
    """What a schema field must be for a constructor hint, spelled out case by case (OmegaConf 2.3 types)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return Any  # OmegaConf would read 2 or "yes" as True: the constructor checks it
    if hint in (int, float, str):
        return hint
    if origin is Literal and all(isinstance(a, str) for a in args):
        return str  # no Literal in OmegaConf: the constructor checks the choice
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        inner = _expected_type(rest[0]) if len(rest) == 1 else None
        return None if inner in (None, Any) else Optional[inner]
    return None  # anything else: not checked here (the default must pass, and null where the hint takes None)


def _disagreements(schema: type, target: Callable) -> list[str]:
    """Where ``schema`` and ``target``'s signature differ: names, defaults, and types (a primitive hint must be the
    same primitive, ``X | None`` must stay optional, and OmegaConf must accept the constructor's default)."""
    params = {p.name: p for p in inspect.signature(target).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    annotated = target if dataclasses.is_dataclass(target) else target.__init__
    hints = typing.get_type_hints(annotated)
    fields = {f.name: f for f in dataclasses.fields(schema) if f.name != "_target_"}
    field_types = typing.get_type_hints(schema)  # evaluated (a hand-written schema may hold strings)
    problems = [f"{name}: only in the schema" for name in fields.keys() - params.keys()]
    problems += [f"{name}: only in the constructor" for name in params.keys() - fields.keys()]
    for name in fields.keys() & params.keys():
        field, param = fields[name], params[name]
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        expected = MISSING if param.default is inspect.Parameter.empty else param.default
        expected = list(expected) if isinstance(expected, tuple) else expected
        if default != expected or (type(default) is bool) != (type(expected) is bool):  # 0 == False in Python
            problems.append(f"{name}: default {default!r} != {expected!r}")
        want = _expected_type(hints.get(name, Any))
        if want is not None and field_types[name] != want:
            problems.append(f"{name}: type {field_types[name]} != {want} (hint {hints.get(name)})")
        hint_args = typing.get_args(hints.get(name))
        if type(None) in hint_args or hints.get(name, Any) is Any:
            try:  # optional in the constructor: null must pass the schema
                OmegaConf.merge(OmegaConf.structured(schema), {name: None})
            except ValidationError:
                problems.append(f"{name}: the constructor takes None, the schema does not")
    return problems


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_matches_its_constructor(name: str) -> None:
    schema = SCHEMAS[name]
    assert _disagreements(schema, get_class(schema._target_)) == []
    OmegaConf.structured(schema)  # and OmegaConf accepts every field with its default


class _Color(enum.Enum):
    RED = "red"


class _Hints:
    def __init__(
        self, count: int = 1, patience: int | None = 3, mode: Literal["global", "module"] = "global",
        maybe_mode: Literal["a", "b"] | None = None, flag: bool = True, names: tuple[str, ...] = ("a",),
        specs: Iterable[type[nn.Module] | str] = (), table: dict[str, float] | None = None,
        fn: Callable[..., Any] | None = None, choice: bool | Literal["x"] = True, color: _Color = _Color.RED,
        rate: float = 0.5, *args: Any, required: int, **kwargs: Any,
    ) -> None: ...


class _Stub:
    """A constructor to drift from: the historical bug was `nonfinite_loss_patience: int` for `int | None`."""

    def __init__(self, patience: int = 10, *, nonfinite_loss_patience: int | None = 3, mode: Literal["a", "b"] = "a",
                 diagnose: bool = False, device: str | None = None) -> None: ...


@dataclasses.dataclass
class _StubConfig:
    _target_: str = f"{__name__}._Stub"
    patience: int = 10
    nonfinite_loss_patience: Optional[int] = 3
    mode: str = "a"
    diagnose: Any = False
    device: Optional[str] = None


def _drifted(drop: tuple[str, ...] = (), **changes: tuple[Any, Any]) -> type:
    kinds = typing.get_type_hints(_StubConfig)
    fields = {f.name: (kinds[f.name], f.default) for f in dataclasses.fields(_StubConfig)} | changes
    return dataclasses.make_dataclass(
        "Drifted", [(name, kind, dataclasses.field(default=value)) for name, (kind, value) in fields.items()
                    if name not in drop]
    )


@pytest.mark.parametrize(
    "drop, changes, problem",
    [
        ((), {"nonfinite_loss_patience": (int, 3)}, "nonfinite_loss_patience: type"),  # the historical bug
        ((), {"patience": (int, 5)}, "patience: default 5 != 10"),
        ((), {"diagnose": (int, 0)}, "diagnose: default 0 != False"),
        ((), {"device": (str, "cuda")}, "device: default 'cuda' != None"),
        ((), {"mode": (Any, "a")}, "mode: type typing.Any != <class 'str'>"),
        (("mode",), {}, "mode: only in the constructor"),
        ((), {"window": (int, 100)}, "window: only in the schema"),
    ],
)
def test_the_check_fails_when_a_schema_drifts(drop: tuple, changes: dict, problem: str) -> None:
    assert _disagreements(_StubConfig, _Stub) == []  # the faithful schema passes
    found = _disagreements(_drifted(drop, **changes), _Stub)
    field = problem.split(":")[0]
    assert any(p.startswith(problem) for p in found) and all(p.startswith(f"{field}:") for p in found), found


def test_derived_schema_of_a_drifted_constructor_follows_it() -> None:
    assert _disagreements(derive_schema(_Stub), _Stub) == []
    fields = {f.name: f.type for f in dataclasses.fields(derive_schema(_Stub))}
    assert fields["nonfinite_loss_patience"] == Optional[int] and fields["device"] == Optional[str]


def test_derive_schema_maps_each_kind_of_hint() -> None:
    schema = derive_schema(_Hints)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    assert {name: f.type for name, f in fields.items()} == {
        "_target_": str, "count": int, "patience": Optional[int], "mode": str, "maybe_mode": Optional[str],
        "flag": Any, "names": list[str], "specs": list[Any], "table": Optional[dict[str, float]], "fn": Any,
        "choice": Any, "color": _Color, "rate": float, "required": int,
    }
    assert fields["_target_"].default == f"{__name__}._Hints" and fields["names"].default_factory() == ["a"]
    assert fields["required"].default == MISSING
    node = OmegaConf.structured(schema)
    node.patience, node.choice, node.table = None, "x", {"a": 1}
    with pytest.raises(ValidationError):
        node.count = 1.5  # int stays int
    node.flag = 2  # a bool is left to the constructor, which refuses 2 by name (OmegaConf would read it as True)
    assert node.flag == 2
    with pytest.raises(ValidationError):
        node.count = None  # not optional in the constructor, not in the schema


def test_derive_schema_refuses_what_a_config_cannot_hold() -> None:
    class Odd:
        def __init__(self, dtype: torch.dtype = torch.float16) -> None: ...

    class Unresolvable:
        def __init__(self, x: "NotImported" = 1) -> None: ...  # noqa: F821

    with pytest.raises(TypeError, match=r"the default of 'dtype' is torch.float16"):
        derive_schema(Odd)
    with pytest.raises(TypeError, match=r"an annotation does not evaluate .*NotImported"):
        derive_schema(Unresolvable)


# ----------------------------------------------------------------------------------------- composing our groups
def _one_run(overrides: Sequence[str]) -> list[str]:
    """``experiment=none`` unless one is chosen: the groups' own defaults (the main job is the showcase)."""
    chosen = any(o.lstrip("+~").startswith("experiment=") for o in overrides)
    return [*overrides] if chosen else [*overrides, "experiment=none"]


PRECISIONS = {"bf16_mixed": "bf16-mixed", "bf16_true": "bf16-true", "fp32": "32-true"}


def _compose(overrides: list[str]):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lit_mpstable.conf", version_base="1.3"):
        return compose(config_name="train", overrides=_one_run(overrides))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


_SCALERS = {"dynamic": DynamicLossScaler, "static": StaticLossScaler, "adaptive": AdaptiveLossScaler}


@pytest.mark.parametrize(
    "group, option", [(g, o) for g in ("precision", "scaler", "fp8", "callbacks") for o in _options(g)]
)
def test_every_option_composes_and_instantiates(group: str, option: str) -> None:
    overrides = [f"{group}={option}"]
    if group == "scaler" and option not in ("default", "none"):
        overrides += ["precision=fp16_mixed", "plugin.scaler.device=cpu"]  # scaling is for FP16 modes
    cfg = _compose(overrides)
    plugin = instantiate(cfg.plugin)
    assert type(plugin).__name__ == "StablePrecision"
    callbacks = [instantiate(node) for node in cfg.callbacks.values()]
    if group == "callbacks":
        assert len(callbacks) == (0 if option == "none" else 1 if option != "default" else 5)
    if group == "precision":
        expected = {"fp32": "32-true", "bf16_mixed": "bf16-mixed", "fp16_mixed": "16-mixed", "bf16_true": "bf16-true",
                    "fp16_true": "16-true", "auto": "bf16-mixed"}[option]
        assert plugin.precision == expected
    if group == "scaler":
        assert (plugin.scaler is None) == (option in ("default", "none"))  # default: none for bf16-mixed
        if option in _SCALERS:
            assert type(plugin.scaler) is _SCALERS[option] and plugin.scaler.is_enabled()
    if group == "fp8":
        assert (plugin.fp8 is None) == (option == "none")


def test_scaler_options_are_set_on_the_scaler_node() -> None:
    cfg = _compose(["precision=fp16_mixed", "scaler=dynamic", "plugin.scaler.device=cpu",
                    "plugin.scaler.init_scale=1024", "plugin.scaler.hysteresis=2"])
    plugin = instantiate(cfg.plugin)
    assert plugin.loss_scale == 1024.0 and plugin.scaler.hysteresis == 2


def test_a_scaler_node_without_a_device_scales_on_this_machine() -> None:
    plugin = instantiate(_compose(["precision=fp16_mixed", "scaler=dynamic", "plugin.scaler.init_scale=1024"]).plugin)
    assert plugin.scaler.is_enabled() and plugin.loss_scale == 1024.0


def test_nodes_are_typed_in_our_app() -> None:
    cfg = _compose(["callbacks.precision_fallback.nonfinite_loss_patience=null"])
    assert instantiate(cfg.callbacks.precision_fallback).nonfinite_loss_patience is None  # the trigger turns off
    with pytest.raises(ConfigCompositionException, match="patiense"):
        _compose(["callbacks.precision_fallback.patiense=3"])
    with pytest.raises(ConfigCompositionException, match="plugin.scaler.init_scale"):
        _compose(["precision=fp16_mixed", "scaler=dynamic", "plugin.scaler.init_scale=big"])


@pytest.mark.parametrize("registered", [True, False])
def test_any_hydra_app_composes_our_groups_through_the_search_path(registered: bool, tmp_path, monkeypatch) -> None:
    # An app with an empty config directory of its own: our groups come from the search-path plugin.
    register_configs()
    if not registered:  # an app that never called register_configs(): untyped nodes, still instantiable
        monkeypatch.delitem(ConfigStore.instance().repo, "schema")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        cfg = compose(overrides=["+precision=fp16_mixed", "+scaler=dynamic", "+callbacks=overflow_monitor",
                                 "++plugin.scaler.device=cpu", "++plugin.scaler.init_scale=256"])
        providers = [e.provider for e in GlobalHydra.instance().config_loader().get_search_path().get_path()]
    assert "lit_mpstable" in providers
    plugin = instantiate(cfg.plugin)
    assert plugin.precision == "16-mixed" and type(plugin.scaler) is DynamicLossScaler and plugin.loss_scale == 256.0
    assert type(instantiate(cfg.callbacks.overflow_monitor)).__name__ == "OverflowMonitor"
    assert ("window" in cfg.callbacks.overflow_monitor) == registered  # the schema's fields, when registered


def test_the_search_path_plugin_imports_hydra_only() -> None:
    # Hydra imports every plugin module when any app starts: ours must not pull in torch, Lightning or ourselves.
    probe = ("import sys, hydra_plugins.lit_mpstable_searchpath.lit_mpstable_searchpath; "
             "print(sorted(m for m in ('torch', 'lightning', 'lit_mpstable') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("option", _options("model"))
def test_models_and_data_instantiate(option: str) -> None:
    cfg = _compose([f"model={option}", f"data={'digits' if option == 'mlp' else 'stdlib_chars'}"])
    data = instantiate(cfg.data)
    extra = {"vocab_size": data.vocab_size, "seq_len": data.seq_len} if hasattr(data, "vocab_size") else {}
    model = instantiate(cfg.model, **extra)
    assert sum(p.numel() for p in model.parameters()) > 0


# -------------------------------------------------------------------------------------------------- running it
@pytest.mark.parametrize(
    "overrides",
    [
        ["precision=bf16_mixed"],
        ["precision=fp16_mixed", "model=mlp", "data=digits", "scaler=dynamic", "plugin.scaler.device=cpu"],
        ["precision=bf16_true", "fp8=current"],
    ],
)
def test_five_step_runs_write_summary_and_report(overrides: list[str], tmp_path: Path) -> None:
    from lit_mpstable.app.train import run

    quick = ["trainer.max_steps=5", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
             "trainer.limit_val_batches=0"]
    if "model=mlp" not in overrides:
        quick.append("model.d_model=32")
    cfg = _compose([*overrides, *quick])
    summary = run(cfg, tmp_path)
    assert summary["steps"] == 5 and summary["final_train_loss"] == pytest.approx(summary["train_loss_curve"][-1])
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 5
    report = (tmp_path / "report.md").read_text()
    assert "Stability report" in report and (tmp_path / "loss.png").stat().st_size > 0
    # The loss-scale figure only where a scaler moves the scale: a flat line at 1 says nothing (BF16 runs).
    scaled = summary["precision"] == "16-mixed"
    assert (tmp_path / "loss_scale.png").exists() == scaled and ("loss_scale.png" in report) == scaled


@pytest.mark.slow
def test_the_memory_preset_runs_with_every_callback(tmp_path: Path) -> None:
    # bf16-true, stochastic rounding, torchao's AdamW8bit and the default callbacks: ScaleCheckpoint snapshots the
    # quantized states (their clone is unimplemented: the preset crashed at its first snapshot).
    pytest.importorskip("torchao.optim")
    from lit_mpstable.app.train import run

    cfg = _compose(["experiment=memory", "callbacks=default", "model.d_model=32", "trainer.max_steps=6",
                    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                    "trainer.limit_val_batches=0", "callbacks.scale_checkpoint.every_n_steps=2"])
    summary = run(cfg, tmp_path)
    assert summary["steps"] == 6 and summary["precision"] == "bf16-true"


def test_a_report_without_matplotlib_says_why(tmp_path: Path, monkeypatch) -> None:
    from lit_mpstable.app.report import write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ModuleNotFoundError
    summary = {"precision": "16-mixed", "model": "M", "steps": 2, "final_train_loss": 1.0,
               "loss_scale_trajectory": [2.0, 1.0], "skipped_trajectory": [False, True], "train_loss_curve": [2.0, 1.0]}
    with pytest.warns(UserWarning, match=r"matplotlib is not installed"):
        text = write_report(summary, tmp_path).read_text()
    assert 'pip install "lit_mpstable[report]"' in text and "![" not in text
    assert not list(tmp_path.glob("*.png"))


def test_the_report_says_each_decision_once_what_was_done_and_why(tmp_path: Path, monkeypatch) -> None:
    # make run's events as the callbacks record them: a fallback, a NaN batch, a spike that ScaleCheckpoint skipped
    # and FaultTriage classified (one event, two records), a transient fault, a rollback FaultTriage asked for.
    from lit_mpstable.app.report import decision_line, write_comparison_report, write_report
    from lit_mpstable.app.train import _events
    from lit_mpstable.callbacks import FaultTriage, PrecisionFallback, ScaleCheckpoint
    from lit_mpstable.core.guards.triage import triage_event

    fallback, checkpoint, triage = PrecisionFallback(), ScaleCheckpoint(), FaultTriage()
    fallback.decisions = [dict(step=45, action="fallback", modules=["model.0"], reason="overflow storm in model.0",
                               effect="model.0 now computes in FP32")]
    checkpoint.events = [dict(step=260, kind="loss spike (SpikeGuard)", loss=41.5, zscore=57.25, action="skip"),
                         dict(step=330, kind="fault triage: state", loss=None, zscore=None, action="rollback",
                              restored_step=300)]
    spiked = ["as_is:nonfinite", "fp32:nonfinite", "snapshot:none"]
    triage.events = [triage_event(200, "data", [], 16, spiked), triage_event(260, "data", [], 7, spiked),
                     triage_event(320, "transient", [], 21, ["as_is:clean"]),
                     triage_event(330, "state", [], 8, ["as_is:nonfinite", "fp32:nonfinite", "snapshot:clean"],
                                  restored_step=300)]
    events = _events([fallback, checkpoint, triage])
    lines = [decision_line(e) for e in events]
    assert [e["step"] for e in events] == [45, 200, 260, 320, 330], lines  # one line per decision
    assert lines[0] == "step 45: model.0 now computes in FP32: PrecisionFallback: overflow storm in model.0"
    assert lines[2] == ("step 260: skipped the batch: ScaleCheckpoint: loss spike (SpikeGuard), loss 41.5, z-score"
                        " 57.2; FaultTriage: data, not clean on any replay (replayed as is, in FP32; no snapshot)")
    assert lines[3] == ("step 320: applied the clean replay: FaultTriage: transient, clean when replayed as is"
                        " (replayed as is)")
    assert lines[4].startswith("step 330: rolled back to step 300: FaultTriage: state, clean only from the snapshot")
    for line in lines:  # the verb said once
        done = line.split(": ")[1]
        assert line.count(done) == 1 and "skip: skip" not in line, line
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the text only: no figures
    summary = {"model": "FaultyMLP", "precision": "16-mixed", "events": events}
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        text = write_report(summary, tmp_path / "one").read_text()
    assert [f"- {line}" for line in lines] == [row for row in text.splitlines() if row.startswith("- step")]
    both = {"runs": {"builtin": {**summary, "label": "built-in", "events": []}, "stable": {**summary, "label": "ours"}},
            "rows": []}
    (tmp_path / "both").mkdir()
    assert [f"- {line}" for line in lines] == [
        row for row in write_comparison_report(both, tmp_path / "both").read_text().splitlines()
        if row.startswith("- step")]


def test_a_spike_the_ladder_handed_to_triage_names_its_detector_and_the_verdict() -> None:
    # The ladder's event for a spike SpikeGuard flagged, whose replays were not clean either (the triage's verdict,
    # data, took the step): one line with both reasons, the detector's first.
    from lit_mpstable.app.report import decision_line
    from lit_mpstable.app.train import _events
    from lit_mpstable.callbacks import FaultTriage
    from lit_mpstable.core.guards.triage import triage_event

    triage = FaultTriage()
    triage.events = [triage_event(260, "data", [], 7, ["as_is:nonfinite", "fp32:nonfinite", "snapshot:nonfinite"])]
    ladder = [dict(step=260, fault="spike", rung="skip", action="skip", reason="SpikeGuard judged the step a spike",
                   remaining=[], by="PrecisionFallback", verdict="data", done=True),
              dict(step=40, fault="overflow", rung="fallback", action="fallback", reason="overflow storm",
                   remaining=[], by="PrecisionFallback", done=True)]
    lines = [decision_line(e) for e in _events([triage], ladder=ladder)]
    assert lines == ["step 260: skipped the batch: SpikeGuard judged the step a spike; FaultTriage: data, not clean on"
                     " any replay (replayed as is, in FP32, from the snapshot)"]


def test_digits_without_scikit_learn_names_the_extra(monkeypatch) -> None:
    from lit_mpstable.app.zoo import DigitsData

    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ModuleNotFoundError, match=r'pip install "lit_mpstable\[demo\]"'):
        DigitsData().setup()


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lit_mpstable.app.train", *_one_run(args)], cwd=cwd, capture_output=True, text=True,
        timeout=300
    )


@pytest.mark.slow
def test_two_job_multirun_with_the_basic_launcher(tmp_path: Path) -> None:
    result = _cli("-m", "precision=fp32,bf16_mixed", "model=mlp", "data=digits", "callbacks=none",
                  "trainer.max_steps=3", "trainer.enable_progress_bar=false", f"hydra.sweep.dir={tmp_path}",
                  cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    summaries = sorted(tmp_path.glob("*/summary.json"))
    assert [json.loads(p.read_text())["precision"] for p in summaries] == ["32-true", "bf16-mixed"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, code, messages",
    [
        (["precision=fp17"], 1, ["Available options in 'precision'"]),
        (["plugin.master_weights=maybe"], None, ["master_weights", "maybe"]),
        (["callbacks.precision_fallback.mode=layer"], 2, ["PrecisionFallback(mode='layer'): allowed"]),
        (["plugin.precision=fp16"], 2, ["StablePrecision(precision='fp16')"]),
        # the group's name used as a key, on the default config (where plugin.scaler is the name 'auto')
        (["scaler.init_scale=-1"], 2, ["'scaler.init_scale=-1'", "scaler=dynamic (or static, adaptive)"
                                                                 " plugin.scaler.init_scale=1024"]),
        (["plugin.scaler.init_scale=-1"], 1, ["Key 'init_scale' is not in struct", "plugin.scaler.<option>"]),
        (["precision=fp16_mixed", "scaler=dynamic", "plugin.scaler.init_scale=-1"], 2,
         ["DynamicLossScaler(init_scale=-1"]),
        # a pattern that matches no module: the name check runs before training, with the model's real names
        (["plugin.fp32_modules=[model.hed]"], 2, ["['model.hed']", "match no module of GPTLM", "'model.head'"]),
        (["+plugin.fp8={recipe: delayed, filter: [model.blocks.*.nope]}"], 2,
         ["['model.blocks.*.nope'] match no nn.Linear layer", "model.blocks.0.fc"]),
    ],
)
def test_config_mistakes_fail_before_training_with_the_fix(overrides, code, messages, mistakes) -> None:
    result = mistakes[tuple(overrides)]
    assert result["code"] != 0 and (code is None or result["code"] == code), result["stderr"][-2000:]
    for message in messages:
        assert message in result["stderr"], result["stderr"][-2000:]
    assert "Traceback" not in result["stderr"]  # one message, not a wall
    assert "GPU available" not in result["stdout"] + result["stderr"]  # failed before the Trainer was built


@pytest.fixture(scope="module")
def mistakes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict]:
    """Every selected case of the test above, run by the console entry point in one process (tests/cli_batch.py):
    {overrides: {"code", "stdout", "stderr"}}."""
    name = test_config_mistakes_fail_before_training_with_the_fix.__name__
    cases = [tuple(item.callspec.params["overrides"]) for item in request.session.items
             if item.path == request.node.path and item.originalname == name]
    cwd = tmp_path_factory.mktemp("mistakes")
    commands = [_one_run([*case, "trainer.max_steps=1", "model.d_model=32", f"hydra.run.dir={cwd / str(i)}"])
                for i, case in enumerate(cases)]
    return dict(zip(cases, run_batch(commands, cwd=cwd)))


@pytest.mark.slow
def test_the_main_job_runs_both_precisions_side_by_side(tmp_path: Path) -> None:
    # `make run`: no overrides at all. The same faulty FP16 run with Lightning's built-in precision and with ours.
    result = subprocess.run([sys.executable, "-m", "lit_mpstable.app.train", f"hydra.run.dir={tmp_path}",
                             "trainer.enable_progress_bar=false"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    builtin, ours = runs["builtin"], runs["stable"]
    assert builtin["precision"] == ours["precision"] == "16-mixed" and builtin["steps"] == ours["steps"] == 400
    assert builtin["callbacks"] == [] and "PrecisionFallback" in ours["callbacks"]
    # The storm collapses the built-in scaler; ours moves the overflowing layer to FP32, skips the spike.
    assert builtin["loss_scale"] < 1e-10 and builtin["skipped_steps"] > 60
    assert ours["skipped_steps"] < 12 and ours["fallbacks"] >= 1
    assert ours["val_acc"] > builtin["val_acc"] + 0.1
    # The injected loss spike (step 260) is skipped by SpikeGuard and the transient fault (step 320) is replayed and
    # classified by FaultTriage, in our run only; both runs get the same faults.
    assert builtin["injected_faults"] == ours["injected_faults"] == [[260, "loss_spike"], [320, "transient"]]
    assert builtin["spikes_skipped"] is None and builtin["faults_triaged"] is None
    assert ours["spikes_skipped"] >= 1 and ours["faults_triaged"] >= 2
    assert any(e["step"] == 320 and e["kind"] == "use_replay" for e in ours["events"])
    # The spike: SpikeGuard flags it; where its replays are not clean either (here: non-finite) the ladder's table
    # goes on to FaultTriage's verdict, data: one skip whose reason names both.
    assert any(e["step"] == 260 and e["kind"] == "skip" and "SpikeGuard" in e["why"] for e in ours["events"])
    # One line per decision: the spike ScaleCheckpoint skipped and FaultTriage classified is one.
    assert [e["step"] for e in ours["events"]].count(260) == 1
    cells = {cell.strip() for line in result.stdout.splitlines() for cell in re.split("[│┃]", line)}
    assert {"Lightning built-in", "lit_mpstable", "val accuracy", "skipped steps", "spikes skipped",
            "faults triaged"} <= cells
    report = (tmp_path / "report.md").read_text()
    assert "![both runs](comparison.png)" in report and (tmp_path / "comparison.png").stat().st_size > 10_000
    assert (tmp_path / "builtin" / "report.md").exists() and (tmp_path / "stable" / "report.md").exists()


@pytest.mark.slow
def test_a_main_job_too_short_for_its_faults_fails_before_training_with_the_overrides(tmp_path: Path) -> None:
    # The showcase injects faults at steps 260 and 320; a quick try with fewer steps is refused before any training,
    # naming the key and overrides that work (Hydra refuses a plain compare.faults.schedule={...}: not in struct).
    [result] = run_batch([["trainer.max_steps=100", f"hydra.run.dir={tmp_path}"]], cwd=tmp_path)
    stderr = result["stderr"]
    assert result["code"] == 2, stderr[-2000:]
    assert "trainer.max_steps=100" in stderr and "compare.faults.schedule" in stderr, stderr[-2000:]
    assert "Traceback" not in stderr and "GPU available" not in result["stdout"] + stderr
    drop, *move = re.findall(r"'([~+]compare\.faults[^']*)'", stderr)
    assert drop == "~compare.faults" and "faults" not in _compose(["experiment=showcase", drop]).compare
    schedule = _compose(["experiment=showcase", "trainer.max_steps=100", *move]).compare.faults.schedule
    assert sorted(schedule.values()) == ["loss_spike", "transient"] and max(schedule) < 100


@pytest.mark.parametrize("registered", [True, False])
def test_the_readme_hydra_recipe_composes_with_or_without_register_configs(registered: bool, tmp_path,
                                                                            monkeypatch) -> None:
    # The documented train.yaml (docs/configs.md, linked from the README), verbatim: it must compose whether or not
    # the app called register_configs() first.
    readme = (Path(__file__).resolve().parents[1] / "docs" / "configs.md").read_text()
    block = readme.split("```yaml\n# configs/train.yaml\n", 1)[1].split("# configs/trainer/", 1)[0]
    (tmp_path / "train.yaml").write_text(block)
    register_configs()
    if not registered:
        monkeypatch.delitem(ConfigStore.instance().repo, "schema")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["precision=fp16_mixed", "scaler=dynamic",
                                                      "++plugin.scaler.device=cpu"])
    plugin = instantiate(cfg.plugin)
    assert plugin.precision == "16-mixed" and type(plugin.scaler) is DynamicLossScaler
    assert ("diagnose" in cfg.plugin) == registered  # typed (every field) when the schemas are registered


@pytest.mark.parametrize("precision", ["bf16_mixed", "bf16_true", "fp32"])
def test_hydra_refuses_a_scaler_outside_fp16_as_the_constructor_does(precision: str) -> None:
    from lit_mpstable.app.train import build

    with pytest.raises(ValueError, match=r"only for the FP16 precisions") as by_name:
        StablePrecision(PRECISIONS[precision], scaler="adaptive")
    with pytest.raises(ValueError) as error:
        build(_compose([f"precision={precision}", "scaler=adaptive"]))
    assert str(by_name.value) in str(error.value) and str(error.value).startswith("scaler=adaptive")
    # A Hydra app of one's own instantiates the node itself (no build): the constructor refuses the scaler object
    # it is handed, with the same rule (this once trained with loss scaling, exit status 0).
    with pytest.raises(Exception, match=r"scaler=AdaptiveLossScaler\(\.\.\.\)\): loss scaling is only for the"
                                        r" FP16 precisions"):
        instantiate(_compose([f"precision={precision}", "scaler=adaptive", "plugin.scaler.device=cpu"]).plugin)
    # The default scaler node ('auto') and scaler=none compose and build on every precision.
    for scaler in ("default", "none"):
        plugin = instantiate(_compose([f"precision={precision}", f"scaler={scaler}"]).plugin)
        assert plugin.scaler is None
