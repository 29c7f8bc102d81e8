"""Trainer: two stages on real demo records with a tiny model, exact resume after a hard kill,
GradCache equivalence, saved-model format."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from embed_core.procs import free_port
from embed_core.stages import records_upstream
from embed_core.config import parse_config
from tests.helpers.repo import REPO


def _config_dict(tmp_path, tiny_model, **stage_overrides):
    cfg = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    cfg["data_root"] = str(REPO / "data")
    cfg["run_root"] = str(tmp_path / "runs")
    for key in ("synthesize", "mine", "evaluate", "train"):
        cfg.pop(key, None)
    small = {"retrieval": 4, "classification": 4, "sts": 8, "nli": 8}
    common = {"lr": 1e-3, "warmup_steps": 2, "batch_size": small, "num_hard_negatives": 2, "query_max_length": 32,
              "passage_max_length": 48, "checkpoint_every": 3, "log_every": 1}
    # fp32 (auto is bf16 on CPUs with native bf16): the equality and resume tests compare exactly
    cfg["train"] = {"base_model": str(tiny_model), "max_length": 48, "precision": "fp32", "stages": [
        {"name": "stage1", "tasks": ["retrieval"], "steps": 4, **common},
        {"name": "stage2", "steps": 10, "eta": 0.72, **common, **stage_overrides}]}
    return cfg


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_model):
    from embed_core.prepare.run import run_prepare

    tmp = tmp_path_factory.mktemp("train")
    config = parse_config(_config_dict(tmp, tiny_model))
    run_dir = tmp / "runs/demo"
    run_prepare(config, run_dir)
    return tmp, run_dir


def _train_in_subprocess(cfg: dict, prepared_run: Path, tmp_path: Path, stage: str, env: dict | None = None,
                         kill_after_step: int | None = None):
    """Train ``stage`` of ``cfg`` in a fresh Python process on a copy of ``prepared_run``'s records;
    ``kill_after_step``: the process SIGKILLs itself right after that optimizer step (a real crash:
    no cleanup, no exception handlers)."""
    import os
    import shutil

    cfg_path = tmp_path / f"{stage}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    other = tmp_path / "run"
    other.mkdir()
    shutil.copytree(prepared_run / "prepare", other / "prepare")
    code = textwrap.dedent("""
        import os, signal, sys
        from embed_core.config import load_config
        from embed_core.stages import records_upstream
        from embed_core.train.run import run_train_stage
        from embed_core.train.engine.trainer import Trainer

        kill_after = int(sys.argv[4])
        step = Trainer.train_step

        def train_step_then_die(self):
            rows = step(self)
            if self.step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            return rows

        Trainer.train_step = train_step_then_die
        config = load_config(sys.argv[1])
        run_train_stage(config, sys.argv[2], sys.argv[3], upstream=records_upstream(config, "train"))
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(cfg_path), str(other), stage, str(kill_after_step or 0)],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)
    return proc, other


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
def test_two_stages_train_and_save_a_loadable_model(prepared, tiny_model):
    from embed_core.train.run import run_train_stage

    tmp, run_dir = prepared
    config = parse_config(_config_dict(tmp, tiny_model))
    m1 = run_train_stage(config, run_dir, "stage1", upstream=records_upstream(config, "train"))
    assert set(m1["datasets"]) == {"scifact", "flag-msmarco", "flag-toy"}  # retrieval only
    m2 = run_train_stage(config, run_dir, "stage2", upstream=records_upstream(config, "train"))
    assert m2["init_model"].endswith("train-stage1/model")
    assert {"sts", "nli", "classification", "retrieval"} <= {d["task"] for d in m2["datasets"].values()}
    ret = sum(d["weight"] for d in m2["datasets"].values() if d["task"] == "retrieval")
    assert ret == pytest.approx(0.72)
    metrics = pq.read_table(run_dir / "train-stage2/metrics.parquet").to_pylist()
    assert len(metrics) == 10 and all(r["loss"] == r["loss"] for r in metrics)  # no NaN
    assert (run_dir / "train-stage2/loss.png").exists()
    assert not (run_dir / "checkpoints/stage2").exists()

    model_dir = run_dir / "train-stage2/model"
    settings = json.loads((model_dir / "embedpipe.json").read_text())
    assert settings["use_instructions"] and settings["instructions"]["scifact"].startswith("Given a scientific")
    assert settings["training"]["stage"]["name"] == "stage2"  # the checkpoint carries its config
    before, after = _weights(tiny_model), _weights(model_dir)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # training changed the weights

    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(model_dir), device="cpu")
    emb = model.encode(["a test sentence", "another one"])
    assert emb.shape == (2, 32)
    assert abs(float((emb[0] ** 2).sum()) - 1.0) < 1e-4  # Normalize module loaded
    # our Embedder and sentence-transformers agree on the saved model
    from embed_core.model.embedder import Embedder

    ours = Embedder(str(model_dir), max_length=48).eval()
    with torch.no_grad():
        mine = ours(ours.tokenize(["a test sentence", "another one"])).numpy()
    assert abs(mine - emb).max() < 1e-5

    from embed_core.evaluate.run import trained_models

    assert list(trained_models(run_dir)) == ["stage1", "stage2"]


