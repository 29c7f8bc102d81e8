"""Filter calibration: each filter of the generated-query cascade gets a threshold fitted on the
user's own data instead of a guessed one.

The cascade (each filter a *scorer*: a batch of (query, passage) pairs -> one score per pair, higher
meaning "the passage answers the query", or None when the filter cannot score and steps aside):

* generator likelihood (InPars): the mean token logprob of the query given its passage, read from
  the server's echoed prompt logprobs (``LikelihoodScorer``); a server that returns none, refuses
  ``echo``, fails or times out on it, or would take longer than the filter's time budget (timed on
  the shortest prompt, scaled by length) makes the filter say so once in the log and step aside;
* round-trip consistency (``round_trip_scorer``): minus the rank of the shown passage among the
  corpus's passages for the query (``consistency.passage_ranks``), so rank 1 scores -1;
* a teacher's score (a cross-encoder or the embedding model): calibrated like the others; the stage
  keeps it as the record's soft label (``positive_scores``) whatever the threshold;
* the LLM judge (``judge.verdict``'s P(yes)).

The calibration set. Positives are real (query, passage) pairs: the user's own retrieval records,
or a held-out slice of a corpus recipe's kept generated queries (``held_out``). Negatives are the
same queries shown with another passage: a derangement of the passages drawn with a fixed seed
(``mismatched_pairs``; no query keeps its passage, nor a copy of its text). For a threshold t a
pair passes when its score >= t (a score that is not a number never passes):

* recall = share of the real pairs passing;
* false-pass rate = share of the mismatched pairs passing;
* precision = recall / (recall + false-pass rate): passing real / (passing real + passing
  mismatched) at the **balanced prior** (a candidate is as likely real as mismatched; with as many
  mismatched pairs as real ones, which ``mismatched_pairs`` gives, the plain counts' ratio);
* keep rate = share of the generated candidates (the pairs the filter is to judge) passing.

The threshold (``calibrate_threshold``) is chosen among the real pairs' scores: with ``beta`` set,
the one maximising F-beta among those whose precision meets ``precision_floor`` (ties: the lowest,
keeping more); with ``beta=None``, the lowest one meeting the floor (the most recall the floor
allows). A filter no threshold lifts to the floor is refused with one line naming the filter, the
generator, its best precision and the floor (``FilterRefused``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from embed_core.errors import ConfigError, EmbedpipeError

log = logging.getLogger("embedpipe.synthesize")

Pair = tuple[str, str]                                          # (query, passage)
Scorer = Callable[[list[Pair]], "Sequence[float] | None"]       # None: the filter steps aside
Status = Literal["calibrated", "refused", "stepped aside"]
LIKELIHOOD_TEMPLATE = "Passage: {passage}\nA query this passage answers:"


class FilterRefused(ConfigError):
    """A filter whose precision on the calibration pairs stays below the configured floor."""


@dataclass(frozen=True)
class Calibration:
    threshold: float    # a pair passes when its score >= threshold
    precision: float    # at the balanced prior (see the module docstring)
    recall: float
    false_pass: float   # share of the mismatched pairs passing
    f_beta: float       # NaN with beta=None
    keep_rate: float    # share of the candidates passing; NaN without candidates
    n_pos: int
    n_neg: int
    meets_floor: bool


def _scores(values: Sequence[float]) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    return np.where(np.isnan(arr), -np.inf, arr)  # a pair the filter could not score never passes


def calibrate_threshold(pos_scores: Sequence[float], neg_scores: Sequence[float], *, precision_floor: float,
                        beta: float | None = 1.0, candidates: Sequence[float] = ()) -> Calibration:
    """The threshold over real pairs' scores ``pos_scores`` against mismatched pairs' ``neg_scores``
    (see the module docstring for the rule); ``candidates``: the scores of the pairs to filter, for the
    keep rate."""
    pos, neg = _scores(pos_scores), _scores(neg_scores)
    if len(pos) == 0 or len(neg) == 0:
        raise EmbedpipeError(f"calibration needs real and mismatched pairs: got {len(pos)} real, {len(neg)} mismatched")
    if not 0.0 <= precision_floor <= 1.0 or (beta is not None and not beta > 0):
        raise ConfigError(f"calibration: precision_floor {precision_floor} must lie in [0, 1] and beta {beta} be > 0")
    finite = pos[np.isfinite(pos)]
    thresholds = np.unique(finite) if len(finite) else np.array([np.inf])
    pos_sorted, neg_sorted = np.sort(pos), np.sort(neg)
    recall = (len(pos) - np.searchsorted(pos_sorted, thresholds, side="left")) / len(pos)
    false_pass = (len(neg) - np.searchsorted(neg_sorted, thresholds, side="left")) / len(neg)
    with np.errstate(invalid="ignore", divide="ignore"):
        precision = np.where(recall + false_pass > 0, recall / (recall + false_pass), 0.0)
        b2 = (beta or 1.0) ** 2
        f = np.where(precision + recall > 0, (1 + b2) * precision * recall / (b2 * precision + recall), 0.0)
    feasible = precision >= precision_floor - 1e-12
    if not feasible.any():
        i = int(np.flatnonzero(precision == precision.max())[0])       # the best it can do, lowest such
    elif beta is None:
        i = int(np.flatnonzero(feasible)[0])                            # lowest threshold meeting the floor
    else:
        best = f[feasible].max()
        i = int(np.flatnonzero(feasible & (f >= best - 1e-12))[0])
    t = float(thresholds[i])
    cand = _scores(candidates)
    keep = float((cand >= t).mean()) if len(cand) else math.nan
    return Calibration(t, float(precision[i]), float(recall[i]), float(false_pass[i]),
                       float(f[i]) if beta is not None else math.nan, keep, len(pos), len(neg), bool(feasible.any()))


def mismatched_pairs(pairs: Sequence[Pair], seed: int) -> list[Pair]:
    """Each query of ``pairs`` shown with another pair's passage: a derangement of the passages drawn
    with ``seed`` (Sattolo's cycle, then swaps so that no query gets a copy of its own passage's text)."""
    n = len(pairs)
    passages = [p for _, p in pairs]
    if n < 2 or len(set(passages)) < 2:
        raise EmbedpipeError(f"calibration: {n} real pairs with {len(set(passages))} distinct passages; "
                             "mismatched pairs need at least 2 distinct passages")
    rng = np.random.default_rng(seed)
    sigma = list(range(n))
    for i in range(n - 1, 0, -1):  # Sattolo: a single cycle, so sigma[i] != i for every i
        j = int(rng.integers(0, i))
        sigma[i], sigma[j] = sigma[j], sigma[i]
    for i in range(n):
        if passages[sigma[i]] != passages[i]:
            continue
        for j in (int(x) for x in rng.permutation(n)):
            if passages[sigma[j]] != passages[i] and passages[sigma[i]] != passages[j]:
                sigma[i], sigma[j] = sigma[j], sigma[i]
                break
        else:
            raise EmbedpipeError(f"calibration: no passage other than its own text for real pair {i}")
    return [(pairs[i][0], passages[sigma[i]]) for i in range(n)]


def held_out(pairs: Sequence[Pair], share: float, seed: int) -> list[Pair]:
    """A seeded slice of ``share`` of ``pairs`` (at least 2), e.g. of a corpus recipe's kept queries."""
    k = max(2, round(share * len(pairs)))
    chosen = sorted(np.random.default_rng(seed).permutation(len(pairs))[:k].tolist())
    return [pairs[i] for i in chosen]


