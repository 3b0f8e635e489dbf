"""Stop strings: the matcher that holds back text which may begin a stop string."""

from __future__ import annotations

import pytest

from corral.runner.stop import StopMatcher


@pytest.mark.parametrize(
    ("stops", "pieces", "expected"),
    [
        pytest.param([], ["a", "b<"], [("a", False), ("b<", False)], id="no-stops-pass-through"),
        pytest.param(["</s>"], ["Hello <", "/", "x"], [("Hello ", False), ("", False), ("</x", False)], id="partial-held-then-released"),
        pytest.param(["</s>"], ["Hi <", "/s", "> bye"], [("Hi ", False), ("", False), ("", True)], id="spans-three-pieces"),
        pytest.param(["STOP"], ["STOP and more"], [("", True)], id="stop-at-the-very-start"),
        pytest.param(["END", "STOP"], ["one STOP two END"], [("one ", True)], id="earliest-of-several-stops"),
        pytest.param(["END", "STOP"], ["x ST", "O", "P"], [("x ", False), ("", False), ("", True)], id="second-stop-spans"),
        pytest.param(["ab", "bc"], ["xb", "c"], [("x", False), ("", True)], id="overlapping-stops"),
        pytest.param(["aab"], ["aaa", "b"], [("a", False), ("", True)], id="longest-partial-suffix-held"),
        pytest.param(["abc", "b"], ["ab"], [("a", True)], id="shorter-stop-inside-a-partial-longer-one"),
        pytest.param(["", "!"], ["hi", "!"], [("hi", False), ("", True)], id="empty-stop-ignored"),
    ],
)
def test_stop_matcher(stops, pieces, expected):
    matcher = StopMatcher(stops)
    assert [matcher.push(piece) for piece in pieces] == expected


def test_stop_matcher_flush_releases_held_text():
    matcher = StopMatcher(["world!"])
    assert matcher.push("hello wor") == ("hello ", False)
    assert matcher.flush() == "wor"
    assert matcher.flush() == ""


def test_stop_matcher_never_emits_part_of_the_stop_text():
    text, stop = "the cat sat on the mat", "on the"
    matcher = StopMatcher([stop])
    emitted, stopped = "", False
    for char in text:
        piece, stopped = matcher.push(char)
        emitted += piece
        if stopped:
            break
    assert stopped
    assert emitted == "the cat sat "