@pytest.mark.slow
def test_resume_after_hard_kill_reproduces_the_uninterrupted_run(prepared, tiny_model, tmp_path):
    from embed_core.train.run import run_train_stage

    tmp, run_dir = prepared
    cfg = _config_dict(tmp, tiny_model)
    cfg["train"]["stages"] = [dict(cfg["train"]["stages"][1], name="resume", eta=None)]
    config = parse_config(cfg)
    reference = run_train_stage(config, run_dir, "resume", upstream=records_upstream(config, "train"))
    ref_losses = [r["loss"] for r in pq.read_table(run_dir / "train-resume/metrics.parquet").to_pylist()]
    ref_weights = _weights(run_dir / "train-resume/model")

    # a separate process trains the same stage and is SIGKILLed right after step 7 (checkpoint at 6)
    proc, other = _train_in_subprocess(cfg, run_dir, tmp_path, "resume", kill_after_step=7)
    assert proc.returncode == -9, proc.stderr[-2000:]  # killed, not finished
    assert not (other / "train-resume").exists()
    assert [p.name for p in sorted((other / "checkpoints/resume").glob("step-*"))] == ["step-0000003", "step-0000006"]

    resumed = run_train_stage(config, other, "resume", resume=True, upstream=records_upstream(config, "train"))
    losses = [r["loss"] for r in pq.read_table(other / "train-resume/metrics.parquet").to_pylist()]
    assert losses == ref_losses  # bit-for-bit: same batches, same dropout, same optimizer state
    weights = _weights(other / "train-resume/model")
    assert all(torch.equal(ref_weights[k], weights[k]) for k in ref_weights)
    assert resumed["steps"] == reference["steps"] == 10
    # the records of steps 1-6, trained before the kill, are in the resumed stage's lineage as well
    lineage = pq.read_table(other / "train-resume/lineage.parquet").to_pylist()
    assert lineage == pq.read_table(run_dir / "train-resume/lineage.parquet").to_pylist()
    assert sorted({r["step"] for r in lineage}) == list(range(1, 11))