def pairs_from_records(records: Sequence[Any]) -> list[Pair]:
    """(query, first positive) of each retrieval record that has one: the user's real pairs."""
    return [(r.query, r.positives[0]) for r in records if r.task == "retrieval" and r.positives and r.query]


@dataclass(frozen=True)
class FilterCalibration:
    filter: str
    generator: str
    status: Status
    calibration: Calibration | None     # None when the filter stepped aside
    note: str = ""


def _one_filter(name: str, scorer: Scorer, positives: list[Pair], negatives: list[Pair], candidates: list[Pair],
                generator: str, precision_floor: float, beta: float | None) -> FilterCalibration:
    scored = scorer(positives + negatives + candidates)
    if scored is None:
        return FilterCalibration(name, generator, "stepped aside", None, "the filter cannot score here (see the log)")
    scored = list(scored)
    if len(scored) != len(positives) + len(negatives) + len(candidates):
        raise EmbedpipeError(f"calibration: filter {name!r} returned {len(scored)} scores for "
                             f"{len(positives) + len(negatives) + len(candidates)} pairs")
    a, b = len(positives), len(positives) + len(negatives)
    cal = calibrate_threshold(scored[:a], scored[a:b], precision_floor=precision_floor, beta=beta,
                              candidates=scored[b:])
    if cal.meets_floor:
        return FilterCalibration(name, generator, "calibrated", cal)
    return FilterCalibration(name, generator, "refused", cal,
                             f"precision {cal.precision:.2f} at best, below the floor {precision_floor:.2f}")


