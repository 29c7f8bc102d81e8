"""The synthesize stage's filter calibration (``synthesize.calibration``; the fitting is
``calibrate.py``): after the cheap filters and before likelihood, round trip and the judge, each
listed filter is calibrated on real (query, passage) pairs against the same queries shown with
another pair's passage, and its fitted threshold replaces the configured one.

* real pairs: the retrieval records of the datasets synthesize reads (the user's data), or a
  seeded held-out slice of the generated queries that passed the cheap filters (``real_pairs``);
  at most ``max_pairs``, a seeded sample;
* likelihood: a generated query whose mean token logprob given its passage is below the fitted
  threshold is dropped (reason ``likelihood``); a server without prompt logprobs makes the filter
  say so once and step aside, and the stage goes on;
* round_trip: the fitted threshold (minus a rank) becomes ``queries.round_trip.top_k``; the pairs
  are ranked among the corpora's passages and the real pairs' passages together;
* judge: the fitted threshold becomes ``queries.judge.threshold`` (its requests are the judge's
  own, cached: the judge of the kept queries asks nothing twice).

A filter whose precision stays below ``precision_floor`` fails the stage before anything is
committed, with one line (``FilterRefused``, exit 2). The figures (per filter and generator, the
server's model name) become ``calibration.parquet``, the manifest's ``calibration`` section and a
table of the stage's report.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from embed_core.errors import ConfigError
from embed_core.synthesize.calibrate import (FilterCalibration, LikelihoodScorer, Pair, Scorer, calibrate_filters,
                                             calibration_rows, held_out, openai_echo, pairs_from_records,
                                             round_trip_scorer)
from embed_core.synthesize.config import SynthesizeConfig
from embed_core.synthesize.filters import Candidate
from embed_core.synthesize.jobs import Servers
from embed_core.synthesize.queries import query_dropped

Embed = Callable[[list[str]], np.ndarray]


@dataclass
class Calibrated:
    """What calibration gives the stage: the config with the fitted thresholds, the results, the
    likelihood scores of the candidates (empty when the filter is not calibrated or stepped aside)
    and the stats of the judge's calibration requests."""

    cfg: SynthesizeConfig
    results: list[FilterCalibration]
    source: str
    applied: dict[str, str] = field(default_factory=dict)     # filter -> what its threshold replaced
    likelihood: dict[Pair, float] = field(default_factory=dict)
    client: dict[str, Any] = field(default_factory=dict)

    def table(self) -> pa.Table:
        """``calibration.parquet``: ``calibrate.COLUMNS`` and what the threshold replaced; a figure a
        filter that stepped aside has none of is null."""
        rows = [{**{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()},
                 "applied": self.applied.get(r["filter"], "")} for r in calibration_rows(self.results)]
        return pa.Table.from_pylist(rows, schema=TABLE_SCHEMA)

    def section(self) -> dict[str, Any]:
        """The manifest's ``calibration`` section."""
        return {"real_pairs": self.source, "filters": self.table().to_pylist(),
                **({"client": self.client} if self.client else {})}


TABLE_SCHEMA = pa.schema([("generator", pa.string()), ("filter", pa.string()), ("status", pa.string()),
                          ("threshold", pa.float64()), ("precision", pa.float64()), ("recall", pa.float64()),
                          ("keep_rate", pa.float64()), ("n_real", pa.int64()), ("n_mismatched", pa.int64()),
                          ("applied", pa.string())])


def real_pairs(cfg: SynthesizeConfig, records: list[Any], candidates: list[Candidate], seed: int) -> tuple[str, list[Pair]]:
    """(where they came from, the real pairs): the records' (query, first positive), or a held-out
    slice of the candidates (``calibration.real_pairs``), at most ``max_pairs`` of them."""
    cal = cfg.calibration
    own = pairs_from_records(records)
    usable = len(own) >= 2 and len({p for _, p in own}) >= 2
    if cal.real_pairs == "records" and not usable:
        raise ConfigError(f"synthesize.calibration.real_pairs: records, but the datasets synthesize reads give "
                          f"{len(own)} retrieval pairs with {len({p for _, p in own})} distinct passages (2 needed): "
                          "use held_out or auto")
    if cal.real_pairs == "records" or (cal.real_pairs == "auto" and usable):
        source, pairs = "records", own
    else:
        generated = [(c.record.query, c.record.positives[0]) for c in candidates]
        if len(generated) < 2 or len({p for _, p in generated}) < 2:
            raise ConfigError(f"synthesize.calibration: real_pairs {cal.real_pairs} found no records to use and "
                              f"{len(generated)} generated queries passed the cheap filters (2 on 2 passages needed "
                              "for a held-out slice): raise queries.max_passages or give retrieval records")
        source, pairs = "held_out", held_out(generated, cal.held_out_share, seed)
    if len(pairs) > cal.max_pairs:
        chosen = sorted(np.random.default_rng(seed).permutation(len(pairs))[:cal.max_pairs].tolist())
        pairs = [pairs[i] for i in chosen]
    return source, pairs


