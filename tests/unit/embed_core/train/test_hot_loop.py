"""What a GPU step must not do on the host, checked on a CPU: no device-to-host reads (``.item()``,
``.tolist()``, ``int``/``float`` of a tensor) in the code every encoder pass runs (a lint over its
source); a packed pass's ``max_seqlen`` stays a Python int; an eager packed mask comes in the dtype
attention computes in under autocast (not the fp32 of FSDP2's stored shards); and the passes are
planned with their batch on the batch source's thread, not on the step's."""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading

import pytest
import torch

from embed_core.model import embedder, encoder, packing
from embed_core.train.engine import passes

SYNCS = {"item", "tolist", "cpu", "numpy"}
# the functions every encoder pass runs, on the step's thread
PER_PASS = [passes.Passes._run, passes.Passes.forward_backward, passes.Passes._cached, passes.Passes._assemble,
            packing.packed_model_inputs, packing.compute_dtype, packing.pool_packed, encoder.pool_hidden,
            embedder.Embedder.forward, embedder.Embedder.pool]
# outside any per-pass loop: one read of the micro-batch's loss, after all its passes
ALLOWED = {"float(loss.detach())"}


def _host_reads(fn) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        method = isinstance(node.func, ast.Attribute) and node.func.attr in SYNCS
        builtin = isinstance(node.func, ast.Name) and node.func.id in ("int", "float")
        if method or builtin:
            text = ast.unparse(node)
            if text not in ALLOWED:
                found.append(text)
    return found


@pytest.mark.parametrize("fn", PER_PASS, ids=lambda f: f.__qualname__)
def test_no_code_run_per_encoder_pass_reads_a_tensor_back_to_the_host(fn):
    assert _host_reads(fn) == [], fn.__qualname__


def test_the_lint_finds_a_host_read_where_there_is_one():
    def per_pass(features):
        return int(features["max_seqlen"]) + features["x"].sum().item()

    assert _host_reads(per_pass) == ['int(features[\'max_seqlen\'])', "features['x'].sum().item()"]


def _features(lengths):
    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": torch.randint(5, 100, (len(lengths), width)) * mask, "attention_mask": mask,
            "pool_mask": mask.clone()}


def test_a_varlen_packed_pass_keeps_its_longest_length_as_a_python_int():
    packed = packing.pack_features(_features([5, 9, 2]), varlen=True)
    assert type(packed["max_seqlen"]) is int and packed["max_seqlen"] == 9


def test_an_eager_packed_mask_is_in_autocasts_dtype_while_the_weights_stay_fp32(tiny_model):
    model = embedder.Embedder(str(tiny_model), pooling="mean", attn_implementation="eager")
    packed = model.pack(model.tokenize(["a short one", "a much longer text than the other one"]))
    config = model._text_config()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mask = packing.packed_model_inputs(model.model, config, packed)["attention_mask"]
    assert model.model.get_input_embeddings().weight.dtype == torch.float32
    assert mask.dtype == torch.bfloat16
    assert packing.packed_model_inputs(model.model, config, packed)["attention_mask"].dtype == torch.float32


def test_the_passes_are_planned_with_their_batch_on_the_batch_sources_thread(tmp_path, tiny_model):
    import pyarrow  # noqa: F401  (records)

    from embed_core.config import parse_config
    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords
    from embed_core.train.engine.trainer import Trainer

    config = parse_config({"prepare": {"sources": [{"name": "x", "kind": "sts", "path": "x"}]}, "train": {
        "base_model": str(tiny_model), "max_length": 32, "precision": "fp32", "stages": [{
            "name": "s", "steps": 2, "batch_size": {"retrieval": 4}, "num_hard_negatives": 0,
            "query_max_length": 16, "passage_max_length": 16}]}})
    table = records_to_table([Record(id=f"r{i}", dataset="d", task="retrieval", query=f"query {i} " * (1 + i % 3),
                                     positives=[f"passage {i}"]) for i in range(16)])
    trainer = Trainer(config.train, config.train.stages[0], {"d": DatasetRecords("d", table)},
                      init_model=str(tiny_model), checkpoint_dir=tmp_path, seed=0)
    threads = []
    local_plan = trainer.passes.local_plan

    def spy(batch):
        threads.append(threading.current_thread().name)
        return local_plan(batch)

    trainer.passes.local_plan = spy
    trainer.train_step()
    trainer.train_step()
    trainer.batches.close()
    assert threads and all(t.startswith("embedpipe-batches") for t in threads[1:]), threads
