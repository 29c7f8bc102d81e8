"""What mteb will ask an encoder for on a task, read from the task's loaded data before mteb runs,
and the order tasks are scored in.

``task_requests`` lists, per task type, the texts each of mteb's ``encode`` calls receives and the
prompt type it passes (mteb 2's evaluators: both columns of an STS or pair-classification split;
a classification task's training texts — the union of its experiments' undersampled rows, drawn
by mteb's own ``_undersample_data`` with the task's seed — and its test texts; a retrieval task's
corpus, title and text joined as mteb joins them, and its queries). The evaluated encoder
(``embed_core.scoring.model.EvalModel.prefetch``) encodes them all before mteb scores, once per
distinct text and longest first. It is only a schedule: a text mteb asks for that is not listed
here is encoded when asked, and the scores do not depend on it (a test checks that nothing is
missed on every task type).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from embed_core.errors import ConfigError

log = logging.getLogger("embedpipe.evaluate")

Request = tuple[list[str], Any]  # (texts, mteb PromptType or None)


def order_tasks(specs: Sequence[Any], first: Sequence[str]) -> list[Any]:
    """``specs`` (anything with a ``name``) with the tasks named in ``first`` first, in that order,
    then the others in their own order: the guard tasks a release gate decides on are scored first,
    so a failing gate is known before the other tasks run. A name in ``first`` that is not a task is
    an error."""
    known = {s.name: s for s in specs}
    unknown = [n for n in first if n not in known]
    if unknown:
        raise ConfigError(f"evaluate: guard task {unknown[0]!r} is not an evaluated task ({', '.join(known)})")
    head = dict.fromkeys(first)
    return [known[n] for n in head] + [s for s in specs if s.name not in head]


def _split_data(task) -> Iterator[tuple[Any, Any]]:
    """(the subset's data: a split dict, the split's data) for every subset and eval split, laid out
    as ``embed_core.scoring.tasks.build_task``'s ``load_data`` stores them."""
    for subset in task.hf_subsets:
        data = task.dataset if subset not in task.dataset and subset == "default" else task.dataset[subset]
        for split in task.metadata.eval_splits:
            yield data, data[split]


def _column(split, name) -> list[str] | None:
    return list(split[name]) if isinstance(name, str) else None


def _sts(task, split) -> list[Request]:
    cols = getattr(task, "column_names", ("sentence1", "sentence2"))
    pairs = [(_column(split, cols[0]), task.input1_prompt_type), (_column(split, cols[1]), task.input2_prompt_type)]
    return [(texts, prompt) for texts, prompt in pairs if texts is not None]


def _pair_classification(task, split) -> list[Request]:
    row = split[0] if len(split) == 1 else None  # mteb's v1 layout: one row holding the lists
    out = []
    for name, prompt in ((task.input1_column_name, task.input1_prompt_type),
                         (task.input2_column_name, task.input2_prompt_type)):
        if isinstance(name, str):
            out.append((list(row[name]) if row is not None else list(split[name]), prompt))
    return out


def _classification(task, data, split) -> list[Request]:
    column = task.input_column_name
    if not isinstance(column, str):
        return []
    out = []
    if not task.is_cross_validation and task.train_split in data:
        train = data[task.train_split]
        shuffled, union = None, set()
        for i in range(task.n_experiments):  # mteb's own draw: a fresh RandomState(seed) each time
            _, shuffled, selected = task._undersample_data(train, i, shuffled)
            union.update(selected)
        texts = train[column]
        out.append(([texts[i] for i in sorted(union)], None))
    out.append((list(split[column]), None))
    return out


def _retrieval(split) -> list[Request]:
    from mteb._create_dataloaders import _retrieval_texts
    from mteb.types import PromptType

    return [(_retrieval_texts(split["corpus"], PromptType.document), PromptType.document),
            (_retrieval_texts(split["queries"], PromptType.query), PromptType.query)]


def task_requests(task) -> list[Request]:
    """The (texts, prompt type) of every ``encode`` call mteb makes on ``task`` (its data is loaded
    here if it is not yet: a bad row is an error as always); [] for a task type not listed, or when
    this mteb lays a task out otherwise than these readers expect (a warning says so): its texts are
    then encoded as mteb asks for them, the scores the same."""
    task.load_data()
    kind = task.metadata.type
    out: list[Request] = []
    try:
        for data, split in _split_data(task):
            if kind == "STS":
                out += _sts(task, split)
            elif kind == "PairClassification":
                out += _pair_classification(task, split)
            elif kind == "Classification":
                out += _classification(task, data, split)
            elif kind == "Retrieval":
                out += _retrieval(split)
    except (AttributeError, ImportError, KeyError, TypeError) as exc:  # mteb's private helpers and layouts
        log.warning("evaluate: %s's texts are encoded as mteb asks for them, not ahead (%s: %s)",
                    task.metadata.name, type(exc).__name__, exc)
        return []
    return out
