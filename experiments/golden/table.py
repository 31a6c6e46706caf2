"""What each recipe's arithmetic equals: every golden file (TransformerEngine's and torchao's arithmetic, see
tests/golden/README.md) against our quantizers, with the recipe defaults and with the other options, counted as the
README counts (elements whose bits differ). Writes experiments/results/golden/table.md and table.json.

    python experiments/golden/table.py [--golden DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from lit_mpstable.fp8.blockwise import blockwise_quantize
from lit_mpstable.fp8.hadamard import random_hadamard_transform
from lit_mpstable.fp8.mx import mx_dequantize, mx_quantize
from lit_mpstable.fp8.nvfp4 import nvfp4_dequantize, nvfp4_quantize

ROOT = Path(__file__).resolve().parents[2]
Case = dict[str, torch.Tensor]


def cases(folder: Path, name: str) -> dict[str, Case]:
    out: dict[str, Case] = {}
    for key, value in torch.load(folder / f"{name}.pt", weights_only=True).items():
        case, field = key.split(".", 1)
        out.setdefault(case, {})[field] = value
    return out


def differ(ours: torch.Tensor, ref: torch.Tensor) -> int:
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        return ref.numel()
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[ref.element_size()]
    return int((ours.contiguous().view(view) != ref.contiguous().view(view)).sum())


def mx(element: str, rule: str) -> Callable[[Case], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    def run(g: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        q = mx_quantize(g["x"], element, scale_rule=rule)  # type: ignore[arg-type]
        return q.scale_e8m0, g["scale_e8m0"], mx_dequantize(q), g["dequant"]
    return run


def nvfp4(rows: int, floor: str | None, rht: bool = False
          ) -> Callable[[Case], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    def run(g: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x = random_hadamard_transform(g["x"].t().contiguous(), g["sign_vector"].float()) if rht else g["x"]
        q = nvfp4_quantize(x, tile=(rows, 16), block_scale_floor=floor)  # type: ignore[arg-type]
        ref = g["block_scale"]
        return q.block_scale.reshape(ref.shape).float(), ref, nvfp4_dequantize(q), g["dequant"]
    return run


def blockwise(rows: int) -> Callable[[Case], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    def run(g: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        from lit_mpstable.fp8.blockwise import blockwise_dequantize
        q = blockwise_quantize(g["x"], tile=(rows, 128))
        return q.scale_inv.reshape(g["scale_inv"].shape), g["scale_inv"], blockwise_dequantize(q), g["dequant"]
    return run


# (file, what it is, the recipe default that should equal it, {label: quantizer})
FILES = [
    ("mxfp8_e4m3_rceil_te", "TE MXFP8 (RCEIL)", "mxfp8", {"default (rceil)": mx("fp8_e4m3", "rceil"),
                                                           "scale_rule='floor'": mx("fp8_e4m3", "floor")}),
    ("mxfp4_e2m1_rceil_te", "TE MXFP4 (RCEIL)", "mxfp4", {"default (rceil)": mx("fp4_e2m1", "rceil"),
                                                           "scale_rule='floor'": mx("fp4_e2m1", "floor")}),
    ("mxfp8_e4m3_floor_ocp", "OCP MXFP8 (FLOOR)", "mxfp8", {"default (rceil)": mx("fp8_e4m3", "rceil"),
                                                             "scale_rule='floor'": mx("fp8_e4m3", "floor")}),
    ("mxfp4_e2m1_floor_ocp", "OCP MXFP4 (FLOOR)", "mxfp4", {"default (rceil)": mx("fp4_e2m1", "rceil"),
                                                             "scale_rule='floor'": mx("fp4_e2m1", "floor")}),
    ("nvfp4_1x16_te", "TE NVFP4 1x16", "nvfp4", {"default": nvfp4(1, None),
                                                 "block_scale_floor='e4m3_tiny'": nvfp4(1, "e4m3_tiny")}),
    ("nvfp4_16x16_te", "TE NVFP4 16x16 (weights)", "nvfp4", {"default": nvfp4(16, None),
                                                             "block_scale_floor='e4m3_tiny'": nvfp4(16, "e4m3_tiny")}),
    ("nvfp4_rht16_1x16_te", "TE NVFP4 wgrad (RHT 16, 1x16)", "nvfp4", {"default": nvfp4(1, None, rht=True)}),
    ("nvfp4_1x16_torchao_nvfp4tensor", "torchao NVFP4Tensor", "nvfp4",
     {"default": nvfp4(1, None), "block_scale_floor='e4m3_tiny'": nvfp4(1, "e4m3_tiny")}),
    ("blockwise_e4m3_1x128_te", "TE blockwise 1x128", "blockwise", {"default": blockwise(1)}),
    ("blockwise_e4m3_128x128_te", "TE blockwise 128x128", "blockwise", {"default": blockwise(128)}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", type=Path, default=ROOT / "tests" / "golden")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "golden")
    args = parser.parse_args()
    rows = []
    for name, what, recipe, variants in FILES:
        data = cases(args.golden, name)
        for label, run in variants.items():
            scales = values = n_scales = n_values = 0
            for g in data.values():
                ours_s, ref_s, ours_v, ref_v = run(g)
                scales, n_scales = scales + differ(ours_s, ref_s), n_scales + ref_s.numel()
                values, n_values = values + differ(ours_v, ref_v), n_values + ref_v.numel()
            rows.append({"file": name, "reference": what, "recipe": recipe, "arithmetic": label, "cases": len(data),
                         "scales_differ": scales, "scales": n_scales, "values_differ": values, "values": n_values})
            print(f"{name:34s} {label:32s} scales {scales}/{n_scales}  values {values}/{n_values}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.json").write_text(json.dumps(rows, indent=1))
    lines = [f"# Our quantizers against the golden vectors ({platform.machine()}, torch {torch.__version__})", "",
             "Elements whose bits differ from the reference (block scales; dequantized values), every case of each"
             " file. Command: `python experiments/golden/table.py`.", "",
             "| reference | recipe | our arithmetic | cases | block scales differing | values differing |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        pct = lambda a, b: f"{a}/{b} ({100 * a / b:.1f}%)" if a else f"0/{b}"  # noqa: E731
        lines.append(f"| {r['reference']} (`{r['file']}`) | {r['recipe']} | {r['arithmetic']} | {r['cases']} |"
                     f" {pct(r['scales_differ'], r['scales'])} | {pct(r['values_differ'], r['values'])} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
