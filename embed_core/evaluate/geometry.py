"""Token-embedding geometry (CoDiEmb §4, after CSE-SFP): how over-smoothed and anisotropic the
token representations of a model are, measured over the sentences of an STS test set.

For one sentence, X ∈ R^{n×d} holds the last hidden states of its n tokens (rows x_i):

* token similarity  TokSim(X) = 1/(n(n−1)) Σ_{i≠j} cos(x_i, x_j), ×100 (lower: less over-smoothing)
* rank              numerical rank of X (torch.linalg.matrix_rank's default tolerance; higher: richer)
* condition number  κ(X) = σ_max / σ_min over X's singular values (lower: more uniform spectrum)
* SVD entropy       p_i = σ_i² / Σ_j σ_j², H = −Σ p_i ln p_i (higher: more effective dimensions)

Each is averaged over sentences. Choices where the paper is silent: the last layer; special
tokens ([CLS], [SEP], padding) left out, so X holds the text's own tokens; natural log; sentences
with fewer than 2 tokens skipped.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

METRICS = ("token_similarity", "rank", "condition_number", "svd_entropy")


def matrix_geometry(x: Tensor) -> dict[str, float]:
    """The four measures of one token matrix X [n, d] (n >= 2)."""
    x = x.double()
    n = x.size(0)
    unit = torch.nn.functional.normalize(x, dim=-1)
    sims = unit @ unit.T
    tok_sim = (sims.sum() - sims.diagonal().sum()) / (n * (n - 1))
    sv = torch.linalg.svdvals(x)
    p = sv.pow(2) / sv.pow(2).sum()
    p = p[p > 0]
    return {"token_similarity": 100.0 * float(tok_sim), "rank": float(torch.linalg.matrix_rank(x)),
            "condition_number": float(sv.max() / sv.min()) if float(sv.min()) > 0 else math.inf,
            "svd_entropy": float(-(p * p.log()).sum())}


@torch.no_grad()
def model_geometry(model_path: str, texts: Sequence[str], *, max_length: int = 128, batch_size: int = 32,
                   device: str | None = None) -> dict[str, Any]:
    """Mean of each measure over ``texts`` for the model at ``model_path`` (any transformers encoder)."""
    from transformers import AutoModel, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModel.from_pretrained(model_path, dtype=torch.float32).to(device).eval()  # a bf16 checkpoint too
    totals = {m: 0.0 for m in METRICS}
    used = 0
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start:start + batch_size])
        enc = tokenizer(chunk, padding=True, truncation=True, max_length=max_length, return_tensors="pt",
                        return_special_tokens_mask=True)
        special = enc.pop("special_tokens_mask").bool()
        keep = enc["attention_mask"].bool() & ~special
        inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        hidden = model(**inputs).last_hidden_state.float().cpu()
        for row in range(hidden.size(0)):
            x = hidden[row][keep[row]]
            if x.size(0) < 2:
                continue
            for name, value in matrix_geometry(x).items():
                totals[name] += value
            used += 1
    if used == 0:
        raise ValueError("geometry: no text with at least 2 tokens")
    return {**{m: totals[m] / used for m in METRICS}, "texts": used}
