"""The model card (``README.md`` of a saved model), as the Hugging Face Hub and sentence-transformers
users expect it: YAML metadata (library, pipeline tag, base model, datasets, tags) and a body with
the training data and its counts, the loss of each task with its parameters, the stage settings,
how to encode with the model's prompts, and — once the evaluate stage has scored the model — the
evaluation table of the run.

The train stage writes the card without scores and keeps what the card says in ``CARD_FACTS``
(YAML: not among the files that identify a model's embeddings, so a card that changes — a dataset
count — never makes an unchanged model look new); the evaluate stage renders the card again with
the scores for the model it releases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from embed_core import __version__, numbers

CARD_FACTS = "embedpipe_card.yaml"


def card_facts(*, run_name: str, config_hash: str, base_model: str, init_model: str, stage: dict[str, Any],
               datasets: dict[str, dict[str, Any]], losses: dict[str, str], counts: dict[str, Any],
               matryoshka: Any = None) -> dict[str, Any]:
    """What a card states about a trained model (plain data, stored in ``embedpipe.json``);
    ``matryoshka``: the stage's ``MatryoshkaConfig`` (its trained prefix dimensions), or None."""
    facts = {"run_name": run_name, "config_hash": config_hash, "pipeline_version": __version__,
             "base_model": base_model, "init_model": init_model, "stage": stage, "datasets": datasets,
             "losses": losses, "counts": counts}
    if matryoshka is not None:
        facts["matryoshka"] = {"dims": list(matryoshka.dims), "weights": list(matryoshka.weights)}
    return facts


def write_card(model_dir: Path, facts: dict[str, Any], prompts: dict[str, str],
               scores: list[dict[str, Any]] | None = None, dim_scores: list[dict[str, Any]] | None = None) -> None:
    """``README.md`` and the facts it was made from, in ``model_dir``."""
    (model_dir / CARD_FACTS).write_text(yaml.safe_dump(facts, sort_keys=False, allow_unicode=True), encoding="utf-8")
    (model_dir / "README.md").write_text(render_card(facts, prompts, scores, dim_scores), encoding="utf-8")


def read_card_facts(model_dir: Path) -> dict[str, Any] | None:
    path = Path(model_dir) / CARD_FACTS
    return yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None


def describe_loss(loss: Any) -> str:
    params = ", ".join(f"{k}={v}" for k, v in loss.params.model_dump().items())
    return f"{loss.name}({params})" if params else loss.name


_STAGE_SETTINGS = ("steps", "lr", "warmup_steps", "batch_size", "num_hard_negatives", "alpha", "eta",
                   "query_max_length", "passage_max_length", "grad_cache_chunk", "grad_cache_max_tokens",
                   "alternate_tasks")


