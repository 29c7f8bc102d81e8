"""A saved model does not depend on the environment of the process that saved it: transformers
writes how the saving process loaded the tokenizer (``local_files_only`` follows HF_HUB_OFFLINE)
into ``tokenizer_config.json``; embedpipe leaves those loader-only keys out, and a model's
fingerprint ignores them in a model saved before, so the same weights saved from the UI's worker
(offline) and a plain shell are one model and `evaluate` stays fresh."""

import json
import os
import subprocess
import sys

from embed_core.model.encoder import model_fingerprint
from tests.helpers.repo import REPO

SAVE = """
import sys
from embed_core.model.embedder import Embedder
Embedder(sys.argv[1], max_length=16).save(sys.argv[2])
"""


def test_the_same_weights_saved_offline_and_online_are_the_same_files_and_one_fingerprint(tmp_path, tiny_model):
    out = {}
    for offline in ("0", "1"):
        env = {**os.environ, "HF_HUB_OFFLINE": offline, "TRANSFORMERS_OFFLINE": offline, "PYTHONPATH": str(REPO)}
        out[offline] = tmp_path / f"offline-{offline}"
        subprocess.run([sys.executable, "-c", SAVE, str(tiny_model), str(out[offline])], env=env, check=True,
                       capture_output=True, timeout=300)
    configs = [json.loads((out[o] / "tokenizer_config.json").read_text()) for o in ("0", "1")]
    assert configs[0] == configs[1] and "local_files_only" not in configs[0]
    assert model_fingerprint(str(out["0"]), "mean", 16, False) == model_fingerprint(str(out["1"]), "mean", 16, False)


def test_a_model_saved_before_with_a_loader_only_key_has_the_fingerprint_of_one_without_it(tmp_path, tiny_model):
    """Models saved before the keys were left out: local_files_only true or false is one model, and
    a real change of the tokenizer's settings is still another."""
    import shutil

    fingerprints = []
    for value in (True, False):
        copy = tmp_path / f"copy-{value}"
        shutil.copytree(tiny_model, copy)
        path = copy / "tokenizer_config.json"
        config = json.loads(path.read_text())
        path.write_text(json.dumps({**config, "local_files_only": value}))
        fingerprints.append(model_fingerprint(str(copy), "mean", 16, False))
    assert fingerprints[0] == fingerprints[1]
    path = tmp_path / "copy-True" / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_lower_case": False}))
    assert model_fingerprint(str(tmp_path / "copy-True"), "mean", 16, False) != fingerprints[0]