def calibrate_filters(positives: Sequence[Pair], scorers: Mapping[str, Scorer], *, generator: str,
                      precision_floor: float, beta: float | None = 1.0, seed: int = 0,
                      candidates: Sequence[Pair] = (), refuse: bool = True) -> list[FilterCalibration]:
    """Calibrate each filter of ``scorers`` (in order) on the real pairs ``positives`` against their
    derangement (``mismatched_pairs`` with ``seed``); ``candidates``: the generator's pairs to filter
    (keep rate). Each result is logged; with ``refuse``, a filter below the floor raises ``FilterRefused``."""
    positives = list(positives)
    negatives = mismatched_pairs(positives, seed)
    out = [_one_filter(name, scorer, positives, negatives, list(candidates), generator, precision_floor, beta)
           for name, scorer in scorers.items()]
    for r in out:
        c = r.calibration
        log.info("synthesize calibration: filter %s, generator %s: %s%s", r.filter, r.generator, r.status,
                 "" if c is None else f" (threshold {c.threshold:.4g}, precision {c.precision:.2f}, recall "
                                      f"{c.recall:.2f}, keep rate {c.keep_rate:.2f})")
    refused = [r for r in out if r.status == "refused"]
    if refuse and refused:
        raise FilterRefused("synthesize calibration: " + "; ".join(
            f"filter {r.filter!r} (generator {r.generator!r}): {r.note}" for r in refused))
    return out


COLUMNS = ("generator", "filter", "status", "threshold", "precision", "recall", "keep_rate", "n_real", "n_mismatched")


def calibration_rows(results: Sequence[FilterCalibration]) -> list[dict[str, Any]]:
    """One row per filter and generator (``COLUMNS``; NaN figures for a filter that stepped aside)."""
    rows = []
    for r in results:
        c = r.calibration
        rows.append({"generator": r.generator, "filter": r.filter, "status": r.status,
                     "threshold": c.threshold if c else math.nan, "precision": c.precision if c else math.nan,
                     "recall": c.recall if c else math.nan, "keep_rate": c.keep_rate if c else math.nan,
                     "n_real": c.n_pos if c else 0, "n_mismatched": c.n_neg if c else 0})
    return rows


