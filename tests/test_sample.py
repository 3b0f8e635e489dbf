"""The sampler chain and request options: literal logits in, exact tokens and probabilities out."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from corral.hookspecs import hookimpl
from corral.options import InvalidOptionError, Options, parse_options
from corral.plugins.samplers import standard
from corral.registry import ALLOW_ENV, Plugins
from corral.sample import SamplerChain, SequenceSampler, row_argmax

# Every filter off, temperature 1: the chain is a plain softmax unless a test turns something on.
NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0}
STANDARD_ORDER = ["penalties", "top_k", "temperature", "typical_p", "top_p", "min_p"]


def standard_plugins() -> Plugins:
    plugins = Plugins(entry_points=False)
    plugins.register(standard, name="standard_samplers")
    return plugins


@pytest.fixture(scope="module")
def chain() -> SamplerChain:
    return SamplerChain(standard_plugins())


def seq(history=(), extra_fields=None, **options) -> SequenceSampler:
    return SequenceSampler(parse_options({**NEUTRAL, **options}, extra_fields), prompt=history)


def ln(*probs: float) -> list[float]:
    return [math.log(p) if p > 0 else float("-inf") for p in probs]


def distribution(chain: SamplerChain, logits: list[float], history=(), **options) -> list[float]:
    return chain.probabilities(torch.tensor([logits]), [seq(history, **options)])[0].tolist()


# -- the chain -------------------------------------------------------------------------------------


def test_standard_steps_run_in_the_documented_order(chain):
    assert [name for name, _ in chain.steps] == STANDARD_ORDER


def test_standard_samplers_are_registered_through_the_entry_point(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    names = [name for name, _ in SamplerChain(Plugins()).steps]
    assert [name for name in names if name in STANDARD_ORDER] == STANDARD_ORDER


@pytest.mark.parametrize("options", [{"temperature": 0}, {"temperature": 0, "repeat_penalty": 1.5}, {"temperature": 0.7, "top_k": 2}])
def test_the_chain_never_changes_or_hands_back_the_callers_logits(chain, options):
    # With no step active (greedy, no penalty) the logits are read in place: the caller's stay as they
    # were, and process() still returns a tensor of its own.
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.5], [3.0, 0.0, 1.0, -2.0]])
    before = logits.clone()
    seqs = [seq((3,), **options), seq((2,), **options)]
    result = chain.sample(logits, seqs)
    processed = chain.process(logits, seqs)
    assert torch.equal(logits, before) and processed.data_ptr() != logits.data_ptr()
    if options["temperature"] == 0:  # penalised, 2.5 / 1.5 falls below 2.0
        assert result.tokens == ([1, 0] if "repeat_penalty" in options else [3, 0])


@pytest.mark.parametrize(
    ("logits", "options", "expected"),
    [
        pytest.param(ln(0.5, 0.25, 0.125, 0.125), {}, [0.5, 0.25, 0.125, 0.125], id="neutral-is-softmax"),
        pytest.param([1.0, 3.0, 2.0], {"temperature": 0.0}, [0.0, 1.0, 0.0], id="greedy"),
        pytest.param([1.0, 3.0, 2.0], {"top_k": 1}, [0.0, 1.0, 0.0], id="top_k=1"),
        pytest.param(
            [1.0, 2.0, 3.0, 0.5], {"top_k": 2, "temperature": 0.5}, [0.0, 0.11920292, 0.88079708, 0.0], id="top_k=2-t=0.5"
        ),
        pytest.param([0.0, 0.0], {"top_k": 10}, [0.5, 0.5], id="top_k-beyond-vocab"),
        pytest.param([0.0, math.log(2.0)], {"temperature": 2.0}, [1 / (1 + 2**0.5), 2**0.5 / (1 + 2**0.5)], id="t=2"),
        pytest.param(ln(0.5, 0.3, 0.2), {"top_p": 0.49}, [1.0, 0.0, 0.0], id="top_p=0.49"),
        pytest.param(ln(0.5, 0.3, 0.2), {"top_p": 0.51}, [0.625, 0.375, 0.0], id="top_p=0.51"),
        pytest.param(ln(0.5, 0.3, 0.2), {"top_p": 0.79}, [0.625, 0.375, 0.0], id="top_p=0.79"),
        pytest.param(ln(0.5, 0.3, 0.2), {"top_p": 0.81}, [0.5, 0.3, 0.2], id="top_p=0.81"),
        pytest.param(ln(0.5, 0.3, 0.2), {"top_p": 0.0}, [1.0, 0.0, 0.0], id="top_p=0"),
        pytest.param(ln(0.5, 0.25, 0.2, 0.05), {"min_p": 0.45}, [2 / 3, 1 / 3, 0.0, 0.0], id="min_p=0.45"),
        pytest.param(ln(0.5, 0.25, 0.2, 0.05), {"min_p": 0.05}, [0.5, 0.25, 0.2, 0.05], id="min_p=0.05"),
        pytest.param([0.0, 0.0, -1.0], {"min_p": 1.0}, [0.5, 0.5, 0.0], id="min_p-keeps-equal-to-floor"),
        # Surprises -ln p: 0.916, 1.050, 1.386 around entropy 1.081, so typicality ranks tokens 1, 0, 2.
        pytest.param(ln(0.4, 0.35, 0.25), {"typical_p": 0.3}, [0.0, 1.0, 0.0], id="typical_p=0.3-drops-the-top"),
        pytest.param(ln(0.4, 0.35, 0.25), {"typical_p": 0.5}, [0.53333333, 0.46666667, 0.0], id="typical_p=0.5"),
        pytest.param(ln(0.4, 0.35, 0.25), {"typical_p": 0.8}, [0.4, 0.35, 0.25], id="typical_p=0.8"),
        pytest.param(
            ln(0.5, 0.2, 0.2, 0.1), {"top_k": 3, "temperature": 1.0, "top_p": 0.7}, [5 / 7, 2 / 7, 0.0, 0.0], id="k-then-p"
        ),
    ],
)
def test_the_chain_draws_from_the_hand_computed_distribution(chain, logits, options, expected):
    assert distribution(chain, logits, **options) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(("top_p", "kept"), [(0.25, 1), (0.5, 2), (0.5001, 3), (0.75, 3), (0.76, 4)])
def test_top_p_keeps_the_token_whose_cumulative_mass_reaches_p(chain, top_p, kept):
    # Four equal logits give probabilities of exactly 0.25, so the cut-off boundaries are exact.
    probs = distribution(chain, [0.0] * 4, top_p=top_p)
    assert sorted(probs, reverse=True) == pytest.approx([1 / kept] * kept + [0.0] * (4 - kept), abs=1e-7)


def test_rows_with_different_filters_in_one_batch_match_each_row_alone(chain):
    logits = torch.tensor([ln(0.4, 0.3, 0.2, 0.1), ln(0.1, 0.2, 0.3, 0.4), [1.0, 2.0, 3.0, 4.0]])
    rows = [{"top_k": 2}, {"top_p": 0.5}, {"temperature": 0.0, "repeat_penalty": 2.0}]
    together = chain.probabilities(logits, [seq([3], **row) for row in rows])
    for i, row in enumerate(rows):
        alone = chain.probabilities(logits[i : i + 1], [seq([3], **row)])
        assert together[i].tolist() == pytest.approx(alone[0].tolist(), abs=1e-7)
    assert together[2].tolist() == [0.0, 0.0, 1.0, 0.0]  # greedy after the repeat penalty on token 3


# -- penalties ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("history", "options", "expected"),
    [
        pytest.param([0, 1], {"repeat_penalty": 2.0}, [1.0, -2.0, 0.5, 1.0], id="repeat-divides-positive-multiplies-negative"),
        pytest.param([0, 0, 1], {"presence_penalty": 0.5}, [1.5, -1.5, 0.5, 1.0], id="presence-once"),
        pytest.param([0, 0, 1], {"frequency_penalty": 0.5}, [1.0, -1.5, 0.5, 1.0], id="frequency-per-count"),
        pytest.param(
            [0, 0, 1], {"repeat_penalty": 2.0, "repeat_last_n": 1}, [2.0, -2.0, 0.5, 1.0], id="window-of-the-last-token"
        ),
        pytest.param([0, 0, 1], {"repeat_penalty": 2.0, "repeat_last_n": 0}, [2.0, -1.0, 0.5, 1.0], id="window-0-disables"),
    ],
)
def test_penalties_apply_to_the_tokens_in_the_window(chain, history, options, expected):
    out = chain.process(torch.tensor([[2.0, -1.0, 0.5, 1.0]]), [seq(history, temperature=0.0, **options)])
    assert out[0].tolist() == pytest.approx(expected)


def test_greedy_takes_the_argmax_after_penalties_of_accepted_tokens(chain):
    sampler = seq(temperature=0.0, repeat_penalty=2.0)
    logits = torch.tensor([[2.0, 1.5]])
    assert chain.sample(logits, [sampler]).tokens == [0]
    sampler.accept(0)
    assert chain.sample(logits, [sampler]).tokens == [1]


def test_repeat_last_n_minus_one_keeps_the_whole_context():
    sampler = SequenceSampler(parse_options({"repeat_last_n": -1}), prompt=range(10), num_ctx=8)
    assert list(sampler.history) == list(range(2, 10))


# -- seeds ---------------------------------------------------------------------------------------


def run_draws(chain: SamplerChain, logits: torch.Tensor, seqs: list[SequenceSampler], steps: int = 50) -> list[list[int]]:
    drawn: list[list[int]] = [[] for _ in seqs]
    for _ in range(steps):
        for row, (sampler, token) in enumerate(zip(seqs, chain.sample(logits, seqs).tokens)):
            sampler.accept(token)
            drawn[row].append(token)
    return drawn


SEEDED = {"seed": 1234, "temperature": 1.5, "top_k": 40, "top_p": 0.95, "repeat_penalty": 1.3}


def test_a_seed_repeats_its_draws_and_another_seed_does_not(chain):
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    first = run_draws(chain, logits, [seq(**SEEDED)])[0]
    assert run_draws(chain, logits, [seq(**SEEDED)])[0] == first
    assert run_draws(chain, logits, [seq(**{**SEEDED, "seed": 4321})])[0] != first


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch(chain):
    logits = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    alone = run_draws(chain, logits[:1], [seq(**SEEDED)])[0]
    # Unfiltered rows make the draw walk whole rows; alone, the seeded row's 40 candidates are walked.
    others = [{"top_p": 0.5}, {"temperature": 0.0}, {"seed": 7, "min_p": 0.1, "typical_p": 0.9}, {}]
    batch = run_draws(chain, logits, [seq(**SEEDED)] + [seq(**row) for row in others])
    assert batch[0] == alone


FILTERED = [{"top_k": 40, "top_p": 0.9, "temperature": 0.8}, {"top_k": 25, "typical_p": 0.7}, {"top_k": 60, "min_p": 0.05}]


def whole_vocabulary(chain: SamplerChain, monkeypatch) -> SamplerChain:
    """`chain` with its candidates path turned off: every step over [b, V]."""
    monkeypatch.setattr(chain, "_narrows", lambda *_: False)
    return chain


@pytest.mark.slow  # every sampler over a 262k vocabulary
def test_after_top_k_the_chain_runs_on_candidates_with_the_same_results(monkeypatch):
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(3)) * 3
    logits[:, 100:110] = logits[:, 99:100]  # ties at the top
    seqs = lambda: [seq(seed=row, **options) for row, options in enumerate(FILTERED)]  # noqa: E731
    fast = SamplerChain(standard_plugins())
    assert fast._candidates(logits, seqs())[1] is not None  # narrowed to candidates
    slow = whole_vocabulary(SamplerChain(standard_plugins()), monkeypatch)
    assert torch.equal(fast.process(logits, seqs()), slow.process(logits, seqs()))
    assert run_draws(fast, logits, seqs(), steps=200) == run_draws(slow, logits, seqs(), steps=200)


def test_a_seeded_row_on_candidates_draws_as_in_a_batch_that_walks_whole_rows(chain):
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(4))
    alone = run_draws(chain, logits[:1], [seq(**SEEDED)])[0]  # narrowed to 40 candidates
    batch = run_draws(chain, logits, [seq(**SEEDED), seq(temperature=0.0), seq(top_p=0.5)])  # not narrowed
    assert batch[0] == alone


def test_a_step_that_reads_token_ids_after_top_k_keeps_the_whole_vocabulary():
    class BanAfterTopK(BanToken):
        order = 25

    class Plugin:
        @hookimpl
        def register_samplers(self, register):
            register("ban_after", BanAfterTopK)

    plugins = standard_plugins()
    plugins.register(Plugin(), name="ban_after")
    chain = SamplerChain(plugins)
    fields = chain.extra_options
    logits = torch.randn(1, 4096, generator=torch.Generator().manual_seed(5))
    best = int(logits.argmax())
    seqs = [seq(extra_fields=fields, top_k=40, ban_token=best, seed=1)]
    assert chain._candidates(logits, seqs)[1] is None
    assert best not in run_draws(chain, logits, seqs, steps=20)[0]
    assert chain._candidates(logits, [seq(extra_fields=fields, top_k=40)])[1] is not None  # inactive: narrowed


@pytest.mark.parametrize(
    ("logits", "options", "expected"),
    [
        pytest.param(ln(0.5, 0.3, 0.2), {}, [0.5, 0.3, 0.2], id="whole-row"),
        pytest.param(ln(0.4, 0.3, 0.2, 0.1, 0.0), {"top_k": 2}, [4 / 7, 3 / 7, 0.0, 0.0, 0.0], id="candidates"),
    ],
)
def test_draws_follow_the_distribution(chain, logits, options, expected):
    seqs = [seq(seed=i, **options) for i in range(4000)]
    tokens = torch.tensor(chain.sample(torch.tensor([logits] * 4000), seqs).tokens)
    frequencies = torch.bincount(tokens, minlength=len(logits)) / 4000
    assert frequencies.tolist() == pytest.approx(expected, abs=0.03)


@pytest.mark.parametrize("vocab", [300, 4096, 262144])
def test_row_argmax_is_torchs_argmax_first_of_ties_included(vocab):
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(6))
    x[1, vocab // 3], x[1, vocab // 2] = 50.0, 50.0  # a tie across blocks: the first wins
    x[2, 7], x[2, 9] = 60.0, 60.0  # a tie inside a block
    x[3] = 0.0  # all tied
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_without_logprobs_the_same_tokens_come_without_them(chain):
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(7))
    rows = lambda: [seq(temperature=0.0), seq(seed=3, top_k=40), seq(seed=4)]  # noqa: E731
    full, bare = chain.sample(logits, rows()), chain.sample(logits, rows(), logprobs=False)
    assert bare.tokens == full.tokens and all(math.isnan(value) for value in bare.logprobs)
    assert chain.sample(logits, rows(), top_logprobs=[0, 2, 0], logprobs=False).logprobs == full.logprobs


# -- logprobs --------------------------------------------------------------------------------------


def test_logprob_is_the_log_softmax_of_the_raw_logits(chain):
    result = chain.sample(torch.tensor([[1.0, 2.0, 3.0]]), [seq(temperature=0.5, top_k=1)])
    assert result.tokens == [2]
    assert result.logprobs == pytest.approx([3.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3))])


def test_top_logprobs_gives_each_row_its_own_count_of_alternatives(chain):
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(1))
    result = chain.sample(logits, [seq(temperature=0.0) for _ in range(3)], top_logprobs=[0, 2, 20])
    assert [len(row) for row in result.top_logprobs] == [0, 2, 20]
    values, ids = torch.log_softmax(logits[2], dim=-1).topk(20)
    assert [token for token, _ in result.top_logprobs[2]] == ids.tolist()
    assert [logprob for _, logprob in result.top_logprobs[2]] == pytest.approx(values.tolist())
    assert result.top_logprobs[1] == result.top_logprobs[1][:2] and result.top_logprobs[1][0][0] == result.tokens[1]


def test_top_logprobs_beyond_twenty_is_an_invalid_option(chain):
    with pytest.raises(InvalidOptionError, match="top_logprobs"):
        chain.sample(torch.zeros(1, 30), [seq()], top_logprobs=[21])


# -- options ---------------------------------------------------------------------------------------


def test_defaults_are_ollamas():
    opts = parse_options(None)
    assert (opts.num_ctx, opts.num_batch, opts.num_gpu, opts.num_thread, opts.num_keep, opts.num_predict) == (
        None, 512, -1, 0, 4, -1,
    )
    assert (opts.temperature, opts.top_k, opts.top_p, opts.min_p, opts.typical_p) == (0.8, 40, 0.9, 0.0, 1.0)
    assert (opts.repeat_last_n, opts.repeat_penalty, opts.presence_penalty, opts.frequency_penalty) == (64, 1.0, 0.0, 0.0)
    assert (opts.seed, opts.stop, opts.extra) == (-1, (), {})


@pytest.mark.parametrize(
    ("raw", "field", "expected"),
    [
        ({"temperature": 1}, "temperature", 1.0),
        ({"top_k": 40.0}, "top_k", 40),
        ({"stop": "\n"}, "stop", ("\n",)),
        ({"stop": ["a", "b"]}, "stop", ("a", "b")),
        ({"seed": None}, "seed", -1),
        ({"num_ctx": 8192}, "num_ctx", 8192),
    ],
)
def test_valid_options_are_normalised(raw, field, expected):
    value = getattr(parse_options(raw), field)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"temperature": "hot"}, "option 'temperature' must be a number, got str 'hot'"),
        ({"top_k": True}, "option 'top_k' must be an integer, got bool True"),
        ({"top_k": -1}, "option 'top_k' must be >= 0, got -1"),
        ({"top_p": 1.5}, "option 'top_p' must be >= 0.0 and <= 1.0, got 1.5"),
        ({"temperature": -0.1}, "option 'temperature' must be >= 0.0, got -0.1"),
        ({"repeat_last_n": -2}, "option 'repeat_last_n' must be >= -1, got -2"),
        ({"repeat_penalty": 0}, "option 'repeat_penalty' must be > 0.0, got 0"),
        ({"seed": 1.5}, "option 'seed' must be an integer, got float 1.5"),
        ({"stop": ["a", 1]}, "option 'stop' must be a string or a list of strings, got list ['a', 1]"),
        ({"temperature": float("nan")}, "option 'temperature' must be a number, got float nan"),
    ],
)
def test_invalid_options_raise_naming_option_type_and_value(raw, message):
    with pytest.raises(InvalidOptionError) as raised:
        parse_options(raw)
    assert str(raised.value) == message


def test_options_that_are_not_an_object_raise():
    with pytest.raises(InvalidOptionError, match="options must be an object"):
        parse_options(["temperature", 0])


def test_an_unknown_option_is_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="corral.options"):
        opts = parse_options({"tfs_z": 0.95, "temperature": 0.1})
    assert opts == Options(temperature=0.1)
    assert "tfs_z" in caplog.text


# -- third-party samplers ------------------------------------------------------------------------


class BanToken:
    """A third-party step with its own option; records the rows it was applied to."""

    order = 15
    options = {"ban_token": (int, -1)}
    batch_sizes: list[int] = []

    @classmethod
    def active(cls, options: Options) -> bool:
        return options.get("ban_token", -1) >= 0

    def apply(self, logits, params):
        self.batch_sizes.append(logits.shape[0])
        return logits.scatter(1, params.tensor("ban_token")[:, None], float("-inf"))


class BanTokenPlugin:
    @hookimpl
    def register_samplers(self, register):
        register("ban_token", BanToken)


@pytest.fixture
def chain_with_ban() -> SamplerChain:
    plugins = standard_plugins()
    plugins.register(BanTokenPlugin(), name="ban")
    BanToken.batch_sizes.clear()
    return SamplerChain(plugins)


def test_a_third_party_sampler_takes_its_place_in_the_chain(chain_with_ban):
    assert [name for name, _ in chain_with_ban.steps] == ["penalties", "ban_token", *STANDARD_ORDER[1:]]


def test_a_third_party_sampler_option_is_parsed_into_extra(chain_with_ban):
    assert parse_options({"ban_token": 3}, chain_with_ban.extra_options).extra == {"ban_token": 3}
    assert parse_options({}, chain_with_ban.extra_options).extra == {"ban_token": -1}
    with pytest.raises(InvalidOptionError, match="option 'ban_token' must be an integer"):
        parse_options({"ban_token": "3"}, chain_with_ban.extra_options)


def test_a_third_party_sampler_runs_before_top_k_and_only_on_its_rows(chain_with_ban):
    logits = torch.tensor([[1.0, 3.0, 2.0]] * 3)
    fields = chain_with_ban.extra_options
    seqs = [
        seq(extra_fields=fields, top_k=1, ban_token=1),
        seq(extra_fields=fields, temperature=0.0, ban_token=1),
        seq(extra_fields=fields, top_k=1),
    ]
    # Banned before top_k=1, the second best is the one left; greedy rows respect the ban too.
    assert chain_with_ban.sample(logits, seqs).tokens == [2, 2, 1]
    assert BanToken.batch_sizes == [2]
