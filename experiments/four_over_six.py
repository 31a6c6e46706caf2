"""Four Over Six (arXiv 2512.02010, TransformerEngine's ``nvfp4_4over6``) vs plain NVFP4: quantization error.

    .venv/bin/python experiments/four_over_six.py               # seconds on 1 thread
    .venv/bin/python experiments/four_over_six.py --steps 5     # shorter GPT warm-up

Both with TransformerEngine's NVFP4 arithmetic (``nvfp4_quantize``, round to nearest, 1x16 blocks): plain NVFP4
scales each block's amax to 6 with the global scale ``448 * 6 / amax``; 4/6 uses ``256 * 6 / amax`` and picks, per
block, the map-to-4 or the map-to-6 scale by the smaller sum of absolute errors. Data: N(0, 1), Laplace(0, 1), and
gradients captured from the ``lit_mpstable.app.zoo`` GPT after a short AdamW warm-up on the generated Markov-with-copy
language of ``experiments/fp8_recipes.py``: each linear layer's weight gradient and output gradient (what the
wgrad/dgrad GEMMs quantize). The relative error of a tensor is ``||q(x) - x||_2 / ||x||_2``; the table gives the mean
over the tensors of a source and the fraction of blocks that chose 4. Writes
``experiments/results/four_over_six/{table.md,table.json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_recipes import markov_language  # noqa: E402

from lit_mpstable.app.zoo import GPT  # noqa: E402
from lit_mpstable.fp8.nvfp4 import E4M3_MAX_4OVER6, nvfp4_dequantize, nvfp4_quantize  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "four_over_six"


def relative_error(x: torch.Tensor, four_over_six: bool, metric: str = "mae") -> tuple[float, float]:
    """(relative L2 error, fraction of blocks scaled to 4) of ``x`` (2-D, fp32) under NVFP4 1x16."""
    q = nvfp4_quantize(x, four_over_six=four_over_six, four_over_six_error=metric)  # type: ignore[arg-type]
    err = float((nvfp4_dequantize(q) - x).norm() / x.norm())
    if not four_over_six:
        return err, 0.0
    # A block scaled to 4 has a scale 1.5 times its map-to-6 one: compare with the map-to-6 scale of 4/6's S_enc.
    amax = x.abs().amax()
    block_amax = x.abs().unflatten(-1, (-1, 16)).amax(-1).reshape(q.block_scale.shape)
    s_enc = torch.tensor(E4M3_MAX_4OVER6 * 6.0) / amax
    six = (block_amax * (s_enc * torch.tensor(1 / 6.0))).clamp(max=448).to(torch.float8_e4m3fn).float()
    chose_4 = (q.block_scale.float() != six) & (block_amax > 0)
    return err, float(chose_4.float().mean())


def gpt_gradients(steps: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Weight and output gradients of every linear layer of the zoo GPT after ``steps`` AdamW steps (fp32)."""
    torch.manual_seed(seed)
    vocab, seq_len = 64, 64
    model = GPT(vocab, 128, 2, 4, seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = markov_language(vocab, seq_len, 32 * (steps + 1), seed=seed)
    out_grads: dict[str, torch.Tensor] = {}
    hooks = [m.register_full_backward_hook(lambda mod, gi, go, name=name: out_grads.__setitem__(name, go[0]))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for step in range(steps + 1):
        batch = data[32 * step: 32 * (step + 1)]
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        if step < steps:
            opt.step()
    for h in hooks:
        h.remove()
    grads = [(f"{n}.weight.grad", m.weight.grad.detach().clone()) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)]
    grads += [(f"{n}.output.grad", g.detach().flatten(0, -2).clone()) for n, g in out_grads.items()]
    return grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="AdamW steps before the gradients are captured")
    parser.add_argument("--tensors", type=int, default=8, help="random tensors per synthetic distribution")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    laplace = torch.distributions.Laplace(0.0, 1.0)
    torch.manual_seed(args.seed)
    sources: dict[str, list[tuple[str, torch.Tensor]]] = {
        "gaussian N(0,1)": [(f"gauss{i}", torch.randn(256, 1024, generator=g)) for i in range(args.tensors)],
        "laplace(0,1)": [(f"laplace{i}", laplace.sample((256, 1024))) for i in range(args.tensors)],
        f"GPT gradients (step {args.steps})": gpt_gradients(args.steps, args.seed),
    }
    rows = []
    for source, tensors in sources.items():
        plain = [relative_error(t, False)[0] for _, t in tensors]
        fos = [relative_error(t, True) for _, t in tensors]
        fos_mse = [relative_error(t, True, "mse") for _, t in tensors]
        rows.append({
            "source": source,
            "tensors": len(tensors),
            "nvfp4_rel_err": sum(plain) / len(plain),
            "four_over_six_rel_err": sum(e for e, _ in fos) / len(fos),
            "four_over_six_mse_rel_err": sum(e for e, _ in fos_mse) / len(fos_mse),
            "blocks_scaled_to_4": sum(f for _, f in fos) / len(fos),
            "tensors_improved": sum(f[0] < p for f, p in zip(fos, plain, strict=True)),
            "per_tensor": {n: {"nvfp4": p, "four_over_six": f[0]} for (n, _), p, f in zip(tensors, plain, fos,
                                                                                           strict=True)},
        })
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"arithmetic": "TransformerEngine NVFP4 1x16, round to nearest; 4/6: S_enc with 256, MAE selection, "
                          "ties keep 6", "metric": "mean over tensors of ||q(x) - x||_2 / ||x||_2",
            "args": vars(args), "torch": torch.__version__}
    (OUT / "table.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = ["# Four Over Six vs NVFP4: relative quantization error", "",
             f"`experiments/four_over_six.py --steps {args.steps} --tensors {args.tensors} --seed {args.seed}`; "
             "TransformerEngine's NVFP4 arithmetic (1x16, round to nearest), 4/6 with TE's 256 global scale and "
             "the smaller-absolute-error block choice (TE's default); 4/6 (MSE): the smaller-squared-error choice "
             "(TE's other mode). Relative error: mean over tensors of ||q(x) - x|| / ||x||.",
             "", "| source | tensors | NVFP4 | 4/6 | change | 4/6 (MSE) | blocks scaled to 4 | tensors improved |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        change = r["four_over_six_rel_err"] / r["nvfp4_rel_err"] - 1
        lines.append(f"| {r['source']} | {r['tensors']} | {r['nvfp4_rel_err']:.4f} | "
                     f"{r['four_over_six_rel_err']:.4f} | {change:+.1%} | {r['four_over_six_mse_rel_err']:.4f} | "
                     f"{r['blocks_scaled_to_4']:.1%} | "
                     f"{r['tensors_improved']}/{r['tensors']} |")
    (OUT / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
