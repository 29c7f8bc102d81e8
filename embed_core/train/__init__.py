"""The train stage (``stage.py``): the trainer, batches, dataset sampling, HMCL's edit supplier and the
AutoRegEmbed modes; the losses live in ``embed_core.losses``."""
