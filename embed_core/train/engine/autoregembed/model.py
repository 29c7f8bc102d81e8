"""AutoRegEmbed's two networks (autoregembed.txt §3; methods notes part B §1.2).

* :class:`CompressionEncoder` — the trainable LLM (``AutoModel``, no LM head). Input layout (the
  authors' code): ``[BOS] text \\n instruction \\n <EMBED0> … <EMBED{k-1}>``, right padded, the k
  compression tokens right after each sequence's true length. Their last-layer hidden states
  ``e_c`` [B, k, H] are the "generative embedding"; at inference the embedding is their mean,
  L2-normalised. No projection layer, causal attention unchanged.
* :class:`FrozenDecoder` — a frozen ``AutoModelForCausalLM`` (the base checkpoint) that sees only
  ``e_c`` as prefix input embeddings followed by the target's token embeddings
  (``inputs_embeds = [e_c; embed(target)]``, labels −100 on the k prefix slots, target + EOS),
  so everything it reconstructs must pass through the k vectors.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from embed_core.model.embedder import save_merged, with_lora
from embed_core.model.encoder import compress_inputs, compress_states, compress_token_ids, resolve_model_path
from embed_core.model.files import save_tokenizer
from embed_core.model.settings import SETTINGS_FILE


def _pad(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


class CompressionEncoder(nn.Module):
    def __init__(self, model: str, *, compress_tokens: int = 5, max_length: int = 128,
                 instruction_template: str = "{text}\n{instruction}\n", lora: dict[str, Any] | None = None,
                 gradient_checkpointing: bool = False):
        super().__init__()
        from transformers import AutoModel, AutoTokenizer

        self.path = resolve_model_path(model)
        self.k = compress_tokens
        self.max_length = max_length
        self.instruction_template = instruction_template
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        if self.tokenizer.pad_token is None:  # the authors' code: pad = eos
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.compress_ids = compress_token_ids(self.tokenizer, compress_tokens)
        self.model = AutoModel.from_pretrained(self.path)
        if len(self.tokenizer) > self.model.get_input_embeddings().num_embeddings:
            self.model.resize_token_embeddings(len(self.tokenizer))
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = lora
        if lora:
            self.model = with_lora(self.model, lora, gradient_checkpointing)
        config = self.model.config
        self.dim = int(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "hidden_size"))

    def format(self, text: str, instruction: str) -> str:
        return self.instruction_template.format(text=text, instruction=instruction)

    def tokenize(self, texts: Sequence[str], instructions: Sequence[str]) -> dict[str, Tensor]:
        formatted = [self.format(t, i) for t, i in zip(texts, instructions)]
        ids, mask = _pad(compress_inputs(self.tokenizer, formatted, self.max_length, self.compress_ids),
                         self.tokenizer.pad_token_id)
        return {"input_ids": ids, "attention_mask": mask}

    def compress(self, features: dict[str, Tensor]) -> Tensor:
        """e_c: the k compression tokens' last hidden states, [B, k, H]."""
        hidden = self.model(input_ids=features["input_ids"], attention_mask=features["attention_mask"]).last_hidden_state
        return compress_states(hidden, features["attention_mask"], self.k)

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        """The inference embedding: mean of the k states, L2-normalised."""
        return nn.functional.normalize(self.compress(features).float().mean(dim=1), dim=-1)

    def save(self, directory: str | Path, *, task_instructions: dict[str, str], extra: dict[str, Any] | None = None) -> Path:
        """Weights + tokenizer (with the k tokens) in transformers layout and ``embedpipe.json``
        telling the evaluator to append the k tokens and average them, with the method's instructions."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_merged(self.model, out)
        save_tokenizer(self.tokenizer, out)
        (out / SETTINGS_FILE).write_text(json.dumps({
            "pooling": "compress", "compress_tokens": self.k, "max_length": self.max_length,
            "use_instructions": True, "instructions_fixed": True, "instruction_template": self.instruction_template,
            "instructions": {}, "task_instructions": task_instructions, **(extra or {})}, indent=2, default=str))
        return out


class FrozenDecoder(nn.Module):
    """The frozen causal LM that reads the compressed prefix. Its parameters never receive gradients
    (``requires_grad=False``, eval mode: no dropout), but gradients flow through it to the prefix."""

    def __init__(self, model: str, *, target_max_length: int = 64):
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = resolve_model_path(model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.lm = AutoModelForCausalLM.from_pretrained(self.path)
        self.lm.requires_grad_(False)
        self.lm.eval()
        self.target_max_length = target_max_length
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id

    def train(self, mode: bool = True) -> FrozenDecoder:  # stays in eval mode whatever the trainer does
        return super().train(False)

    def targets(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Target ids (no BOS: the prefix starts the sequence) + EOS, right padded, and their mask."""
        ids = self.tokenizer(list(texts), add_special_tokens=False, truncation=True,
                             max_length=self.target_max_length)["input_ids"]
        return _pad([list(x) + [self.eos_id] for x in ids], self.pad_id)

    def token_logprobs(self, prefix: Tensor, target_ids: Tensor, target_mask: Tensor) -> Tensor:
        """log p(target_t | target_<t, prefix) for every target position, 0 at padding: [B, T]."""
        k, steps = prefix.size(1), target_ids.size(1)
        embed = self.lm.get_input_embeddings()(target_ids)  # Gemma's scaled embedding included
        inputs = torch.cat([prefix.to(embed.dtype), embed], dim=1)
        mask = torch.cat([target_mask.new_ones(prefix.shape[:2]), target_mask], dim=1)
        # position k-1+t predicts target token t: keep only those T logits (the vocabulary is large)
        logits = self.lm(inputs_embeds=inputs, attention_mask=mask, logits_to_keep=steps + 1).logits[:, :steps]
        assert inputs.size(1) == k + steps
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
        return logp * target_mask.to(logp.dtype)

    def sequence_logprob(self, prefix: Tensor, target_ids: Tensor, target_mask: Tensor) -> Tensor:
        """log p(d | e_c), summed over target tokens incl. EOS (the authors' ``average_log_prob=False``): [B]."""
        return self.token_logprobs(prefix, target_ids, target_mask).sum(dim=1)