def test_grad_cache_gives_the_same_gradients_as_a_full_batch(prepared, tiny_model):
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.engine.batches import build_batch
    from embed_core.train.run import load_datasets
    from embed_core.train.engine.trainer import Trainer

    tmp, run_dir = prepared
    config = parse_config(_config_dict(tmp, tiny_model))
    grads = []
    for chunk in (None, 3):
        stage = TrainStageConfig(name="gc", tasks=["retrieval"], steps=1, batch_size={"retrieval": 8},
                                 num_hard_negatives=2, grad_cache_chunk=chunk, query_max_length=32, passage_max_length=48)
        datasets = load_datasets(run_dir, stage, records_upstream(config, "train"))
        trainer = Trainer(config.train, stage, datasets, init_model=str(tiny_model), checkpoint_dir=tmp / "gc", seed=0)
        trainer.model.eval()  # no dropout: compare the math, not RNG replay
        batch = build_batch(datasets["scifact"], list(range(8)), step=0, seed=0, num_negatives=2,
                            query_max_length=32, passage_max_length=48, use_instructions=True)
        trainer._forward_backward(batch, 1.0)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    full, cached = grads
    assert full.keys() == cached.keys()
    for name in full:
        assert torch.allclose(full[name], cached[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
def test_grad_cache_with_dropout_on_equals_the_uncached_gradient_of_the_same_forward(prepared, tiny_model):
    """Dropout on: GradCache replays each chunk with the RNG states of its cached pass, so its
    gradients equal those of one graph over the same chunked forward (same masks); a different
    seed gives other masks and other gradients, so the comparison is not vacuous."""
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.engine.batches import TextGroup, build_batch
    from embed_core.train.run import load_datasets
    from embed_core.train.engine.trainer import Trainer

    tmp, run_dir = prepared
    config = parse_config(_config_dict(tmp, tiny_model))
    chunk = 3
    stage = TrainStageConfig(name="gc", tasks=["retrieval"], steps=1, batch_size={"retrieval": 8},
                             num_hard_negatives=2, grad_cache_chunk=chunk, query_max_length=32, passage_max_length=48)
    datasets = load_datasets(run_dir, stage, records_upstream(config, "train"))
    trainer = Trainer(config.train, stage, datasets, init_model=str(tiny_model), checkpoint_dir=tmp / "gc2", seed=0)
    assert trainer.model.training and trainer.model.model.config.hidden_dropout_prob > 0
    batch = build_batch(datasets["scifact"], list(range(8)), step=0, seed=0, num_negatives=2,
                        query_max_length=32, passage_max_length=48, use_instructions=True)

    def grads() -> dict:
        out = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        trainer.model.zero_grad(set_to_none=True)
        return out

    def uncached(seed: int) -> dict:
        torch.manual_seed(seed)
        emb = {name: torch.cat([trainer.passes.embed(TextGroup(g.texts[i:i + chunk], g.instructions[i:i + chunk], g.max_length))
                                for i in range(0, len(g.texts), chunk)]) for name, g in batch.groups.items()}
        trainer._loss(batch, emb).backward()
        return grads()

    reference, other_masks = uncached(1), uncached(2)
    torch.manual_seed(1)
    trainer._forward_backward(batch, 1.0)
    cached = grads()
    assert reference.keys() == cached.keys()
    for name in reference:
        assert torch.allclose(reference[name], cached[name], atol=1e-6, rtol=1e-5), name
    assert any(not torch.allclose(reference[n], other_masks[n], atol=1e-6, rtol=1e-5) for n in reference)


def test_length_bucketed_passes_give_the_loss_and_gradients_of_one_padded_pass(prepared, tiny_model):
    """A batch's texts encoded in length-sorted passes (each cut to its own longest text) give the
    loss and gradients of one pass padded to the longest text: fp32, dropout off, within 1e-5."""
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.engine.batches import build_batch
    from embed_core.train.run import load_datasets
    from embed_core.train.engine.trainer import Trainer

    tmp, run_dir = prepared
    config = parse_config(_config_dict(tmp, tiny_model))
    results = []
    for buckets in (1, 4):
        stage = TrainStageConfig(name="lb", tasks=["retrieval"], steps=1, batch_size={"retrieval": 8},
                                 num_hard_negatives=2, length_buckets=buckets, query_max_length=64, passage_max_length=128)
        datasets = load_datasets(run_dir, stage, records_upstream(config, "train"))
        trainer = Trainer(config.train, stage, datasets, init_model=str(tiny_model), checkpoint_dir=tmp / "lb", seed=0)
        trainer.model.eval()
        passes = []
        trainer.model.register_forward_hook(lambda _m, args, _out: passes.append(args[0]["input_ids"].shape))
        # no instructions and room for 128 tokens: the claims and abstracts differ in length
        batch = build_batch(datasets["scifact"], list(range(8)), step=0, seed=0, num_negatives=2,
                            query_max_length=64, passage_max_length=128, use_instructions=False)
        loss = trainer._forward_backward(batch, 1.0)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((loss, grads, passes))
    (loss1, grads1, passes1), (loss4, grads4, passes4) = results
    assert len(passes1) == len(batch.groups) and len(passes4) > len(passes1)  # the batch really was split
    padded = lambda passes: sum(rows * width for rows, width in passes)  # noqa: E731
    assert padded(passes4) < padded(passes1)
    assert abs(loss1 - loss4) < 1e-5
    for name in grads1:
        assert torch.allclose(grads1[name], grads4[name], atol=1e-5, rtol=1e-4), name


def test_bf16_autocast_gives_the_fp32_loss_and_gradients_within_the_stated_tolerance(prepared, tiny_model):
    """precision: bf16 (what auto picks on CUDA and on CPUs with native bf16) on a fixed batch, with
    length buckets: the loss within 2 % of the fp32 unbucketed loss and every gradient pointing the
    same way (cosine >= 0.98); fp32 is what the exact-resume tests pin."""
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.engine.batches import build_batch
    from embed_core.train.run import load_datasets
    from embed_core.train.engine.trainer import Trainer

    tmp, run_dir = prepared
    config = parse_config(_config_dict(tmp, tiny_model))
    results = {}
    for precision, buckets in (("fp32", 1), ("bf16", 4)):
        stage = TrainStageConfig(name="bf", tasks=["retrieval"], steps=1, batch_size={"retrieval": 8},
                                 num_hard_negatives=2, length_buckets=buckets, bucket_pass_cost=0,  # really split
                                 query_max_length=64, passage_max_length=128)
        datasets = load_datasets(run_dir, stage, records_upstream(config, "train"))
        train = config.train.model_copy(update={"precision": precision})
        trainer = Trainer(train, stage, datasets, init_model=str(tiny_model), checkpoint_dir=tmp / "bf", seed=0)
        assert trainer.bf16 == (precision == "bf16")
        trainer.model.eval()
        batch = build_batch(datasets["scifact"], list(range(8)), step=0, seed=0, num_negatives=2,
                            query_max_length=64, passage_max_length=128, use_instructions=False)
        loss = trainer._forward_backward(batch, 1.0)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results[precision] = (loss, grads)
    (loss32, grads32), (loss16, grads16) = results["fp32"], results["bf16"]
    assert abs(loss16 - loss32) <= 0.02 * abs(loss32), (loss16, loss32)
    assert grads32.keys() == grads16.keys()
    for name in grads32:
        a, b = grads32[name].flatten(), grads16[name].flatten()
        if a.norm() > 1e-8:
            assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.98, name


def test_length_buckets_pick_the_split_with_the_fewest_padded_positions():
    from itertools import combinations

    from embed_core.train.engine.passes import length_buckets

    lengths = [40, 38, 37, 20, 20, 19, 7, 6, 6, 5]
    best = length_buckets(lengths, 3)
    cost = lambda bounds: sum((e - s) * lengths[s] for s, e in bounds)  # noqa: E731
    brute = min(cost([(a, b) for a, b in zip((0, *cuts), (*cuts, len(lengths)))])
                for k in range(3) for cuts in combinations(range(1, len(lengths)), k))
    assert cost(best) == brute == 3 * 40 + 3 * 20 + 4 * 7
    assert [b for _, b in best][-1] == len(lengths) and best[0][0] == 0
    assert length_buckets(lengths, 1) == [(0, 10)] and length_buckets([9, 9, 9], 4) == [(0, 3)]
    # a fixed cost per pass: [10, 2, 2] in one pass pads 30 positions, in two 14: a second pass is
    # made when it costs less than the 16 positions it saves, not when it costs more
    assert length_buckets([10, 2, 2], 2, pass_cost=15) == [(0, 1), (1, 3)]
    assert length_buckets([10, 2, 2], 2, pass_cost=17) == [(0, 3)]


def test_grad_cache_under_deepspeed_is_refused_with_the_reason():
    from embed_core.errors import ConfigError

    stage = {"name": "s", "grad_cache_chunk": 4}
    prepare = {"sources": [{"name": "x", "kind": "sts", "path": "x.csv"}]}
    with pytest.raises(ConfigError, match=r"grad_cache_chunk \(stages s\) does not work with DeepSpeed \(ZeRO stage 2\)"):
        parse_config({"prepare": prepare, "train": {"deepspeed": {"zero_optimization": {"stage": 2}}, "stages": [stage]}})
    parse_config({"prepare": prepare, "train": {"stages": [stage]}})  # GradCache without DeepSpeed is fine


@pytest.mark.parametrize("train,fragment", [
    ({"deepspeed": {"zero_optimization": {"stage": 3}}},
     "deepspeed.zero_optimization.stage 3 (ZeRO-3) is not supported: the final save would write its partitioned "
     "(empty) parameters"),
    ({"sharding": "fsdp", "deepspeed": {"zero_optimization": {"stage": 2}}},
     "sharding: fsdp and deepspeed both shard the model: choose one"),
    ({"weights_dtype": "bf16", "precision": "fp32"},
     "weights_dtype: bf16 stores weights in bf16, which fp32 compute would read back rounded: use precision: bf16"),
    ({"deepspeed": {"zero_optimization": {"stage": 3}}, "stage": {"grad_cache_chunk": 4}},
     "deepspeed.zero_optimization.stage 3 (ZeRO-3) is not supported"),  # the reason first, not GradCache's
    ({"deepspeed": {"zero_optimization": {"stage": 1}}, "stage": {"dev": {"tasks": [{"name": "D", "type": "sts", "dataset": "x"}]}}},
     "train: dev evaluation (stages s) runs on rank 0 alone, which DeepSpeed's partitioned state does not allow"),
])
def test_zero3_and_conflicting_sharding_or_dtype_settings_are_refused_at_load(train, fragment):
    from embed_core.errors import ConfigError

    prepare = {"sources": [{"name": "x", "kind": "sts", "path": "x.csv"}]}
    settings = {key: value for key, value in train.items() if key != "stage"}
    with pytest.raises(ConfigError) as err:
        parse_config({"prepare": prepare, "train": {**settings, "stages": [{"name": "s", **train.get("stage", {})}]}})
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("train", [
    {"deepspeed": {"zero_optimization": {"stage": 1}}}, {"deepspeed": {"zero_optimization": {"stage": 2}}},
    {"deepspeed": {}}, {"sharding": "fsdp", "weights_dtype": "bf16"}, {"weights_dtype": "bf16", "precision": "bf16"}])
def test_zero1_and_2_fsdp_and_bf16_weights_with_bf16_compute_are_accepted(train):
    prepare = {"sources": [{"name": "x", "kind": "sts", "path": "x.csv"}]}
    parse_config({"prepare": prepare, "train": {**train, "stages": [{"name": "s"}]}})


@pytest.mark.slow
def test_deepspeed_zero2_on_cpu_matches_the_plain_trainer(prepared, tiny_model, tmp_path):
    """The same stage under deepspeed.initialize (ZeRO-2, DS_ACCELERATOR=cpu, gloo) in a subprocess:
    its losses follow the plain trainer's."""
    pytest.importorskip("deepspeed")
    from embed_core.train.run import run_train_stage

    tmp, run_dir = prepared
    cfg = _config_dict(tmp, tiny_model)
    stage = dict(cfg["train"]["stages"][0], name="ds", steps=3, checkpoint_every=100)
    cfg["train"]["stages"] = [stage]
    run_train_stage(parse_config(cfg), run_dir, "ds", upstream=records_upstream(parse_config(cfg), "train"))
    plain = [r["loss"] for r in pq.read_table(run_dir / "train-ds/metrics.parquet").to_pylist()]

    cfg["train"]["deepspeed"] = {"zero_optimization": {"stage": 2}}
    proc, other = _train_in_subprocess(cfg, run_dir, tmp_path, "ds",
                                       {"DS_ACCELERATOR": "cpu", "MASTER_PORT": str(free_port())})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ds = [r["loss"] for r in pq.read_table(other / "train-ds/metrics.parquet").to_pylist()]
    assert ds == pytest.approx(plain, rel=1e-4, abs=1e-5)
    assert (other / "train-ds/model/model.safetensors").exists()


def test_records_short_of_negatives_still_get_the_batch_hard_negatives():
    import pyarrow as pa

    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords, build_batch

    base = {"dataset": "d", "task": "retrieval", "instruction": "Find it", "positive_scores": [], "negative_scores": [],
            "negative_labels": [], "weak_positives": [], "label": None, "origin": "original", "source_ref": "x:1"}
    recs = [dict(base, id="a", query="qa", positives=["pa"], negatives=[]),
            dict(base, id="b", query="qb", positives=["pb"], negatives=["n1", "n2", "n3"])]
    table = records_to_table([Record(**r) for r in recs])
    assert isinstance(table, pa.Table)
    batch = build_batch(DatasetRecords("d", table), [0, 1], step=0, seed=0, num_negatives=2, query_max_length=16,
                        passage_max_length=16, use_instructions=True)
    assert batch.num_negatives == 2 and set(batch.groups["negative"].texts) <= {"n1", "n2", "n3"}
    assert batch.groups["query"].instructions == ["Find it", "Find it"]  # query side only for retrieval
    assert batch.groups["positive"].instructions == [None, None]


def test_bidirectional_switch_makes_a_decoder_see_later_tokens(tmp_path, tiny_model):
    """A tiny Gemma-3 built in code (same architecture as the packaged Gemma-3-270M GGUF): with
    bidirectional=True an early token's state depends on a later token; causal it does not."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    from embed_core.model.embedder import Embedder

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                           sliding_window=64, pad_token_id=0)
    Gemma3TextModel(cfg).save_pretrained(tmp_path / "gemma")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model / name).exists():
            (tmp_path / "gemma" / name).write_bytes((tiny_model / name).read_bytes())

    def first_token_moves(bidirectional):
        m = Embedder(str(tmp_path / "gemma"), pooling="last_token", bidirectional=bidirectional).eval()
        with torch.no_grad():
            states = [m.model(**{k: v for k, v in m.tokenize([t]).items() if k != "pool_mask"}).last_hidden_state
                      for t in ("one two three four", "one two three five")]
        return not torch.allclose(states[0][0, 1], states[1][0, 1], atol=1e-6)

    assert not first_token_moves(False)
    assert first_token_moves(True)


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
def test_stage_with_bce_and_hmcl_losses_trains_and_saves(prepared, tiny_model):
    """A stage can swap QZhou's losses per task: pair BCE for STS, HMCL for retrieval and NLI."""
    from embed_core.train.run import run_train_stage

    tmp, run_dir = prepared
    cfg = _config_dict(tmp, tiny_model)
    alt = dict(cfg["train"]["stages"][1], name="alt", steps=8,
               losses={"retrieval": "hmcl", "nli": "hmcl", "sts": "pair_bce"})
    cfg["train"]["stages"] = [alt]
    manifest = run_train_stage(parse_config(cfg), run_dir, "alt", upstream=records_upstream(parse_config(cfg), "train"))
    metrics = pq.read_table(run_dir / "train-alt/metrics.parquet").to_pylist()
    assert len(metrics) == 8 and all(r["loss"] == r["loss"] and r["loss"] > 0 for r in metrics)
    assert {"retrieval", "sts", "nli"} & {r["task"] for r in metrics}
    saved = _weights(run_dir / "train-alt/model")
    assert not any("loss_heads" in k for k in saved)  # the L_e head is a training-only part
    settings = json.loads((run_dir / "train-alt/model/embedpipe.json").read_text())
    losses = settings["training"]["stage"]["losses"]  # recorded with every parameter filled in
    assert {task: spec["name"] for task, spec in losses.items()} == {"retrieval": "hmcl", "nli": "hmcl", "sts": "pair_bce"}
    assert losses["sts"]["scale"] == 20.0 and losses["retrieval"]["levels"] == [0.8, 0.4]
    assert manifest["input_fingerprint"]


def test_hmcl_batches_map_scores_to_levels_and_fill_missing_ones():
    import pyarrow as pa

    from embed_core.schema import RECORD_SCHEMA
    from embed_core.train.engine.batches import DatasetRecords, build_batch

    rows = []
    for i, (t1, t2, score) in enumerate([("a cat sits", "a cat is sitting", 4.6), ("a dog runs fast", "a dog walks", 2.5),
                                         ("rain falls", "stocks went up 3 points", 0.4)]):
        rows.append({"id": f"s/{i}", "dataset": "s", "task": "sts", "instruction": "", "query": t1, "positives": [t2],
                     "positive_scores": [score], "negatives": [], "negative_scores": [], "negative_labels": [],
                     "weak_positives": [], "label": None, "origin": "original", "source_ref": f"f:{i}"})
    records = DatasetRecords("s", pa.Table.from_pylist(rows, schema=RECORD_SCHEMA))
    kwargs = dict(step=3, seed=7, num_negatives=1, query_max_length=16, passage_max_length=16, use_instructions=False,
                  layout="hmcl", hmcl_levels=(0.8, 0.4))
    batch = build_batch(records, [0, 1, 2], **kwargs)
    assert batch.layout == "hmcl" and batch.max_score == pytest.approx(4.6)
    pos, weak = batch.groups["positive"].texts, batch.groups["weak"].texts
    assert pos[0] == "a cat is sitting"            # 4.6/4.6 >= 0.8: the pair's text is the positive
    assert weak[1] == "a dog walks"                 # 2.5/4.6 in [0.4, 0.8): weak-positive
    assert batch.groups["negative"].texts == ["stocks went up 3 points"] and batch.negative_rows == [2]
    assert pos[1] != "a dog runs fast" and set("a dog runs fast".split()) <= set(pos[1].split())  # supplied positive
    assert weak[0] != pos[0]                        # supplied weak-positive
    assert build_batch(records, [0, 1, 2], **kwargs).groups["weak"].texts == weak  # deterministic per (seed, step)


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
def test_codiemb_stage_alternates_ir_and_sts_steps(prepared, tiny_model):
    from embed_core.train.run import run_train_stage

    tmp, run_dir = prepared
    cfg = _config_dict(tmp, tiny_model)
    stage = dict(cfg["train"]["stages"][1], name="codiemb", steps=6, alternate_tasks=True,
                 losses={"retrieval": {"name": "codiemb_ir", "num_positives": 2}, "sts": "codiemb_sts",
                         "nli": "codiemb_sts"},
                 datasets=["scifact", "flag-toy", "stsb", "sick-e"])
    cfg["train"]["stages"] = [stage]
    run_train_stage(parse_config(cfg), run_dir, "codiemb", upstream=records_upstream(parse_config(cfg), "train"))
    metrics = pq.read_table(run_dir / "train-codiemb/metrics.parquet").to_pylist()
    tasks = [r["task"] for r in metrics]
    assert tasks[0::2] == ["retrieval"] * 3 and all(t in ("sts", "nli") for t in tasks[1::2])
    assert all(r["loss"] == r["loss"] for r in metrics)


def test_codiemb_ir_batches_draw_k_positives_and_negatives_with_replacement():
    import pyarrow as pa

    from embed_core.schema import RECORD_SCHEMA
    from embed_core.train.engine.batches import DatasetRecords, build_batch

    rows = [{"id": "r/0", "dataset": "r", "task": "retrieval", "instruction": "", "query": "q0", "positives": ["p0"],
             "positive_scores": [], "negatives": ["n0a", "n0b", "n0c", "n0d", "n0e"], "negative_scores": [],
             "negative_labels": [], "weak_positives": [], "label": None, "origin": "original", "source_ref": "f:1"},
            {"id": "r/1", "dataset": "r", "task": "retrieval", "instruction": "", "query": "q1",
             "positives": ["p1a", "p1b", "p1c"], "positive_scores": [], "negatives": [], "negative_scores": [],
             "negative_labels": [], "weak_positives": [], "label": None, "origin": "original", "source_ref": "f:2"}]
    records = DatasetRecords("r", pa.Table.from_pylist(rows, schema=RECORD_SCHEMA))
    batch = build_batch(records, [0, 1], step=0, seed=1, num_negatives=4, query_max_length=8, passage_max_length=8,
                        use_instructions=False, layout="multi_positive", num_positives=2)
    pos = batch.groups["positive"].texts
    assert pos[:2] == ["p0", "p0"]                               # one positive, drawn twice (replacement)
    assert len(set(pos[2:])) == 2 and set(pos[2:]) <= {"p1a", "p1b", "p1c"}  # enough: drawn without
    neg = batch.groups["negative"].texts
    assert len(neg) == 4 and len(set(neg)) == 4 and all(n.startswith("n0") for n in neg)  # record 1 has none


def test_each_step_records_the_unclipped_gradient_norm_peak_memory_and_mfu(prepared, tiny_model):
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.run import load_datasets
    from embed_core.train.engine.trainer import Trainer

    tmp, run_dir = prepared
    config = parse_config(_config_dict(tmp, tiny_model))
    stage = TrainStageConfig(name="tm", tasks=["retrieval"], steps=1, batch_size={"retrieval": 4}, warmup_steps=0,
                             num_hard_negatives=1, max_grad_norm=1e-3, query_max_length=32, passage_max_length=48)
    datasets = load_datasets(run_dir, stage, records_upstream(config, "train"))
    train = config.train.model_copy(update={"peak_tflops": 1e-3})  # a made-up device of 1 GFLOP/s
    trainer = Trainer(train, stage, datasets, init_model=str(tiny_model), checkpoint_dir=tmp / "tm", seed=0)
    norms = []
    clip = torch.nn.utils.clip_grad_norm_

    def recording(params, max_norm, *args, **kwargs):  # the norm clipping saw, from torch itself
        params = list(params)
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params
                                                                 if p.grad is not None]))))
        return clip(params, max_norm, *args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = recording
    try:
        row = trainer.train_step()[-1]
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
    assert row["grad_norm"] == pytest.approx(norms[0], rel=1e-5) and row["grad_norm"] > 1e-3  # before clipping
    assert row["peak_memory_mb"] > 10
    expected = row["tokens"] * trainer.flops.per_token(row["tokens"] / row["texts"]) / row["seconds"] / 1e9
    assert row["mfu"] == pytest.approx(expected)


def test_grad_cache_chunks_of_a_token_budget_give_the_full_batch_gradients_and_stay_within_it(prepared, tiny_model):
    """Chunks by padded tokens (texts × the chunk's longest), longest texts first, so passages go in
    small chunks and queries in large ones; the embeddings go back to the group's order, so loss and
    gradients equal one pass over the whole batch."""
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.engine.batches import build_batch
    from embed_core.train.run import load_datasets
    from embed_core.train.engine.trainer import Trainer

    tmp, run_dir = prepared
    config = parse_config(_config_dict(tmp, tiny_model))
    grads, losses = [], []
    for budget in (None, 96):
        stage = TrainStageConfig(name="gt", tasks=["retrieval"], steps=1, batch_size={"retrieval": 8},
                                 num_hard_negatives=2, grad_cache_max_tokens=budget, query_max_length=32,
                                 passage_max_length=48)
        datasets = load_datasets(run_dir, stage, records_upstream(config, "train"))
        trainer = Trainer(config.train, stage, datasets, init_model=str(tiny_model), checkpoint_dir=tmp / "gt", seed=0)
        trainer.model.eval()
        batch = build_batch(datasets["scifact"], list(range(8)), step=0, seed=0, num_negatives=2,
                            query_max_length=32, passage_max_length=48, use_instructions=True)
        if budget:
            for group in batch.groups.values():
                chunks = trainer.passes.chunks(group)
                lengths = trainer.model.tokenize(group.texts, group.instructions, group.max_length)[
                    "attention_mask"].sum(dim=1).tolist()
                assert sorted(i for c in chunks for i in c) == list(range(len(group.texts)))
                assert all(len(c) == 1 or len(c) * max(lengths[i] for i in c) <= budget for c in chunks)
            sizes = {name: [len(c) for c in trainer.passes.chunks(g)] for name, g in batch.groups.items()}
            assert len(sizes["positive"]) > len(sizes["query"]), sizes  # long texts: smaller chunks
        losses.append(trainer._forward_backward(batch, 1.0))
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4), name


