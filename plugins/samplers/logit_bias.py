"""The logit_bias step: add a per-request bias to chosen tokens' logits (OpenAI's `logit_bias`, llama.cpp's too).

    options = {"logit_bias": {"15496": -100, "1820": 5.5}}    # token id -> bias in [-100, 100]

Ordered after the grammar and before penalties, as llama.cpp adds biases first. A bias of -100 all but bans a
token (it is not -inf: OpenAI's semantics, a token may still win when nothing else is allowed). Greedy rows see
the biases too. Token ids are checked against the model's vocabulary when a sequence starts.
"""

from __future__ import annotations

import torch

from corral.hookspecs import hookimpl
from corral.options import InvalidOptionError, Options
from corral.sample import BatchParams, SequenceSampler


@hookimpl
def register_samplers(register):
    register(LogitBias.name, LogitBias)


class LogitBias:
    """Add each row's biases to its logits, all rows in one scatter."""

    name = "logit_bias"
    order = 5
    options = {"logit_bias": ("token_biases", ())}

    @classmethod
    def active(cls, options: Options) -> bool:
        return bool(options.get("logit_bias"))

    @staticmethod
    def prepare(sampler: SequenceSampler, tokenizer) -> None:
        vocab = getattr(tokenizer, "vocab_size", None)
        outside = [token for token, _ in sampler.options.get("logit_bias") if vocab is not None and token >= vocab]
        if outside:
            raise InvalidOptionError(f"logit_bias has token ids outside the vocabulary of {vocab} tokens: {outside[:5]}")

    def apply(self, logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
        pairs = [(row, token, bias) for row, opts in enumerate(params.options) for token, bias in opts.get("logit_bias")]
        pairs = [(row, token, bias) for row, token, bias in pairs if token < logits.shape[1]]
        if not pairs:
            return logits
        rows, tokens, biases = zip(*pairs)
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        return logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)
