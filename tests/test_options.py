"""Option text: one reading of a value written as text, for Modelfile PARAMETER lines and `/set parameter`."""

import pytest

from corral.modelfile.syntax import Modelfile, ModelfileError
from corral.options import InvalidOptionError, parse_option_text

# Go's strconv.ParseBool, which Ollama reads boolean parameters with.
GO_TRUE = ["1", "t", "T", "TRUE", "true", "True"]
GO_FALSE = ["0", "f", "F", "FALSE", "false", "False"]


@pytest.mark.parametrize("text", GO_TRUE)
def test_booleans_read_true_as_go_spells_it(text):
    assert parse_option_text("ignore_eos", text) is True


@pytest.mark.parametrize("text", GO_FALSE)
def test_booleans_read_false_as_go_spells_it(text):
    assert parse_option_text("ignore_eos", text) is False


@pytest.mark.parametrize("text", ["yes", "no", "on", "tRuE", "2", "", " true"])
def test_other_boolean_spellings_are_refused(text):
    with pytest.raises(InvalidOptionError, match="parameter 'ignore_eos' must be true or false"):
        parse_option_text("ignore_eos", text)


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("top_k", "40", 40),
        ("seed", "-1", -1),
        ("seed", "+7", 7),
        ("temperature", "0.25", 0.25),
        ("temperature", "1", 1.0),
        ("top_p", "1e-1", 0.1),
        ("stop", "<|im_end|> and more", ["<|im_end|> and more"]),
    ],
)
def test_values_are_typed_as_their_option_wants(name, text, value):
    parsed = parse_option_text(name, text)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("top_k", "1.5", "parameter 'top_k' must be an integer, got '1.5'"),
        ("top_k", "1_000", "parameter 'top_k' must be an integer"),
        ("top_k", "٣", "parameter 'top_k' must be an integer"),
        ("temperature", "warm", "parameter 'temperature' must be a number, got 'warm'"),
        ("temperature", "-1", "option 'temperature' must be >= 0.0"),
        ("temperature", "inf", "option 'temperature' must be a number"),
        ("temp", "1", "unknown parameter 'temp'"),
    ],
)
def test_bad_text_says_what_the_option_wants(name, text, says):
    with pytest.raises(InvalidOptionError, match=says):
        parse_option_text(name, text)


@pytest.mark.parametrize(("text", "value"), [("T", True), ("1", True), ("False", False), ("0", False)])
def test_a_modelfile_reads_booleans_by_the_same_rule(text, value):
    assert Modelfile.parse(f"FROM m\nPARAMETER ignore_eos {text}").parameters == {"ignore_eos": value}


def test_a_modelfile_refuses_a_boolean_go_would_refuse():
    with pytest.raises(ModelfileError, match="^Modelfile line 2: parameter 'ignore_eos' must be true or false, got 'yes'"):
        Modelfile.parse("FROM m\nPARAMETER ignore_eos yes")
