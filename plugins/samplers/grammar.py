"""The grammar step: a row whose request has a `format` may only draw the tokens its grammar allows next.

Ordered first, before penalties, so every later step and a greedy row's argmax see only allowed tokens.
Active for the rows whose sampler carries a grammar matcher, greedy ones included (see corral.grammar).
It defines `allows`, so the chain first draws without it and computes the full mask only for a row whose
token the grammar rejects (corral.sample.SamplerChain.sample).
"""

from __future__ import annotations

import torch

from corral.grammar import mask_logits
from corral.hookspecs import hookimpl
from corral.options import Options
from corral.sample import BatchParams, SequenceSampler


@hookimpl
def register_samplers(register):
    register(GrammarMask.name, GrammarMask)


class GrammarMask:
    """Mask the tokens the row's grammar does not allow to -inf."""

    name = "grammar"
    order = 0
    options: dict = {}

    @classmethod
    def active(cls, options: Options) -> bool:
        return False  # the format is not an option: `active_for` looks at the sequence

    @classmethod
    def active_for(cls, sampler: SequenceSampler) -> bool:
        return sampler.grammar is not None

    @staticmethod
    def allows(sampler: SequenceSampler, token: int) -> bool:
        return sampler.grammar.allows(token)

    def apply(self, logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
        return mask_logits(logits, [seq.grammar for seq in params.seqs])
