"""Stop strings are found across pieces of text and never released, even in part."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenwire.server.text.stop import StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, bool]:
    released = []
    for piece in pieces:
        scan = matcher.feed(piece)
        released.append(scan.released)
        if scan.stopped:
            return "".join(released), True
    released.append(matcher.flush())
    return "".join(released), False


def test_stop_string_spanning_pieces_is_cut_before_it() -> None:
    text, stopped = feed_all(StopStringMatcher(["\nUser:"]), ["Hello", " there\n", "Us", "er: more"])
    assert stopped
    assert text == "Hello there"


def test_possible_prefix_is_held_until_it_is_known_not_to_be_a_stop() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST").released == "abc "
    assert matcher.held == "ST"
    assert matcher.feed("ART").released == "START"


def test_earliest_of_several_stop_strings_wins() -> None:
    text, stopped = feed_all(StopStringMatcher(["world", "lo w"]), ["hello world"])
    assert stopped and text == "hel"


def test_without_stop_strings_everything_passes_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("abc").released == "abc"
    assert matcher.held == ""


@given(
    text=st.text(alphabet="abcXY\n", max_size=60),
    stop=st.text(alphabet="abcXY\n", min_size=1, max_size=5),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=10),
)
def test_any_split_of_the_text_gives_the_same_result(text: str, stop: str, cuts: list[int]) -> None:
    points = sorted({c for c in cuts if c <= len(text)})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    released, stopped = feed_all(StopStringMatcher([stop]), pieces)
    index = text.find(stop)
    if index >= 0:
        assert stopped and released == text[:index]
    else:
        assert not stopped and released == text
    assert stop not in released
