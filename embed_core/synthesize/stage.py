"""The synthesize stage, as the pipeline sees it: LLM paraphrase, augmentation and hard negatives
(the body is ``run.py``; requests in ``jobs.py``, filters in ``filters.py``)."""

from __future__ import annotations

from typing import Any

from embed_core.stage_dirs import SYNTHESIZE
from embed_core.manifests import SynthesizeManifest
from embed_core.stage_api import Report, Stage, StageContext, body

NAME = SYNTHESIZE
BODY = "embed_core.synthesize.run"


def format_counts(manifest: SynthesizeManifest | dict[str, Any]) -> str:
    """The synthesize stage's summary (a targeted synthesis step's too: ``SynthManifest`` is one)."""
    m = SynthesizeManifest.of(manifest)
    c = m.counts
    cl = c.client
    lines = [f"{'strategy':<15}{'requested':>10}{'answered':>9}{'kept':>6}  failed / filtered"]
    for name, s in c.strategies.items():
        other = ", ".join(f"{k} {v}" for k, v in sorted(s.items()) if ":" in k)
        lines.append(f"{name:<15}{s.get('requested', 0):>10}{s.get('answered', 0):>9}{s.get('kept', 0):>6}  {other}")
    lines.append(f"requests {cl.get('requests', 0)} (retries {cl.get('retries', 0)}), cache hits {cl.get('cache_hits', 0)}, "
                 f"tokens {cl.get('tokens', 0)}" + (", budget spent" if cl.get("budget_exhausted") else ""))
    if c.judge_client is not None:
        j = c.judge_client
        lines.append(f"judge requests {j.get('requests', 0)} (retries {j.get('retries', 0)}), cache hits "
                     f"{j.get('cache_hits', 0)}, tokens {j.get('tokens', 0)}")
    lines.append("added per dataset: " + ", ".join(f"{d.dataset} +{d.added} ({d.llm_negatives} negatives)"
                                                   for d in c.datasets if d.synthesized or d.corpus))
    for name, q in m.queries.items():
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(q["dropped"].items())) or "none"
        judged = f", {q['judged']} judged" if q.get("judged") is not None else ""
        lines.append(f"queries for corpus {name}: {q['passages_asked']} of {q['passages']} passages asked, "
                     f"{q['generated']} generated{judged}, {q['kept']} kept; dropped: {dropped}")
    for r in (m.calibration or {}).get("filters", []):
        lines.append(f"calibration {r['filter']} ({r['generator']}): {r['status']}" + (
            "" if r["precision"] is None else f", threshold {r['threshold']:.4g}, precision {r['precision']:.2f}, "
            f"recall {r['recall']:.2f}, keep rate " + ("—" if r["keep_rate"] is None else f"{r['keep_rate']:.2f}")))
    return "\n".join(lines)


def report(ctx: StageContext, manifest: SynthesizeManifest | dict[str, Any]) -> Report:
    m = SynthesizeManifest.of(manifest)
    rows = [{"strategy": name, **s} for name, s in m.counts.strategies.items()]
    return Report(markdown=(f"Samples: `{ctx.stage_dir}/_samples.parquet`, failures with raw replies: "
                            "`_failures.parquet`, filtered answers: `_filtered.parquet`." + _queries_markdown(m)
                            + _calibration_markdown(m)),
                  table=rows, table_key=f"{ctx.instance}-stats-",
                  table_description=f"{ctx.instance}: requests, failures and filters per strategy")


def _queries_markdown(manifest: SynthesizeManifest) -> str:
    """Query generation per corpus: counts, dropped by filter, kept and dropped examples."""
    parts = []
    for name, q in manifest.queries.items():
        parts.append(f"\n\n**Queries for corpus {name}**: {q['passages_asked']} of {q['passages']} passages asked, "
                     f"{q['generated']} queries generated"
                     + (f", {q['judged']} judged by the LLM" if q.get("judged") is not None else "")
                     + f", {q['kept']} kept; dropped by filter: "
                     + (", ".join(f"{k} {v}" for k, v in sorted(q["dropped"].items())) or "none"))
        parts += [f"\n- kept ({e['type']}{_extras(e)}): {e['query']!r} → {e['passage'][:120]!r}"
                  for e in q["kept_examples"]]
        parts += [f"\n- dropped ({e['reason']}): {e['generated']} {e['scores']}" for e in q["dropped_examples"]]
    return "".join(parts)


def _calibration_markdown(manifest: SynthesizeManifest) -> str:
    cal = getattr(manifest, "calibration", None)
    return "\n\n" + calibration_section(cal) if cal else ""


def calibration_section(cal: dict[str, Any]) -> str:
    """The filter calibration (the manifest's ``calibration`` section) as markdown: per filter and
    generator, its status, threshold, precision, recall and keep rate, and what the threshold replaced."""

    def num(x: Any, fmt: str = ".2f") -> str:
        return "—" if x is None else format(x, fmt)

    lines = [f"**Filter calibration** (real pairs: {cal['real_pairs']}; `calibration.parquet`)", "",
             "| generator | filter | status | threshold | precision | recall | keep rate | real / mismatched | applied |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['generator']} | {r['filter']} | {r['status']} | {num(r['threshold'], '.4g')} | "
              f"{num(r['precision'])} | {num(r['recall'])} | {num(r['keep_rate'])} | {r['n_real']} / "
              f"{r['n_mismatched']} | {r['applied'] or '—'} |" for r in cal["filters"]]
    return "\n".join(lines) + "\n"


def _extras(example: dict[str, Any]) -> str:
    """A kept example's persona and judge score, when it has them."""
    return "".join(f", {k} {example[k]}" for k in ("persona", "judge") if k in example)


# One task-level retry on top of the client's per-request retries: the request cache makes a
# retry repeat only the calls that had not finished.
STAGE = Stage(name=NAME, help="LLM paraphrase, augmentation and hard negatives (needs prepare's output)",
              enabled=lambda c: c.synthesize is not None, fingerprint=body(BODY, "input_fingerprint", upstream=True),
              run=body(BODY, "run_synthesize", upstream=True),
              summarize=format_counts, report=report, produces_records=True, retries=1,
              retry_delay_s=lambda c: c.synthesize.retry_delay_s)
