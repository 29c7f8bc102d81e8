"""How a training step runs, with no run directory: the trainer and its loop, the encoder passes,
batches and dataset sampling, the back ends (plain, FSDP2, DeepSpeed), checkpoints of the step's
state, telemetry, lineage of consumed records, HMCL's edit supplier and the AutoRegEmbed modes.
The stage (``embed_core.train``) gives it datasets, a config and a checkpoint directory."""
