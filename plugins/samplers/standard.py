"""The standard sampler steps, with Ollama's option names and llama.cpp's semantics.

    10 penalties   20 top_k   30 temperature   35 typical_p   40 top_p   50 min_p

Every step but penalties is inactive at temperature 0, so greedy rows take the argmax after penalties.
With `mirostat` on, the truncating steps (top_k, typical_p, top_p, min_p) are inactive: as in llama.cpp, the
mirostat step (plugins/samplers/mirostat.py) chooses the candidates itself.
Each step only sees the rows it is active for (see corral.sample).
"""

from __future__ import annotations

import torch

from corral.hookspecs import hookimpl
from corral.options import Options
from corral.sample import BatchParams, scatter_candidates, sorted_candidates
from corral.topk import topk


@hookimpl
def register_samplers(register):
    for step in (Penalties, TopK, Temperature, TypicalP, TopP, MinP):
        register(step.name, step)


def _exclusive_cumsum(probs: torch.Tensor) -> torch.Tensor:
    """The mass of the tokens before each one; computed without subtraction so boundaries stay exact."""
    return torch.nn.functional.pad(torch.cumsum(probs, dim=-1)[:, :-1], (1, 0))


class Penalties:
    """repeat_penalty, presence_penalty and frequency_penalty over each row's last `repeat_last_n` tokens."""

    name = "penalties"
    order = 10
    options = {
        "repeat_last_n": (int, 64),
        "repeat_penalty": (float, 1.0),
        "presence_penalty": (float, 0.0),
        "frequency_penalty": (float, 0.0),
    }

    @classmethod
    def active(cls, options: Options) -> bool:
        penalised = options.repeat_penalty != 1.0 or options.presence_penalty != 0.0 or options.frequency_penalty != 0.0
        return options.repeat_last_n != 0 and penalised

    def apply(self, logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
        vocab = logits.shape[1]
        history = params.history
        # Padding (-1) and out-of-vocabulary ids count into a spare last column that is dropped.
        slots = torch.where((history < 0) | (history >= vocab), vocab, history)
        counts = torch.zeros(logits.shape[0], vocab + 1, dtype=logits.dtype, device=logits.device)
        counts = counts.scatter_add_(1, slots, torch.ones_like(slots, dtype=logits.dtype))[:, :vocab]
        present = counts > 0
        repeat = params.tensor("repeat_penalty")[:, None]
        # llama.cpp: a repeated token's logit moves towards "less likely" whatever its sign.
        penalised = torch.where(logits > 0, logits / repeat, logits * repeat)
        logits = torch.where(present, penalised, logits)
        frequency = params.tensor("frequency_penalty")[:, None]
        presence = params.tensor("presence_penalty")[:, None]
        return logits - counts * frequency - present.to(logits.dtype) * presence


class TopK:
    """Keep the `top_k` largest logits of each row (0: disabled)."""

    name = "top_k"
    order = 20
    options = {"top_k": (int, 40)}

    @classmethod
    def active(cls, options: Options) -> bool:
        return options.temperature > 0 and options.top_k > 0 and not options.mirostat

    @staticmethod
    def keeps_at_most(params: BatchParams) -> int:
        return int(params.tensor("top_k").max())

    def candidates(self, logits: torch.Tensor, params: BatchParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top_k largest logits and their token ids, [b, largest k]; -inf past a row's own k."""
        k = params.tensor("top_k")
        width = min(int(k.max()), logits.shape[1])
        # One topk with the batch's largest k; each row keeps its own first k.
        values, ids = topk(logits, width)
        keep = torch.arange(width, device=logits.device)[None, :] < k[:, None]
        return values.masked_fill(~keep, float("-inf")), ids

    def apply(self, logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
        values, ids = self.candidates(logits, params)
        return torch.full_like(logits, float("-inf")).scatter_(1, ids, values)


class Temperature:
    """Divide the logits by `temperature` (0 is greedy and handled by the chain)."""

    name = "temperature"
    order = 30
    by_value = True
    options = {"temperature": (float, 0.8)}

    @classmethod
    def active(cls, options: Options) -> bool:
        return options.temperature > 0 and options.temperature != 1.0

    def apply(self, logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
        return logits / params.tensor("temperature")[:, None]


class TypicalP:
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy, up to mass `typical_p`."""

    name = "typical_p"
    order = 35
    by_value = True
    options = {"typical_p": (float, 1.0)}

    @classmethod
    def active(cls, options: Options) -> bool:
        return options.temperature > 0 and options.typical_p < 1.0 and not options.mirostat

    def apply(self, logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
        values, ids = sorted_candidates(logits)
        probs = torch.softmax(values, dim=-1)
        entropy = torch.special.entr(probs).sum(dim=-1, keepdim=True)
        distance = (-torch.log(probs) - entropy).abs()  # masked tokens: inf, so they sort last
        order = torch.argsort(distance, dim=-1, stable=True)
        mass_before = _exclusive_cumsum(probs.gather(1, order))
        # llama.cpp: stop after the first token that takes the sum strictly past p.
        keep_in_order = mass_before <= params.tensor("typical_p")[:, None]
        keep = torch.zeros_like(keep_in_order).scatter_(1, order, keep_in_order)
        return scatter_candidates(logits, ids, values, keep)


class TopP:
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches `top_p`."""

    name = "top_p"
    order = 40
    by_value = True
    options = {"top_p": (float, 0.9)}

    @classmethod
    def active(cls, options: Options) -> bool:
        return options.temperature > 0 and options.top_p < 1.0 and not options.mirostat

    def apply(self, logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
        values, ids = sorted_candidates(logits)
        mass_before = _exclusive_cumsum(torch.softmax(values, dim=-1))
        # A token is kept while the mass before it is still short of p (llama.cpp: cumulative >= p stops).
        keep = mass_before < params.tensor("top_p")[:, None]
        keep[:, 0] = True
        return scatter_candidates(logits, ids, values, keep)


class MinP:
    """Drop the tokens less likely than `min_p` times the most likely one."""

    name = "min_p"
    order = 50
    by_value = True
    options = {"min_p": (float, 0.0)}

    @classmethod
    def active(cls, options: Options) -> bool:
        return options.temperature > 0 and options.min_p > 0.0 and not options.mirostat

    def apply(self, logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p), as llama.cpp computes it.
        floor = logits.max(dim=-1, keepdim=True).values + torch.log(params.tensor("min_p"))[:, None]
        return logits.masked_fill(logits < floor, float("-inf"))
