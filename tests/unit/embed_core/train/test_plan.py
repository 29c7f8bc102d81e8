"""The memory planner (``embed_core.train.plan``, ``embedpipe plan``): its plan against the peak the
CPU allocator measures while the real trainer runs, fsdp's division of the sharded parts, the
one-line error of a stage that does not fit, and the command's table.

The measured peak: bytes held before the steps (parameters and buffers) plus the highest total
the profiler's memory events report during two optimizer steps of a fresh trainer (the second
step's backward pass runs with AdamW state allocated). That is the CPU's counterpart of
``torch.cuda.max_memory_allocated``: tensors only, no interpreter, tokenizer or allocator slack."""

from __future__ import annotations

import json
import random

import pytest

from embed_core.train.config import TrainConfig
from tests.helpers.cli_run import STS_SOURCE, in_process, write_config, write_sts_data

QWEN3 = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=768, max_position_embeddings=512)  # 9.4 M parameters, 7.8 M of them the vocabulary
MIB = 2 ** 20


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tiny_model):
    """A random-init Qwen3 whose weights, gradients and AdamW state (150 MB) outweigh its batches."""
    from tests.helpers.tiny_model import build_tiny_decoder

    return build_tiny_decoder(tmp_path_factory.mktemp("plan") / "qwen3", "qwen3", tokenizer_dir=tiny_model, **QWEN3)


@pytest.fixture(scope="module")
def long_records():
    """Retrieval records whose every text is longer than any max length here: the plan's worst case
    (every text at its group's max length) is then what the trainer embeds."""
    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords

    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud".split()

    def text() -> str:
        return " ".join(rng.choice(words) for _ in range(200))

    records = [Record(id=str(i), dataset="d", task="retrieval", query=text(), positives=[text()],
                      negatives=[text() for _ in range(3)]) for i in range(32)]
    return {"d": DatasetRecords("d", records_to_table(records))}


TRAIN_KEYS = ("lora", "weights_dtype", "precision")  # settings of the train section, the rest are the stage's


@pytest.fixture
def one_thread():
    """One intra-op thread: these steps are tiny, and on shared cores a second thread mostly spins
    (one thread took a quarter of two threads' CPU time here; the bytes measured are the same)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _train(model, **settings) -> TrainConfig:
    stage = {"name": "s", "tasks": ["retrieval"], "steps": 4, "warmup_steps": 0, "num_hard_negatives": 2,
             "checkpoint_every": 10 ** 9, "log_every": 10 ** 9,
             **{k: v for k, v in settings.items() if k not in TRAIN_KEYS}}
    return TrainConfig.model_validate({"base_model": str(model), "max_length": 128, "precision": "fp32",
                                       **{k: v for k, v in settings.items() if k in TRAIN_KEYS}, "stages": [stage]})


def measured_peak(trainer, steps: int = 2) -> int:
    """Peak tensor bytes of ``steps`` optimizer steps of a fresh trainer (module docstring)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    held = sum(t.numel() * t.element_size() for t in [*trainer.model.parameters(), *trainer.model.buffers()])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            trainer.train_step()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = [e for e in json.load(open(trace.name))["traceEvents"] if e.get("name") == "[memory]"]
    events.sort(key=lambda e: e["ts"])
    # the allocator's running total counts from before the profile: its first event sets the zero
    zero = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return held + max(e["args"]["Total Allocated"] - zero for e in events)


SIZES = {"query_max_length": 32, "passage_max_length": 64}
CASES = {  # model -> {case: stage settings}; fp32, so the CPU computes what the plan assumes
    "tiny BERT": {"full fine-tune, no GradCache": {"batch_size": {"retrieval": 8}, **SIZES},
                  "GradCache chunks of 4 texts": {"batch_size": {"retrieval": 8}, "grad_cache_chunk": 4, **SIZES}},
    "Qwen3 9M": {"full fine-tune, no GradCache": {"batch_size": {"retrieval": 4}, **SIZES},
                 "GradCache chunks of 4 texts": {"batch_size": {"retrieval": 4}, "grad_cache_chunk": 4, **SIZES}},
}
# the rest of the model (slow: `make test` runs them, `make test-fast` does not)
MORE = {
    "tiny BERT": {"gradient checkpointing": {"batch_size": {"retrieval": 8}, "gradient_checkpointing": True, **SIZES},
                  "2 micro-batches per step": {"batch_size": {"retrieval": 8}, "grad_accum": 2, **SIZES},
                  "LoRA r 8, dropout 0.05": {"batch_size": {"retrieval": 8}, "lora": {"r": 8}, **SIZES}},
    "Qwen3 9M": {"LoRA r 8, bf16 base": {"batch_size": {"retrieval": 4}, "lora": {"r": 8}, "weights_dtype": "bf16",
                                         "precision": "bf16", **SIZES}},
}


@pytest.mark.parametrize("model,case", [(m, c) for m, cases in CASES.items() for c in cases] +
                         [pytest.param(m, c, marks=pytest.mark.slow) for m, cases in MORE.items() for c in cases])
