"""The synthesize stage, as the pipeline sees it: LLM paraphrase, augmentation and hard negatives
(the body is ``run.py``; requests in ``jobs.py``, filters in ``filters.py``)."""

from __future__ import annotations

from typing import Any

from embed_core.stage_api import Report, Stage, StageContext, body

NAME = "synthesize"
BODY = "embed_core.synthesize.run"


def format_counts(manifest: dict[str, Any]) -> str:
    c = manifest["counts"]
    cl = c["client"]
    lines = [f"{'strategy':<15}{'requested':>10}{'answered':>9}{'kept':>6}  failed / filtered"]
    for name, s in c["strategies"].items():
        other = ", ".join(f"{k} {v}" for k, v in sorted(s.items()) if ":" in k)
        lines.append(f"{name:<15}{s.get('requested', 0):>10}{s.get('answered', 0):>9}{s.get('kept', 0):>6}  {other}")
    lines.append(f"requests {cl.get('requests', 0)} (retries {cl.get('retries', 0)}), cache hits {cl.get('cache_hits', 0)}, "
                 f"tokens {cl.get('tokens', 0)}" + (", budget spent" if cl.get("budget_exhausted") else ""))
    lines.append("added per dataset: " + ", ".join(f"{d['dataset']} +{d['added']} ({d['llm_negatives']} negatives)"
                                                   for d in c["datasets"] if d["synthesized"]))
    return "\n".join(lines)


def report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    rows = [{"strategy": name, **s} for name, s in manifest["counts"]["strategies"].items()]
    return Report(markdown=(f"Samples: `{ctx.stage_dir}/_samples.parquet`, failures with raw replies: "
                            "`_failures.parquet`, filtered answers: `_filtered.parquet`."),
                  table=rows, table_key=f"{ctx.instance}-stats-",
                  table_description=f"{ctx.instance}: requests, failures and filters per strategy")


# One task-level retry on top of the client's per-request retries: the request cache makes a
# retry repeat only the calls that had not finished.
STAGE = Stage(name=NAME, help="LLM paraphrase, augmentation and hard negatives (needs prepare's output)",
              enabled=lambda c: c.synthesize is not None, fingerprint=body(BODY, "input_fingerprint", upstream=True),
              run=body(BODY, "run_synthesize", upstream=True),
              summarize=format_counts, report=report, produces_records=True, retries=1,
              retry_delay_s=lambda c: c.synthesize.retry_delay_s)
