"""Mirostat 1 and 2 (llama.cpp's algorithms): truncate the distribution so the surprise of the drawn tokens
tracks a target `mirostat_tau` (bits), adjusting a per-sequence threshold mu by `mirostat_eta` after each draw.

    options = {"mirostat": 2, "mirostat_tau": 5.0, "mirostat_eta": 0.1}

Ordered last (60), after temperature; as in llama.cpp, with mirostat on the other truncating steps (top_k,
typical_p, top_p, min_p, xtc) are off. Penalties, DRY and logit_bias still shape the logits before it (llama.cpp
before its 2024 sampler rewrite, which Ollama's runner used, applied penalties under mirostat too). mu starts at
2 * tau and lives in the sequence's sampler state; the chain reports every drawn token through `observe`.

* version 1: estimate the Zipf exponent s from the 100 most likely tokens, then keep the top
  k = ((s - 1) * 2^mu / (1 - V^(1 - s)))^(1 / s) tokens (V: the vocabulary);
* version 2: keep the tokens whose surprise -log2 p is at most mu (at least the most likely one).
"""

from __future__ import annotations

import math

import torch

from corral.hookspecs import hookimpl
from corral.options import Options
from corral.sample import BatchParams, scatter_candidates

ZIPF_TOKENS = 100  # llama.cpp's m: the most likely tokens version 1 estimates the exponent from
STATE = "mirostat.mu"


@hookimpl
def register_samplers(register):
    register(Mirostat.name, Mirostat)


def mu(params: BatchParams, device: torch.device) -> torch.Tensor:
    """Each row's current mu: float64 [b] (2 * tau before its first token)."""
    return torch.tensor([seq.state.get(STATE, 2.0 * seq.options.mirostat_tau) for seq in params.seqs], dtype=torch.float64, device=device)


class Mirostat:
    """Truncate each row by its version's rule and mu; after the draw, move mu towards tau."""

    name = "mirostat"
    order = 60
    by_value = True  # reads and masks by value only: it may run on top-k's candidates
    options: dict = {}  # mirostat, mirostat_tau and mirostat_eta are standard options (Modelfile PARAMETERs)

    @classmethod
    def active(cls, options: Options) -> bool:
        return options.temperature > 0 and options.mirostat in (1, 2)

    def apply(self, logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
        version = params.tensor("mirostat")
        rows_v1 = (version == 1).nonzero()[:, 0]
        rows_v2 = (version == 2).nonzero()[:, 0]
        current = mu(params, logits.device)
        if len(rows_v1):
            logits[rows_v1] = truncate_v1(logits[rows_v1], current[rows_v1])
        if len(rows_v2):
            logits[rows_v2] = truncate_v2(logits[rows_v2], current[rows_v2])
        return logits

    def observe(self, final: torch.Tensor, ids: torch.Tensor | None, tokens: torch.Tensor, params: BatchParams) -> None:
        """mu -= eta * (surprise of the drawn token under the final distribution - tau)."""
        columns = tokens[:, None] if ids is None else (ids == tokens[:, None]).int().argmax(dim=-1, keepdim=True)
        logp = torch.log_softmax(final.double(), dim=-1).gather(1, columns)[:, 0]
        surprise = (-logp / math.log(2)).tolist()
        for seq, observed, before in zip(params.seqs, surprise, mu(params, final.device).tolist()):
            seq.state[STATE] = before - seq.options.mirostat_eta * (observed - seq.options.mirostat_tau)


def truncate_v1(logits: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Mirostat 1: keep each row's top k, k from the Zipf exponent of its most likely tokens and mu."""
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(values.double(), dim=-1)
    valid = int(min(ZIPF_TOKENS, probs.shape[1]))
    i = torch.arange(valid - 1, dtype=torch.float64, device=logits.device)
    t = torch.log((i + 2) / (i + 1))
    # Pairs of tokens both unmasked: llama.cpp walks the candidates it has, masked ones are not among them.
    pair = probs[:, 1:valid] > 0
    b = torch.log(probs[:, : valid - 1] / probs[:, 1:valid].clamp_min(1e-300))
    s_hat = (torch.where(pair, t * b, 0).sum(-1)) / torch.where(pair, t * t, 0).sum(-1)
    epsilon = s_hat - 1
    vocab = float(logits.shape[1])
    k = torch.pow(epsilon * torch.pow(2.0, mu) / (1 - torch.pow(vocab, -epsilon)), 1 / s_hat)
    k = torch.nan_to_num(k, nan=1.0, posinf=vocab).clamp(1, vocab).floor()
    keep = torch.arange(values.shape[1], device=logits.device)[None, :] < k[:, None]
    return scatter_candidates(logits, ids, values, keep)


def truncate_v2(logits: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Mirostat 2: keep the tokens whose surprise (bits) is at most mu, and the most likely one in any case."""
    surprise = -torch.log_softmax(logits.double(), dim=-1) / math.log(2)
    keep = surprise <= mu[:, None]
    keep.scatter_(1, logits.argmax(dim=-1, keepdim=True), True)
    return logits.masked_fill(~keep, float("-inf"))