class _Memo:
    """A scorer that remembers each pair's score (the stage filters the candidates with them)."""

    def __init__(self, scorer: Scorer):
        self.scorer, self.scores = scorer, {}

    def __call__(self, pairs: list[Pair]):
        out = self.scorer(pairs)
        if out is not None:
            self.scores.update(zip(pairs, out))
        return out


def _echo_url(cfg: SynthesizeConfig, servers: Servers) -> str | None:
    if cfg.server.base_urls:
        return cfg.server.base_urls[0]
    urls = asyncio.run(servers.urls())   # the launched server(s), started here if no request started them
    return urls[0] if urls else None


def _likelihood(cfg: SynthesizeConfig, servers: Servers) -> LikelihoodScorer:
    url = _echo_url(cfg, servers)
    key = "not-needed"
    if cfg.server.launch == "none" and cfg.server.api_key_env and os.environ.get(cfg.server.api_key_env):
        key = os.environ[cfg.server.api_key_env]
    if url is None:
        return LikelihoodScorer(lambda prompt: "synthesize.server has no base_url to ask for prompt logprobs")
    return LikelihoodScorer(openai_echo(url, cfg.server.model, api_key=key, timeout_s=cfg.server.timeout_s),
                            max_seconds=cfg.calibration.likelihood_max_minutes * 60)


def calibrate_queries(cfg: SynthesizeConfig, records: list[Any], candidates: list[Candidate],
                      corpora: dict[str, pa.Table], *, seed: int, embed_for: Callable[[], Embed],
                      judge_scores: Callable[[list[Pair]], tuple[list[float], dict[str, Any]]],
                      servers: Servers) -> Calibrated:
    """Calibrate ``cfg.calibration.filters`` on the real pairs against mismatched ones, with the
    generated queries ``candidates`` (after the cheap filters) as the pairs to keep; refuse a filter
    below the floor (``FilterRefused``). ``judge_scores``: pairs -> the judge's scores and stats."""
    cal = cfg.calibration
    seed = cal.seed if cal.seed is not None else seed
    source, positives = real_pairs(cfg, records, candidates, seed)
    stats: dict[str, Any] = {}

    def judge(pairs: list[Pair]) -> list[float]:
        scores, got = judge_scores(pairs)
        stats.update(got)
        return scores

    pool = list(dict.fromkeys([t for table in corpora.values() for t in table.column("text").to_pylist()]
                              + [p for _, p in positives]))
    makers = {"likelihood": lambda: _Memo(_likelihood(cfg, servers)),
              "round_trip": lambda: round_trip_scorer(pool, embed_for()), "judge": lambda: judge}
    scorers = {name: makers[name]() for name in cal.filters}
    results = calibrate_filters(positives, scorers, generator=cfg.server.model, precision_floor=cal.precision_floor,
                                beta=cal.beta, seed=seed, candidates=[(c.record.query, c.record.positives[0])
                                                                      for c in candidates])
    return _applied(cfg, results, source, scorers, stats)


def _applied(cfg: SynthesizeConfig, results: list[FilterCalibration], source: str, scorers: dict[str, Scorer],
             stats: dict[str, Any]) -> Calibrated:
    """The config with each calibrated filter's fitted threshold in place of the configured one."""
    q, out = cfg.queries, Calibrated(cfg, results, source, client=stats)
    for r in results:
        if r.status != "calibrated":
            continue
        t = r.calibration.threshold
        if r.filter == "likelihood":
            out.likelihood = scorers["likelihood"].scores
            out.applied["likelihood"] = f"drop a query below {t:.4g}"
        elif r.filter == "round_trip":
            top_k = max(1, int(round(-t)))
            out.applied["round_trip"] = f"queries.round_trip.top_k {q.round_trip.top_k} -> {top_k}"
            q = q.model_copy(update={"round_trip": q.round_trip.model_copy(update={"top_k": top_k})})
        elif r.filter == "judge":
            out.applied["judge"] = f"queries.judge.threshold {q.judge.threshold:.4g} -> {t:.4g}"
            q = q.model_copy(update={"judge": q.judge.model_copy(update={"threshold": t})})
    out.cfg = cfg.model_copy(update={"queries": q})
    return out


def likelihood_filter(calibrated: Calibrated | None, candidates: list[Candidate]) -> tuple[list[Candidate], list[dict]]:
    """The generated queries whose likelihood is at or above the fitted threshold; the others as
    dropped rows (reason ``likelihood``). All of them when the filter is not calibrated."""
    if calibrated is None or not calibrated.likelihood:
        return candidates, []
    t = next(r.calibration.threshold for r in calibrated.results if r.filter == "likelihood")
    kept, dropped = [], []
    for c in candidates:
        score = calibrated.likelihood.get((c.record.query, c.record.positives[0]), math.nan)
        if score >= t:
            kept.append(c)
        else:
            dropped.append(query_dropped(c, "likelihood", {"likelihood": round(score, 4), "threshold": round(t, 4)}))
    return kept, dropped