def test_a_step_row_counts_the_false_negatives_its_loss_left_out(tiny_model, tmp_path):
    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords
    from embed_core.train.config import TrainConfig, TrainStageConfig
    from embed_core.train.engine.trainer import Trainer

    # queries 0 and 1 share their positive (2 masked pairs); query 2's hard negative copies query 3's positive (1)
    texts = [("q0", "shared doc", []), ("q1", "shared doc", []), ("q2", "p2", ["p3"]), ("q3", "p3", [])]
    recs = [Record(id=f"d:{i}", dataset="d", task="retrieval", query=q, positives=[p], negatives=n,
                   source_ref=f"d:{i}") for i, (q, p, n) in enumerate(texts)]
    stage = TrainStageConfig(name="fn", steps=1, batch_size={"retrieval": 4}, num_hard_negatives=1, warmup_steps=0,
                             query_max_length=16, passage_max_length=16)
    cfg = TrainConfig(base_model=str(tiny_model), max_length=16, precision="fp32", stages=[stage])
    trainer = Trainer(cfg, stage, {"d": DatasetRecords("d", records_to_table(recs))}, init_model=str(tiny_model),
                      checkpoint_dir=tmp_path / "fn", seed=0, log=lambda _: None)
    (row,) = trainer.train_step()
    assert row["masked_duplicates"] == 3 and row["masked_margin"] == 0


