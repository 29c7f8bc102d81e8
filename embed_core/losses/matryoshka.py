"""Matryoshka representation learning (Kusupati et al. 2022), as sentence-transformers'
``MatryoshkaLoss`` defines it: a task's loss applied to the embeddings cut to each trained
dimension, summed with the dimensions' weights,

    L_MRL = Σ_k w_k · L(trunc_{d_k}(e))      trunc_d(e) = e[:d] / ‖e[:d]‖

Every loss here takes L2-normalised embeddings (``embed_core.losses.base``), so a cut embedding is
normalised again before the loss sees it (sentence-transformers' losses take cosine similarities of
the cut embeddings, which is the same). The cut is on embeddings, after the encoder passes: the
passes run once per micro-batch whatever the number of dimensions, the GradCache path backpropagates
the summed loss to its cached embeddings, and under several ranks each dimension's loss makes the
same gathers on every rank. Not a ``Loss`` of the registry: it wraps the loss a task trains with
(``train.matryoshka``, ``TrainConfig.matryoshka_of``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor

from embed_core.losses.base import Loss, LossContext


def truncate(emb: dict[str, Tensor], dim: int, full: int) -> dict[str, Tensor]:
    """Every text group's embeddings cut to their first ``dim`` coordinates and L2-normalised again
    (unchanged at the model's full size ``full``)."""
    if dim >= full:
        return emb
    return {name: F.normalize(t[..., :dim], dim=-1) for name, t in emb.items()}


class Matryoshka:
    """``loss`` at each of ``dims`` (descending), weighted by ``weights``: one call of the wrapped
    loss per dimension on the same batch and context."""

    def __init__(self, loss: Loss, dims: Sequence[int], weights: Sequence[float]):
        if len(dims) != len(weights):
            raise ValueError(f"Matryoshka: {len(dims)} dims and {len(weights)} weights")
        self.loss, self.dims, self.weights = loss, list(dims), list(weights)

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        full = next(iter(emb.values())).size(-1)
        total = None
        for dim, weight in zip(self.dims, self.weights):
            term = weight * self.loss(truncate(emb, dim, full), batch, ctx)
            total = term if total is None else total + term
        return total