def calibration_markdown(results: Sequence[FilterCalibration]) -> str:
    """The calibration as a markdown table for the stage report (figures with two decimals)."""
    def num(x: float) -> str:
        return "—" if math.isnan(x) else f"{x:.2f}"

    lines = ["| generator | filter | status | threshold | precision | recall | keep rate | real / mismatched |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for row in calibration_rows(results):
        t = "—" if math.isnan(row["threshold"]) else f"{row['threshold']:.4g}"
        lines.append(f"| {row['generator']} | {row['filter']} | {row['status']} | {t} | {num(row['precision'])} "
                     f"| {num(row['recall'])} | {num(row['keep_rate'])} | {row['n_real']} / {row['n_mismatched']} |")
    return "\n".join(lines) + "\n"


def round_trip_scorer(passages: Sequence[str], embed: Callable[[list[str]], np.ndarray]) -> Scorer:
    """Round-trip consistency as a score: minus the 1-based rank of the shown passage among
    ``passages`` (the corpus, which must hold every shown passage) for the query."""
    from embed_core.synthesize.consistency import passage_ranks

    corpus = list(passages)
    where = {p: i for i, p in enumerate(corpus)}

    def score(pairs: list[Pair]) -> list[float]:
        missing = next((p for _, p in pairs if p not in where), None)
        if missing is not None:
            raise EmbedpipeError(f"round-trip calibration: a shown passage is not in the corpus: {missing[:80]!r}")
        if not pairs:
            return []
        ranks = passage_ranks(np.asarray(embed([q for q, _ in pairs])), np.asarray(embed(corpus)),
                              [where[p] for _, p in pairs])
        return [-float(r) for r in ranks]

    return score


Echo = Callable[[str], "Mapping[str, Any] | str"]  # prompt -> its echoed logprobs, or why there are none


def mean_query_logprob(logprobs: Mapping[str, Any], query_start: int, query_end: int) -> float | None:
    """The mean logprob of the prompt tokens starting in [query_start, query_end) of an echoed
    completion's logprobs (OpenAI's shape: ``tokens``, ``token_logprobs``, ``text_offset``); None
    when no such token has a logprob."""
    offsets, lps = logprobs.get("text_offset") or [], logprobs.get("token_logprobs") or []
    values = [float(lp) for off, lp in zip(offsets, lps) if query_start <= off < query_end and lp is not None]
    return math.fsum(values) / len(values) if values else None


class LikelihoodScorer:
    """The generator-likelihood filter (InPars): the mean token logprob of the query after
    ``template`` filled with its passage. The first pair the server gives no logprobs for makes the
    filter say so once in the log and step aside (every later call returns None at once). The
    shortest prompt is asked first and timed: when all the prompts would take longer than
    ``max_seconds`` (its time scaled by their length in characters), the filter steps aside too."""

    def __init__(self, echo: Echo, template: str = LIKELIHOOD_TEMPLATE, max_seconds: float | None = None):
        self.echo = echo
        self.template = template
        self.max_seconds = max_seconds
        self.stepped_aside: str | None = None

    def _aside(self, why: str) -> None:
        self.stepped_aside = why
        log.warning("synthesize: the likelihood filter steps aside: %s", why)

    def _over_budget(self, seconds: float, probe: str, prompts: list[str]) -> str | None:
        estimate = seconds * sum(len(p) for p in prompts) / max(1, len(probe))
        if self.max_seconds is None or estimate <= self.max_seconds:
            return None
        return (f"the server's prompt logprobs would take about {estimate / 60:.1f} min for {len(prompts)} pairs "
                f"({seconds:.1f} s for the shortest prompt, {len(probe)} characters), over the budget of "
                f"{self.max_seconds / 60:g} min (synthesize.calibration.likelihood_max_minutes)")

    def __call__(self, pairs: list[Pair]) -> list[float] | None:
        if self.stepped_aside is not None:
            return None
        prefixes = [self.template.format(passage=passage) for _, passage in pairs]
        prompts = [f"{prefix} {query}" for prefix, (query, _) in zip(prefixes, pairs)]
        out: list[float] = [math.nan] * len(pairs)
        for k, i in enumerate(sorted(range(len(pairs)), key=lambda j: len(prompts[j]))):
            t0 = time.perf_counter()
            got = self.echo(prompts[i])
            score = None if isinstance(got, str) else mean_query_logprob(got, len(prefixes[i]), len(prompts[i]))
            if score is None:
                self._aside(got if isinstance(got, str) else "the server returned no logprobs for the query")
                return None
            out[i] = score
            over = self._over_budget(time.perf_counter() - t0, prompts[i], prompts) if k == 0 else None
            if over is not None:
                self._aside(over)
                return None
        return out


def openai_echo(base_url: str, model: str, *, api_key: str = "not-needed", timeout_s: float = 60.0) -> Echo:
    """An ``Echo`` over an OpenAI-compatible ``/completions`` endpoint (``echo`` with ``logprobs``:
    vLLM, llama-cpp-python and OpenAI's legacy API answer it; a server that refuses it, sends no
    logprobs, fails or times out yields the reason instead). Requests are not cached."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=2)

    def echo(prompt: str) -> Mapping[str, Any] | str:
        try:
            resp = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                             temperature=0.0)
        except openai.BadRequestError as exc:
            return f"the server at {base_url} refused a prompt-logprobs (echo) request: {str(exc)[:160]}"
        except (openai.APITimeoutError, openai.APIStatusError) as exc:
            how = (f"no answer within {timeout_s:g} s" if isinstance(exc, openai.APITimeoutError)
                   else f"HTTP {exc.status_code}: {str(exc)[:120]}")
            return (f"the server at {base_url} did not answer a prompt-logprobs (echo) request "
                    f"({type(exc).__name__}, {how}; 3 tries)")
        lp = resp.choices[0].logprobs if resp.choices else None
        if lp is None or not getattr(lp, "token_logprobs", None) or not getattr(lp, "text_offset", None):
            return f"the server at {base_url} returned no prompt logprobs"
        return {"tokens": list(lp.tokens or []), "token_logprobs": list(lp.token_logprobs),
                "text_offset": list(lp.text_offset)}

    return echo