@pytest.mark.slow  # trains and evaluates a stage: make test, not make test-fast
def test_matryoshka_training_on_the_grad_cache_path_records_its_dims_in_the_model_and_its_card(prepared, tiny_model):
    """The Matryoshka loss on GradCache's cached embeddings gives the uncached gradients, and a stage
    trained with it records the dims in embedpipe.json, the card facts and the card."""
    from embed_core.model.card import read_card_facts
    from embed_core.model.settings import read_model_settings
    from embed_core.train.engine.batches import build_batch
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.run import load_datasets, run_train_stage
    from embed_core.train.engine.trainer import Trainer

    tmp, run_dir = prepared
    config = parse_config(_config_dict(tmp, tiny_model))
    grads = []
    for chunk in (None, 3):
        stage = TrainStageConfig(name="mrl", tasks=["retrieval"], steps=1, batch_size={"retrieval": 8},
                                 num_hard_negatives=2, grad_cache_chunk=chunk, query_max_length=32,
                                 passage_max_length=48, matryoshka={"dims": [32, 8], "weights": [1.0, 0.5]})
        datasets = load_datasets(run_dir, stage, records_upstream(config, "train"))
        trainer = Trainer(config.train, stage, datasets, init_model=str(tiny_model), checkpoint_dir=tmp / "mrl", seed=0)
        trainer.model.eval()
        batch = build_batch(datasets["scifact"], list(range(8)), step=0, seed=0, num_negatives=2,
                            query_max_length=32, passage_max_length=48, use_instructions=True)
        grads.append((trainer._forward_backward(batch, 1.0),
                      {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}))
    (loss_full, full), (loss_cached, cached) = grads
    assert loss_full == pytest.approx(loss_cached, rel=1e-5)
    assert all(torch.allclose(full[n], cached[n], atol=1e-5, rtol=1e-4) for n in full)

    cfg = _config_dict(tmp, tiny_model)
    cfg["train"]["matryoshka"] = {"dims": [8, 32, 16]}
    cfg["train"]["stages"] = [dict(cfg["train"]["stages"][0], name="mrl", steps=2, grad_cache_chunk=3)]
    run_train_stage(parse_config(cfg), run_dir, "mrl", upstream=records_upstream(parse_config(cfg), "train"))
    model_dir = run_dir / "train-mrl/model"
    assert json.loads((model_dir / "embedpipe.json").read_text())["matryoshka"] == {"dims": [32, 16, 8],
                                                                                  "weights": [1.0, 1.0, 1.0]}
    assert read_model_settings(model_dir).matryoshka_dims == [32, 16, 8]
    assert read_card_facts(model_dir)["matryoshka"]["dims"] == [32, 16, 8]
    card = (model_dir / "README.md").read_text()
    assert "## Matryoshka dimensions" in card and "truncate_dim=8" in card

    # the evaluate stage scores the trained dims by default and puts them in the released card
    from embed_core.evaluate.run import run_evaluate

    (tmp / "sts.csv").write_text("sentence1,sentence2,score\n" + "\n".join(
        f"{a},{b},{x}" for a, b, x in [("A cat sleeps.", "A cat is sleeping.", 4.8), ("A man cooks.", "A dog runs.", 0.4),
                                       ("Kids play.", "Children are playing.", 4.5), ("It rains.", "The sun shines.", 1.0)]))
    cfg["evaluate"] = {"models": ["trained"], "base_model": str(tiny_model),
                       "tasks": [{"name": "LocalSTS", "type": "sts", "path": str(tmp / "sts.csv")}]}
    run_evaluate(parse_config(cfg), run_dir)
    sizes = pq.read_table(run_dir / "evaluate/sizes.parquet").to_pylist()
    assert [(r["model"], r["dim"], r["precision"]) for r in sizes] == [("mrl", d, "float32") for d in (32, 16, 8)]
    released = (run_dir / "evaluate/model/README.md").read_text()
    row = next(line for line in released.splitlines() if line.startswith("| LocalSTS | cosine_spearman |") and
               line.count("|") == 6)
    assert "| task | metric | 32 dims | 16 dims | 8 dims |" in released
    assert row == "| LocalSTS | cosine_spearman | " + " | ".join(f"{100 * r['value']:.2f}" for r in sizes) + " |"
