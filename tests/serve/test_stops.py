"""`StopText`: however the text is cut into pieces, what comes out is the text before the
first stop string (all of it when none occurs), and nothing is sent twice."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.serve.stops import StopText

ALPHABET = "ab\u00e9 "


def _whole(text, stops):
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


@given(text=st.text(ALPHABET, max_size=40),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_pieces_give_the_text_before_the_first_stop(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    stop_text = StopText(stops)
    out = "".join(stop_text.feed(text[a:b]) for a, b in pairwise(bounds))
    out += stop_text.finish()
    assert out == _whole(text, stops)
    assert stop_text.hit == any(s in text for s in stops)


def test_what_may_begin_a_stop_string_is_held_until_it_is_known():
    stop_text = StopText(["END"])
    assert stop_text.feed("the E") == "the "  # "E" may begin END
    assert stop_text.feed("N") == ""
    assert stop_text.feed("D and more") == "" and stop_text.hit
    assert stop_text.finish() == ""
    other = StopText(["END"])
    assert other.feed("the EN") == "the " and other.feed("ormous") == "ENormous"
    assert not other.hit and other.finish() == ""


def test_an_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        StopText(["ok", ""])


def test_a_stop_string_that_began_earlier_wins_over_one_already_seen():
    stop_text = StopText(["b", "aba"])
    assert stop_text.feed("aab") == "a" and not stop_text.hit  # "ab" may yet be "aba"
    assert stop_text.feed("a") == "" and stop_text.hit
    assert stop_text.finish() == ""
    other = StopText(["b", "aba"])
    assert other.feed("aab") == "a"
    assert other.finish() == "a" and other.hit  # it ended there: "b" was the first
    assert StopText([]).feed("text") == "text"
