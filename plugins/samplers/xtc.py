"""XTC, "exclude top choices" (llama.cpp's): with probability `xtc_probability`, drop every token at least
`xtc_threshold` likely except the least likely of them, so the model takes a less obvious path.

    options = {"xtc_probability": 0.5, "xtc_threshold": 0.1}

Ordered after min_p (order 55), on the distribution that is drawn from (corral's temperature comes before the
probability filters). Nothing happens when fewer than two tokens reach the threshold (so a threshold above 0.5
never acts, as in llama.cpp), nor on a greedy row. The coin is one uniform number per token from the sequence's
own generator, so seeded runs repeat and do not depend on the batch.
"""

from __future__ import annotations

import torch

from corral.hookspecs import hookimpl
from corral.options import Check, Options
from corral.sample import BatchParams


@hookimpl
def register_samplers(register):
    register(Xtc.name, Xtc)


class Xtc:
    """Remove the top choices above the threshold but the last, on the rows whose coin comes up."""

    name = "xtc"
    order = 55
    by_value = True
    options = {"xtc_probability": (float, 0.0, Check(0.0, 1.0)), "xtc_threshold": (float, 0.1, Check(0.0, 1.0))}

    @classmethod
    def active(cls, options: Options) -> bool:
        return options.temperature > 0 and options.get("xtc_probability") > 0 and not options.mirostat

    def apply(self, logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
        coins = torch.tensor([seq.uniform(self.name) for seq in params.seqs], dtype=torch.float32, device=logits.device)
        acts = coins <= params.tensor("xtc_probability")  # llama.cpp: skipped when chance > probability
        probs = torch.softmax(logits, dim=-1)
        above = probs >= params.tensor("xtc_threshold")[:, None]
        # The least likely token above the threshold stays; the rest above it go, when there are two or more.
        last = torch.where(above, probs, torch.inf).argmin(dim=-1, keepdim=True)
        drop = above.scatter(1, last, False) & (acts & (above.sum(dim=-1) >= 2))[:, None]
        return logits.masked_fill(drop, float("-inf"))