def test_the_plan_is_within_25_percent_of_the_peak_the_trainer_reaches_on_cpu(model, case, request, long_records,
                                                                             tmp_path, capsys, one_thread):
    from embed_core.train.plan import model_shape, plan_task
    from embed_core.train.engine.trainer import Trainer

    path = request.getfixturevalue("tiny_model" if model == "tiny BERT" else "qwen3")
    train = _train(path, **{**CASES[model], **MORE[model]}[case])
    planned = plan_task(model_shape(str(path)), train, train.stages[0], "retrieval", device="cpu")
    trainer = Trainer(train, train.stages[0], long_records, init_model=str(path), checkpoint_dir=tmp_path,
                      seed=0, log=lambda _: None)
    measured = measured_peak(trainer)
    with capsys.disabled():  # the validation figures (docs/experiments.md, "Memory planner")
        print(f"\n{model}, {case}: planned {planned.peak / MIB:.2f} MiB ({planned.phase}), measured "
              f"{measured / MIB:.2f} MiB, ratio {planned.peak / measured:.3f}")
    assert abs(planned.peak / measured - 1) <= 0.25, (planned, measured)


def test_fsdp_over_n_ranks_divides_weights_gradients_and_adamw_by_n():
    """Hand-computed on a four-tensor model: every tensor's dim 0 is split N ways (padded up, as
    DTensor shards it), and a rank gathers the root unit and two layers in compute dtype."""
    from embed_core.train.plan import ModelShape, states

    shape = ModelShape(name="toy", model_type="llama", layers=1, hidden=4, intermediate=8, heads=1, kv_heads=1,
                       head_dim=4, hidden_dropout=0.0, attention_dropout=0.0, attention="sdpa",
                       params={"embed_tokens.weight": (8, 4), "layers.0.mlp.up_proj.weight": (8, 4),
                               "layers.0.input_layernorm.weight": (4,), "norm.weight": (5,)})
    one = states(shape, _fsdp_train(), world=1, bf16=False)
    four = states(shape, _fsdp_train(), world=4, bf16=False)
    # 8·4 + 8·4 + 4 + 5 = 73 parameters: fp32 weights and gradients 292 B, AdamW 584 B on one rank
    assert (one.weights, one.gradients, one.optimizer, one.gathered) == (292, 292, 584, 0)
    # on each of 4: 2·4 + 2·4 + 1 + 2 (5 padded to 8) = 19 parameters: 76 B, 76 B, 152 B
    assert (four.weights, four.gradients, four.optimizer) == (76, 76, 152)
    # gathered: root (32 + 5) + 2 × the layer (32 + 4), fp32: (37 + 72) · 4
    assert four.gathered == 436
    # loading (sharded on the meta device, rank 0 broadcasting): the shards and the largest whole
    # tensor being broadcast (8·4 fp32), not the whole model
    assert four.load == 76 + 128


def _fsdp_train() -> TrainConfig:
    return TrainConfig.model_validate({"base_model": "toy", "sharding": "fsdp", "precision": "fp32",
                                       "stages": [{"name": "s"}]})


def test_a_stage_that_cannot_fit_is_one_line_naming_the_stage_and_the_chunk_that_fits(tmp_path, capfd, qwen3):
    write_sts_data(tmp_path)
    stages = [{"name": "small", "tasks": ["retrieval"], "grad_cache_chunk": 2, "passage_max_length": 64},
              {"name": "big", "tasks": ["retrieval"], "batch_size": {"retrieval": 64}, "passage_max_length": 512}]
    config = write_config(tmp_path, [STS_SOURCE], train={"base_model": str(qwen3), "stages": stages})
    result = in_process(capfd, "plan", "--config", config, "--gpu-memory", "1")
    line = result.assert_one_line_error("train stage 'big' does not fit 1 GPU of 1 GiB", "grad_cache_chunk: ")
    assert "'small'" not in line
    assert "big" in result.out and "NO" in result.out  # the table still says what each stage needs

    from embed_core.config import load_config
    from embed_core.train.plan import plan_config

    train = load_config(config).train
    chunk = int(line.split("grad_cache_chunk: ")[1].split()[0])
    for n, fits in ((chunk, True), (chunk + 1, False)):  # the largest chunk that fits, exactly
        sized = train.model_copy(update={"stages": [train.stages[1].model_copy(update={"grad_cache_chunk": n})]})
        assert plan_config(sized, gpu_memory_gib=1).stages[0].fits is fits


def test_embedpipe_plan_prints_a_table_of_every_stage_and_json(tmp_path, capfd, tiny_model):
    write_sts_data(tmp_path)
    stages = [{"name": "stage1", "tasks": ["retrieval"], "grad_cache_chunk": 8},
              {"name": "stage2", "tasks": ["retrieval", "sts"]}]
    config = write_config(tmp_path, [STS_SOURCE], train={"base_model": str(tiny_model), "stages": stages})
    result = in_process(capfd, "plan", "--config", config, "--gpus", "2", "--gpu-memory", "80")
    assert result.rc == 0, result.err
    header = next(line for line in result.out.splitlines() if line.startswith("stage "))
    for column in ("weights", "grads", "AdamW", "activations", "peak", "fits", "largest chunk", "largest batch"):
        assert column in header
    rows = [line.split() for line in result.out.splitlines() if line.startswith(("stage1 ", "stage2 "))]
    assert [(r[0], r[1]) for r in rows] == [("stage1", "retrieval"), ("stage2", "retrieval"), ("stage2", "sts")]
    assert "2 GPUs of 80 GiB" in result.out
    as_json = json.loads(in_process(capfd, "plan", "--config", config, "--json").out)
    assert [s["stage"] for s in as_json["stages"]] == ["stage1", "stage2"]
    assert as_json["stages"][0]["tasks"][0]["chunk"] == [8, 512]


