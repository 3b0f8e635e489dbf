"""The samplers beyond Ollama's standard chain: logit_bias, DRY, XTC, mirostat 1 and 2, and the grammar fast path.

Each is checked against a direct computation written plainly here (or llama.cpp's own test data), and seeded
rows must draw the same tokens alone and in a batch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from corral.grammar import GrammarMatcher, compile_format, mask_logits
from corral.options import InvalidOptionError, parse_options, parse_option_text
from corral.plugins.samplers import dry, grammar, mirostat, standard, xtc
from corral.plugins.samplers import logit_bias as logit_bias_plugin
from corral.registry import Plugins
from corral.sample import SamplerChain, SequenceSampler
from corral.tokenizer import load_tokenizer

NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0}


@pytest.fixture(scope="module")
def chain() -> SamplerChain:
    plugins = Plugins(entry_points=False)
    for module in (standard, grammar, logit_bias_plugin, dry, xtc, mirostat):
        plugins.register(module, name=module.__name__)
    return SamplerChain(plugins)


def start(chain: SamplerChain, history=(), num_ctx: int = 4096, tokenizer=None, grammar=None, **options) -> SequenceSampler:
    return chain.start(parse_options({**NEUTRAL, **options}, chain.extra_options), list(history), num_ctx, grammar, tokenizer)


def probs_after(chain, probs: list[float], seq: SequenceSampler) -> list[float]:
    logits = torch.tensor([[math.log(p) for p in probs]])
    return chain.probabilities(logits, [seq])[0].tolist()


def run_draws(chain, logits: torch.Tensor, seqs: list[SequenceSampler], steps: int = 40) -> list[list[int]]:
    drawn: list[list[int]] = [[] for _ in seqs]
    for _ in range(steps):
        for row, (seq, token) in enumerate(zip(seqs, chain.sample(logits, seqs).tokens)):
            seq.accept(token)
            drawn[row].append(token)
    return drawn


def test_the_steps_take_their_documented_places(chain):
    names = [name for name, _ in chain.steps]
    assert names == ["grammar", "logit_bias", "penalties", "dry", "top_k", "temperature", "typical_p", "top_p", "min_p", "xtc", "mirostat"]


# -- options ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"mirostat": 3}, "option 'mirostat' must be >= 0 and <= 2, got 3"),
        ({"mirostat_tau": -1}, "option 'mirostat_tau' must be >= 0.0, got -1"),
        ({"mirostat_eta": "fast"}, "option 'mirostat_eta' must be a number"),
        ({"dry_base": 0.5}, "option 'dry_base' must be >= 1.0, got 0.5"),
        ({"dry_allowed_length": 1.5}, "option 'dry_allowed_length' must be an integer"),
        ({"dry_penalty_last_n": -2}, "option 'dry_penalty_last_n' must be >= -1, got -2"),
        ({"dry_sequence_breakers": [1]}, "option 'dry_sequence_breakers' must be a string or a list of strings"),
        ({"xtc_probability": 1.5}, "option 'xtc_probability' must be >= 0.0 and <= 1.0, got 1.5"),
        ({"xtc_threshold": -0.1}, "option 'xtc_threshold' must be >= 0.0 and <= 1.0"),
        ({"logit_bias": {"12": 101}}, "option 'logit_bias' must be an object mapping token ids to biases from -100 to 100"),
        ({"logit_bias": {"twelve": 1}}, "option 'logit_bias' must be an object mapping token ids"),
        ({"logit_bias": {"-1": 1}}, "option 'logit_bias' must be an object mapping token ids"),
        ({"logit_bias": [1, 2]}, "option 'logit_bias' must be an object mapping token ids"),
    ],
)
def test_wrong_sampler_options_are_refused_naming_the_option(chain, raw, says):
    with pytest.raises(InvalidOptionError, match="^" + says.replace("(", r"\(").replace("[", r"\[")):
        parse_options(raw, chain.extra_options)


def test_logit_bias_takes_openais_object_and_llama_cpps_pairs(chain):
    assert parse_options({"logit_bias": {"7": -100, 3: 2.5}}, chain.extra_options).get("logit_bias") == ((3, 2.5), (7, -100.0))
    assert parse_options({"logit_bias": [[7, 1], [3, -1]]}, chain.extra_options).get("logit_bias") == ((3, -1.0), (7, 1.0))


def test_mirostat_is_a_modelfile_parameter():
    assert parse_option_text("mirostat", "2") == 2
    assert parse_option_text("mirostat_tau", "3.5") == 3.5
    assert parse_option_text("mirostat_eta", "0.2") == 0.2
    with pytest.raises(InvalidOptionError, match="'mirostat' must be >= 0 and <= 2"):
        parse_option_text("mirostat", "4")


# -- logit_bias ------------------------------------------------------------------------------------


def test_logit_bias_adds_each_rows_biases_to_its_logits(chain):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    rows = [{"logit_bias": {"3": 5.0, "40": -100}}, {}, {"logit_bias": {"3": -2.5}}]
    seqs = [start(chain, **row) for row in rows]
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 40] -= 100
    expected[2, 3] -= 2.5
    assert torch.allclose(chain.process(logits, seqs), expected)


def test_logit_bias_moves_a_greedy_row(chain):
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert chain.sample(logits, [start(chain, temperature=0, logit_bias={"1": -100})]).tokens == [2]


def test_logit_bias_outside_the_vocabulary_is_refused_when_the_sequence_starts(chain):
    class Vocab:
        vocab_size = 10

    with pytest.raises(InvalidOptionError, match="outside the vocabulary of 10 tokens: \\[12\\]"):
        start(chain, tokenizer=Vocab(), logit_bias={"12": 1})


# -- DRY -------------------------------------------------------------------------------------------


# llama.cpp's tests/test-sampling.cpp: probabilities, context, expected probabilities, multiplier, base,
# allowed length, last n, token breakers.
LLAMA_CPP_DRY = [
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, []),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, [[3]]),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, []),
]


@pytest.mark.parametrize(("probs", "context", "expected", "multiplier", "base", "allowed", "last_n", "breakers"), LLAMA_CPP_DRY)
def test_dry_matches_llama_cpps_test_data(chain, probs, context, expected, multiplier, base, allowed, last_n, breakers):
    seq = start(chain, context, dry_multiplier=multiplier, dry_base=base, dry_allowed_length=allowed, dry_penalty_last_n=last_n)
    seq.state[dry.STATE] = dry.Breakers.of_tokens(breakers)
    assert probs_after(chain, probs, seq) == pytest.approx(expected, abs=1e-5)


def dry_reference(logits: np.ndarray, context: list[int], multiplier, base, allowed, last_n, breakers: dry.Breakers) -> np.ndarray:
    """llama.cpp's DRY, computed the slow way: every earlier position's common suffix with the context."""
    window = context[-last_n:] if last_n > 0 else list(context)
    n = len(window)
    out = logits.copy()
    if n <= allowed:
        return out
    limit = n
    for distance in range(n):  # the nearest breaker from the end
        head = window[n - 1 - distance]
        tails = breakers.tails.get(head, ())
        matches = [len(t) for t in tails if len(t) <= distance and tuple(window[n - distance : n - distance + len(t)]) == t]
        if matches:
            limit = distance - max(matches)
            break
    if limit < allowed:
        return out
    longest: dict[int, int] = {}
    for j in range(n - 1):
        length = 0
        while length <= j and window[j - length] == window[n - 1 - length]:
            length += 1
        length = min(length, limit)
        if length >= allowed:
            follower = window[j + 1]
            longest[follower] = max(longest.get(follower, 0), length)
    cap = int(88.7228391 / math.log(base)) if base > 1.000001 else None
    for token, length in longest.items():
        if token not in breakers.single:
            exponent = length - allowed if cap is None else min(length - allowed, cap)
            out[token] -= multiplier * base**exponent
    return out


def test_dry_matches_the_direct_computation_on_repetitive_contexts(chain):
    rng = np.random.default_rng(5)
    breakers = dry.Breakers.of_tokens([[7], [8, 9]])
    for trial in range(30):
        phrase = list(rng.integers(0, 12, size=rng.integers(2, 6)))
        noise = list(rng.integers(0, 12, size=5)), list(rng.integers(0, 12, size=3))
        context = [int(t) for t in noise[0] + phrase * int(rng.integers(1, 4)) + noise[1] + phrase]
        options = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": int(rng.integers(0, 4)),
                   "dry_penalty_last_n": int(rng.choice([-1, 8, 20]))}  # fmt: skip
        logits = rng.normal(size=(1, 16)).astype(np.float32)
        seq = start(chain, context, **options)
        seq.state[dry.STATE] = breakers
        got = chain.process(torch.from_numpy(logits), [seq])[0].numpy()
        want = dry_reference(logits[0], context, 0.8, 1.75, options["dry_allowed_length"], options["dry_penalty_last_n"], breakers)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"trial {trial}: {context} {options}")


def test_dry_breakers_come_from_the_vocabulary_as_llama_cpp_finds_them(smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    found = dry.breakers_for(tokenizer, ("\n", ":"))
    newline = tokenizer.encode("\n", add_special=False, parse_special=False)
    assert len(newline) == 1 and newline[0] in found.single
    # A token holding a breaker anywhere inside it is a whole breaker; one that merely ends before it is not.
    assert all(b"\n" in tokenizer.token_bytes(t) or b":" in tokenizer.token_bytes(t) for t in found.single)
    hello = tokenizer.encode("Hello", add_special=False, parse_special=False)
    assert hello[0] not in found.tails
    assert dry.breakers_for(tokenizer, ("\n", ":")) is found  # scanned once per tokenizer


def test_dry_is_active_for_greedy_rows_like_the_penalties(chain):
    # Context "5 6 7 5 6": a greedy row that would repeat 7 takes the runner-up.
    logits = torch.tensor([[0.0] * 7 + [2.0, 1.9]])
    seq = start(chain, [5, 6, 7, 5, 6], temperature=0, dry_multiplier=1.0, dry_allowed_length=2)
    assert chain.sample(logits, [seq]).tokens == [8]


# -- XTC -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [  # llama.cpp's tests/test-sampling.cpp, with the coin always up
        (0.09, [0, 0, 0, 1.0]),
        (0.19, [0, 0, 2 / 3, 1 / 3]),
        (0.29, [0, 0.5, 1 / 3, 1 / 6]),
        (0.39, [0.4, 0.3, 0.2, 0.1]),
    ],
)
def test_xtc_matches_llama_cpps_test_data(chain, threshold, expected):
    seq = start(chain, xtc_probability=1.0, xtc_threshold=threshold)
    assert probs_after(chain, [0.4, 0.3, 0.2, 0.1], seq) == pytest.approx(expected, abs=1e-6)


def test_xtc_acts_when_the_sequences_own_coin_is_at_most_its_probability(chain):
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    seq = start(chain, seed=11, xtc_probability=0.5, xtc_threshold=0.15)
    reference = torch.Generator().manual_seed(11)
    for _ in range(40):
        coin = torch.rand((), generator=reference, dtype=torch.float64).item()  # XTC's coin comes first
        u = torch.rand((), generator=reference, dtype=torch.float64).item()  # then the draw
        probs = [0.0, 0.0, 2 / 3, 1 / 3] if coin <= 0.5 else [0.4, 0.3, 0.2, 0.1]
        expected = int(np.searchsorted(np.cumsum(probs), u * sum(probs), side="right"))
        token = chain.sample(logits, [seq]).tokens[0]
        assert token == expected
        seq.accept(token)


# -- mirostat --------------------------------------------------------------------------------------


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), np.nonzero(probs)[0].max()))


def mirostat_reference(logits: np.ndarray, version: int, tau: float, eta: float, temperature: float, seed: int, steps: int) -> list[int]:
    """llama.cpp's mirostat samplers, step by step in numpy, drawing with the sequence's uniform numbers."""
    generator = torch.Generator().manual_seed(seed)
    mu, tokens = 2 * tau, []
    scaled = logits.astype(np.float64) / temperature
    for _ in range(steps):
        probs = softmax(scaled)
        order = np.argsort(-scaled, kind="stable")
        if version == 1:
            p = probs[order]
            t = [math.log((i + 2) / (i + 1)) for i in range(min(100, len(p)) - 1)]
            b = [math.log(p[i] / p[i + 1]) for i in range(len(t))]
            s = sum(ti * bi for ti, bi in zip(t, b)) / sum(ti * ti for ti in t)
            k = ((s - 1) * 2**mu / (1 - len(p) ** (1 - s))) ** (1 / s)
            keep = order[: max(int(k), 1)]
        else:
            keep = [i for i in range(len(probs)) if -math.log2(probs[i]) <= mu] or [int(order[0])]
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        kept /= kept.sum()
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        token = inverse_cdf(kept, u)
        mu -= eta * (-math.log2(kept[token]) - tau)
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(("tau", "eta", "temperature"), [(5.0, 0.1, 1.0), (3.0, 0.3, 0.7), (1.0, 1.0, 1.3)])
def test_mirostat_draws_as_the_direct_computation(chain, version, tau, eta, temperature):
    logits = (torch.randn(1, 300, generator=torch.Generator().manual_seed(version)) * 3).numpy()
    # top_k and top_p are set to show that mirostat replaces them, as in llama.cpp.
    seq = start(chain, seed=42, mirostat=version, mirostat_tau=tau, mirostat_eta=eta, temperature=temperature, top_k=5, top_p=0.5)
    got = run_draws(chain, torch.from_numpy(logits), [seq], steps=30)[0]
    assert got == mirostat_reference(logits[0], version, tau, eta, temperature, 42, 30)
    assert seq.state[mirostat.STATE] != 2 * tau  # mu moved


def test_mirostat_is_off_for_greedy_rows(chain):
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert chain.sample(logits, [start(chain, temperature=0, mirostat=2)]).tokens == [1]


# -- alone and batched -----------------------------------------------------------------------------


MIXED = [
    {"seed": 1, "mirostat": 1, "mirostat_tau": 4.0},
    {"seed": 2, "mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
    {"seed": 3, "xtc_probability": 0.7, "xtc_threshold": 0.05, "top_k": 40},
    {"seed": 4, "dry_multiplier": 0.8, "dry_allowed_length": 1, "top_p": 0.9},
    {"seed": 5, "logit_bias": {"0": 3.0, "5": -100}, "min_p": 0.05},
    {"temperature": 0, "dry_multiplier": 2.0, "logit_bias": {"9": 1.5}},
]


def test_seeded_rows_draw_the_same_tokens_alone_and_batched(chain):
    logits = torch.randn(len(MIXED), 64, generator=torch.Generator().manual_seed(9)) * 2
    history = [3, 4, 5, 3, 4]
    alone = [run_draws(chain, logits[row : row + 1], [start(chain, history, **options)])[0] for row, options in enumerate(MIXED)]
    batched = run_draws(chain, logits, [start(chain, history, **options) for options in MIXED])
    assert batched == alone
    assert all(len(set(tokens)) > 1 for tokens in alone[:5])  # real draws, not one token over and over


# -- the grammar fast path -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


def json_matcher(tokenizer) -> GrammarMatcher:
    return GrammarMatcher.start(tokenizer, compile_format("json"))


def count_masks(monkeypatch) -> list[int]:
    """The number of rows of every full-vocabulary mask the grammar step computes (the real one runs)."""
    rows: list[int] = []
    real = grammar.mask_logits

    def counted(logits, matchers):
        rows.append(len(matchers))
        return real(logits, matchers)

    monkeypatch.setattr(grammar, "mask_logits", counted)
    return rows


def test_an_allowed_draw_needs_no_mask(chain, smollm2_tokenizer, monkeypatch):
    masks = count_masks(monkeypatch)
    vocab = smollm2_tokenizer.vocab_size
    brace = smollm2_tokenizer.encode("{", add_special=False, parse_special=False)[0]
    logits = torch.zeros(1, vocab)
    logits[0, brace] = 20.0
    seq = start(chain, temperature=0, grammar=json_matcher(smollm2_tokenizer))
    assert chain.sample(logits, [seq]).tokens == [brace]
    assert masks == []


def test_a_rejected_draw_is_drawn_again_under_the_mask_for_its_row_only(chain, smollm2_tokenizer, monkeypatch):
    masks = count_masks(monkeypatch)
    vocab = smollm2_tokenizer.vocab_size
    word = smollm2_tokenizer.encode("Hello", add_special=False, parse_special=False)[0]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, word] = 30.0  # every row's draw is "Hello": not JSON
    seqs = [start(chain, temperature=0, grammar=json_matcher(smollm2_tokenizer)), start(chain, temperature=0),
            start(chain, seed=3, grammar=json_matcher(smollm2_tokenizer))]  # fmt: skip
    tokens = chain.sample(logits, seqs).tokens
    assert masks == [2]  # one mask, of the two constrained rows
    assert tokens[1] == word
    for row in (0, 2):
        assert tokens[row] != word and smollm2_tokenizer.token_bytes(tokens[row]).lstrip().startswith(b"{")
    # The greedy constrained row gets the argmax of the masked logits, as if the mask had come first.
    assert tokens[0] == int(mask_logits(logits[:1].clone(), [json_matcher(smollm2_tokenizer)]).argmax())


# -- corral bench --format -------------------------------------------------------------------------


def test_bench_format_compares_constrained_with_free_decoding(smollm2_path):
    import json

    from click.testing import CliRunner

    from corral.cli import main

    args = ["bench", "smollm2", "--format", "json", "--gen-tokens", "3", "--rounds", "1", "--concurrency", "2", "--json"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    figures = json.loads(result.output)
    assert figures["format"] == "json" and set(figures) >= {"batch_2"}
    batch = figures["batch_2"]
    assert batch["unconstrained_tok_s"] > 0 and batch["constrained_tok_s"] > 0
    assert batch["ratio"] == pytest.approx(batch["constrained_tok_s"] / batch["unconstrained_tok_s"])
