"""The 16x16 random Hadamard transform of the NVFP4 recipe: random signs times a normalized Hadamard matrix,
applied blockwise along the last dim; orthogonal, so a GEMM over that dim is unchanged when both operands get it."""

from __future__ import annotations

import math

import torch

HADAMARD_SIZE = 16
"""Block length of the transform (NVIDIA's NVFP4 recipe; TransformerEngine and torchao use 16 as well)."""


def hadamard_matrix(n: int = HADAMARD_SIZE, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Sylvester's ``n x n`` Hadamard matrix over ``sqrt(n)``, fp32: symmetric, orthogonal, its own inverse.

    Raises:
        ValueError: ``n`` is not a power of two (Sylvester's construction doubles a 1x1 matrix).
    """
    if not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix(n={n!r}): n must be a power of two; 16 is the NVFP4 recipe's.")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h / math.sqrt(n)


def random_signs(
    n: int = HADAMARD_SIZE, *, generator: torch.Generator | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """``n`` independent ±1 (fp32) from ``generator``, the diagonal of the transform; seeded, it repeats."""
    bits = torch.randint(0, 2, (n,), generator=generator, device=device)
    return (bits * 2 - 1).float()


def random_hadamard_transform(x: torch.Tensor, signs: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Each run of ``len(signs)`` elements along ``x``'s last dim times ``M = diag(signs) @ H`` (``M.T`` with
    ``inverse``), computed in fp32 and returned in ``x``'s dtype.

    ``M`` is orthogonal, so ``A @ B.T == transform(A) @ transform(B).T`` for operands whose last dim is the
    reduction dim (the weight gradient's inputs, tokens last), and ``inverse`` undoes the transform.

    The entries of ``M`` are ``±1/4`` for 16 (powers of two), so each product is exact; the 16 are summed in fp32
    and rounded once to ``x``'s dtype: on a bf16 ``x`` this is TransformerEngine's RHT (``reference_rht`` with
    IEEE subnormals) bit for bit, as the golden vectors check.

    Raises:
        ValueError: ``signs`` is not a vector of power-of-two length, or ``x``'s last dim is not a multiple of
            it (pad that dim with zeros, which the transform keeps zero in sum).
    """
    n = signs.numel()
    # The values are not checked: that would read the device on every call.
    if signs.dim() != 1 or n == 0 or n & (n - 1):
        raise ValueError(f"random_hadamard_transform(signs of shape {tuple(signs.shape)}): signs must be a 1-D "
                         "tensor of ±1 of power-of-two length; build it with random_signs(16, generator=...).")
    if x.dim() == 0 or x.shape[-1] % n:
        raise ValueError(
            f"random_hadamard_transform(x of shape {tuple(x.shape)}): the last dim must be a multiple of {n}, the "
            "transform's block; pad it with zeros or leave this tensor untransformed."
        )
    m = signs.float().to(x.device).unsqueeze(-1) * hadamard_matrix(n, device=x.device)
    if inverse:
        m = m.T
    y = x.float().unflatten(-1, (-1, n)) @ m
    return y.flatten(-2).to(x.dtype)