@pytest.mark.parametrize("gib", ["nan", "inf", "-inf", "-1", "0", "1e300"])
def test_a_gpu_memory_that_is_not_a_size_is_one_line_before_the_model_is_read(tmp_path, capfd, gib):
    write_sts_data(tmp_path)
    config = write_config(tmp_path, [STS_SOURCE], train={"base_model": str(tmp_path / "no-model"),
                                                         "stages": [{"name": "s"}]})
    result = in_process(capfd, "plan", "--config", config, f"--gpu-memory={gib}")  # '-inf' alone reads as an option
    result.assert_one_line_error(f"--gpu-memory must be a number of GiB above 0 and at most 1048576 "
                                 f"(got {float(gib):g})")
    assert result.out == ""


@pytest.mark.parametrize("task, loss", [("retrieval", None), ("retrieval", {"name": "hmcl"}),
                                        ("retrieval", {"name": "codiemb_ir", "num_positives": 3}),
                                        ("sts", None), ("sts", {"name": "hmcl"}), ("classification", None)])
def test_the_planner_sizes_exactly_the_groups_build_batch_fills(task, loss):
    """The plan's groups (names, texts per rank, max lengths) are those of a real batch whose every
    record has enough positives and negatives: the planner and the trainer share one batch layout."""
    from embed_core.losses import loss_for
    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords, build_batch
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.plan import task_groups

    stage = TrainStageConfig(name="s", tasks=[task], losses={task: loss} if loss else {}, num_hard_negatives=2,
                             query_max_length=24, passage_max_length=56)
    scored = {"positive_scores": [0.0]} if task == "sts" else {}  # hmcl: every pair a negative (worst case)
    labelled = {"label": "a", "negatives": ["b", "c", "d"], "negative_labels": ["b", "c", "d"]} \
        if task == "classification" else {"negatives": [f"n{j}" for j in range(4)]}
    records = [Record(id=str(i), dataset="d", task=task, query=f"q{i}", positives=[f"p{i}", f"p{i}b", f"p{i}c"],
                      **scored, **labelled) for i in range(6)]
    used = loss_for(task, stage.losses.get(task))
    batch = build_batch(DatasetRecords("d", records_to_table(records)), list(range(6)), step=0, seed=0,
                        num_negatives=stage.num_hard_negatives, query_max_length=24, passage_max_length=56,
                        use_instructions=False, layout=used.layout, **used.batch_options())
    built = [(name, len(g.texts), g.max_length) for name, g in batch.groups.items()]
    assert built == task_groups(stage, task, 6)


def test_plan_on_two_nodes_shards_over_a_nodes_gpus_and_prints_checkpoint_and_model_bytes(tmp_path, capfd, qwen3):
    """(F18, F10) 16 GPUs, 8 a node: fsdp_mesh auto is HSDP (2 × 8), so a rank holds an eighth of the
    weights, not a sixteenth; the disk line gives a checkpoint's and the committed model's bytes."""
    write_sts_data(tmp_path)
    train = {"base_model": str(qwen3), "sharding": "fsdp", "stages": [{"name": "s", "tasks": ["retrieval"]}]}
    config = write_config(tmp_path, [STS_SOURCE], train=train)
    hybrid = json.loads(in_process(capfd, "plan", "--config", config, "--gpus", "16", "--gpus-per-node", "8",
                                   "--json").out)
    flat = json.loads(in_process(capfd, "plan", "--config", config, "--gpus", "8", "--json").out)
    assert hybrid["stages"][0]["sharding"] == "hsdp/2x8" and flat["stages"][0]["sharding"] == "fsdp/8"
    assert hybrid["stages"][0]["tasks"][0]["weights"] == flat["stages"][0]["tasks"][0]["weights"]
    n = hybrid["model"]["parameters"]
    assert (hybrid["checkpoint_bytes"], hybrid["committed_bytes"]) == (12 * n, 2 * n)  # fp32 + AdamW; bf16
    assert hybrid["checkpoint_disk_bytes"] == 3 * 12 * n  # keep_checkpoints 2 and the one being written
    out = in_process(capfd, "plan", "--config", config, "--gpus", "16", "--gpus-per-node", "8").out
    assert "hsdp/2x8" in out and "disk: a resumable checkpoint is " in out
    in_process(capfd, "plan", "--config", config, "--gpus", "16", "--gpus-per-node", "6").assert_one_line_error(
        "train.fsdp_mesh: hybrid needs the same number of ranks on every node")