def render_card(facts: dict[str, Any], prompts: dict[str, str], scores: list[dict[str, Any]] | None = None,
                dim_scores: list[dict[str, Any]] | None = None) -> str:
    """The card's markdown. ``scores``: main-score rows of the evaluate stage (model, task, metric,
    value), for this model and, for comparison, the base model; ``dim_scores``: this model's
    float32 main scores by embedding dimension (task, metric, dim, value) from the evaluate stage's
    size and precision table."""
    meta = {
        "library_name": "sentence-transformers", "pipeline_tag": "sentence-similarity",
        "tags": ["sentence-transformers", "feature-extraction", "sentence-similarity", "embedpipe"],
        "base_model": facts["base_model"], "datasets": sorted(facts["datasets"]),
    }
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "",
             f"# {facts['run_name']} / {facts['stage'].get('name', 'model')}", "",
             f"A sentence embedding model trained by [embedpipe](https://github.com/embedpipe/embedpipe) "
             f"{facts['pipeline_version']} from `{facts['init_model']}` (base model `{facts['base_model']}`).", "",
             "## Usage", "", "```python", "from sentence_transformers import SentenceTransformer", "",
             "model = SentenceTransformer(\"path/to/this/model\")"]
    query_prompt = next((n for n in ("query", *sorted(prompts)) if prompts.get(n)), None)
    if query_prompt:
        lines += [f"queries = model.encode([\"…\"], prompt_name=\"{query_prompt}\")",
                  "documents = model.encode([\"…\"], prompt_name=\"document\")  # passages: no instruction"]
    else:
        lines += ["embeddings = model.encode([\"…\"])"]
    lines += ["```", ""]
    lines += matryoshka_section(facts.get("matryoshka"), dim_scores)
    if prompts:
        lines += ["Prompts (the instructions the model was trained with; `prompt_name=<dataset>` encodes like the "
                  "evaluation did):", "", "| prompt name | prompt |", "|---|---|"]
        lines += [f"| `{n}` | `{p!r}` |" for n, p in sorted(prompts.items())]
        lines.append("")
    if facts.get("soup_of"):
        lines += [f"The weights are the uniform average (a model soup) of {len(facts['soup_of'])} sweep variants: "
                  + ", ".join(f"`{m}`" for m in facts["soup_of"]) + "; the data, losses and settings below are the "
                  "best variant's.", ""]
    lines += ["## Training data", "", "| dataset | task | records | sampling weight |", "|---|---|---:|---:|"]
    for name, d in sorted(facts["datasets"].items()):
        lines.append(f"| {name} | {d['task']} | {d['records']} | {d.get('weight', 0):.3f} |")
    lines += ["", "## Losses", "", "| task | loss (parameters) |", "|---|---|"]
    lines += [f"| {task} | `{loss}` |" for task, loss in sorted(facts["losses"].items())]
    stage = facts["stage"]
    lines += ["", "## Stage settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | `{stage[k]}` |" for k in _STAGE_SETTINGS if k in stage and stage[k] is not None]
    counts = facts.get("counts") or {}
    if counts:
        lines += [f"| examples seen | {counts.get('examples')} |", f"| final loss | {numbers.loss(counts.get('final_loss'))} |"]
        if counts.get("selected_step") is not None:
            lines.append(f"| weights kept | step {counts['selected_step']} (dev selection score "
                         f"{numbers.score(counts['selected_dev_score'])}) |")
    lines += ["", "## Evaluation", ""]
    if scores:
        models = list(dict.fromkeys(r["model"] for r in scores))
        tasks = list(dict.fromkeys(r["task"] for r in scores))
        lines += ["| task | metric | " + " | ".join(models) + " |", "|---|---|" + "---:|" * len(models)]
        for task in tasks:
            row = {r["model"]: r for r in scores if r["task"] == task}
            metric = next(iter(row.values()))["metric"]
            lines.append(f"| {task} | {metric} | " + " | ".join(
                numbers.score(row[m]['value']) if m in row else "–" for m in models) + " |")
        lines += ["", "Scores are mteb's (× 100) on the run's evaluation tasks; the mteb result files are in the "
                  "run's `evaluate/results/`."]
    else:
        lines.append("Not evaluated yet: the run's evaluate stage writes a copy of this model with the scores.")
    lines += ["", "## Provenance", "", f"- run: `{facts['run_name']}`, config hash `{facts['config_hash'][:16]}`",
              f"- pipeline: embedpipe {facts['pipeline_version']}", ""]
    return "\n".join(lines)


def matryoshka_section(mrl: dict[str, Any] | None, dim_scores: list[dict[str, Any]] | None) -> list[str]:
    """The card's lines on the trained Matryoshka dimensions: how to cut the embedding and, once
    evaluated, the main score of each task at each dimension."""
    if not mrl:
        return []
    dims = [int(d) for d in mrl["dims"]]
    lines = ["## Matryoshka dimensions", "",
             "Trained with a Matryoshka loss (every task's loss at each of these prefix dimensions, weights "
             f"{', '.join(f'{w:g}' for w in mrl['weights'])}): the first d coordinates of an embedding are an "
             f"embedding themselves for d in {', '.join(map(str, dims))}. The model returns the full size by default; "
             "cut it with sentence-transformers' `truncate_dim`:", "", "```python",
             f"model = SentenceTransformer(\"path/to/this/model\", truncate_dim={dims[-1]})",
             f"embeddings = model.encode([\"…\"])  # {dims[-1]} dimensions",
             "```", "", "Cosine similarity needs no re-normalisation of a cut embedding; for a dot-product index pass "
             "`normalize_embeddings=True` to `encode`.", ""]
    if dim_scores:
        shown = sorted({int(r["dim"]) for r in dim_scores}, reverse=True)
        lines += ["| task | metric | " + " | ".join(f"{d} dims" for d in shown) + " |",
                  "|---|---|" + "---:|" * len(shown)]
        for task in dict.fromkeys(r["task"] for r in dim_scores):
            row = {int(r["dim"]): r for r in dim_scores if r["task"] == task}
            metric = next(iter(row.values()))["metric"]
            lines.append(f"| {task} | {metric} | " + " | ".join(
                numbers.score(row[d]['value']) if d in row else "–" for d in shown) + " |")
        lines += ["", "Main scores (× 100, float32) of the run's evaluate stage with the embedding cut to each size "
                  "and normalised again.", ""]
    else:
        lines += ["Scores per dimension: not evaluated yet (the evaluate stage scores the trained dimensions).", ""]
    return lines
