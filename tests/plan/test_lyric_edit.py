"""Choosing a repaint range by a lyric line or section, and replacing one line's words
(`mm3.plan.lyric_edit`): pure functions over the prompt's lines and their timestamps."""

import pytest

from mm3.plan.lyric_edit import (
    LyricEditError, choose_range, line_index, replace_line, section_index, times_from_lrc, times_from_record)
from mm3.plan.lyrics_align import LyricTime
from mm3.plan.prompt import LyricLine, normalize_lyrics

LYRICS = "[Verse]\nhello there\nsing along\n[chorus]\nla la la\n[verse]\nsecond verse\n[chorus]\nla la again"


def _lines(lyrics=LYRICS):
    """The prompt's lines of `lyrics` (token positions do not matter here)."""
    out = []
    for text in normalize_lyrics(lyrics).split("\n"):
        if text.strip():
            out.append(LyricLine(text.strip(), 0, 1, text.strip().startswith("[")))
    return out


def _times(seconds, lyrics=LYRICS):
    return [LyricTime(line, s) for line, s in zip(_lines(lyrics), seconds)]


# [start] [verse] hello sing [chorus] la [verse] second [chorus] la-again
SECONDS = [0.0, 0.5, 1.0, 3.0, 5.0, 5.2, 8.0, 8.4, 11.0, 11.5]


def test_lines_are_counted_as_sung_and_sections_by_occurrence():
    lines = _lines()
    assert [lines[line_index(lines, n)].text for n in (1, 2, 3, 4, 5)] == [
        "hello there", "sing along", "la la la", "second verse", "la la again"]
    assert lines[section_index(lines, "chorus 2")].text == "[chorus]"
    assert section_index(lines, "Chorus") == section_index(lines, "[chorus] 1") == 4
    assert section_index(lines, "verse 2") == 6  # "[Verse]" is lower-cased as the prompt does


def test_a_line_range_reaches_the_margin_into_its_neighbours_at_most_half_way():
    r = choose_range(_times(SECONDS), 14.0, line=2, margin=0.5)
    assert (r.start, r.end, r.text, r.label) == (2.5, 5.1, "sing along", "line 2")  # next line [chorus] at 5.0
    assert r.record() == {"line": 2, "text": "sing along", "start": 2.5, "end": 5.1}
    wide = choose_range(_times(SECONDS), 14.0, line=2, margin=5.0)
    assert (wide.start, wide.end) == (2.0, 5.1)  # half-way to hello (1.0) and into [chorus] (5.0 .. 5.2)
    last = choose_range(_times(SECONDS), 14.0, line=5, margin=0.5)
    assert (last.start, last.end) == (11.25, 14.0)  # the last line runs to the song's end


def test_a_section_runs_to_the_next_section_tag():
    r = choose_range(_times(SECONDS), 14.0, section="chorus 1", margin=0.0)
    assert (r.start, r.end, r.label) == (5.0, 8.0, "section chorus 1")
    assert choose_range(_times(SECONDS), 14.0, section="chorus 2", margin=0.0).end == 14.0


@pytest.mark.parametrize("kw,message", [
    ({"line": 6}, "line 6 is not in the lyrics: they have 5 sung line(s), numbered 1 to 5"),
    ({"line": 0}, "line 0 is not in the lyrics"),
    ({"section": "bridge"}, "section 'bridge' is not in the lyrics; their sections: verse 1, chorus 1, verse 2, "
                            "chorus 2"),
    ({"section": "chorus 3"}, "section 'chorus 3' is not in the lyrics"),
])
def test_lines_and_sections_not_in_the_lyrics_are_refused(kw, message):
    with pytest.raises(LyricEditError) as e:
        choose_range(_times(SECONDS), 14.0, **kw)
    assert message in str(e.value)


def test_a_line_the_song_never_reached_and_an_instrumental_are_refused():
    with pytest.raises(LyricEditError, match="line 5 'la la again' was not timed"):
        choose_range(_times(SECONDS[:-1] + [None]), 14.0, line=5)
    inst = _times([0.0, 0.0], "[instrumental]")
    with pytest.raises(LyricEditError, match="no lyrics to choose a line from"):
        choose_range(inst, 10.0, line=1)


def test_replacing_a_line_keeps_the_rest_as_written():
    new, old = replace_line(LYRICS, 3, "  brand new words ")
    assert old == "la la la"
    assert new == LYRICS.replace("la la la\n", "brand new words\n")
    joined, old = replace_line("[verse]\none ^ two\nthree", 2, "deux")  # " ^ " breaks a written line
    assert old == "two" and normalize_lyrics(joined) == normalize_lyrics("[verse]\none ^ deux\nthree")
    assert replace_line("[verse] dropped\nsung", 1, "new")[0] == "[verse] dropped\nnew"  # tags end that line


@pytest.mark.parametrize("words,message", [
    ("", "the new words are empty"),
    ("two\nlines", "must be one sung line"),
    ("a [chorus] tag", "must be one sung line"),
    ("x" * 1001, "one line holds at most 1000"),
])
def test_words_that_cannot_be_one_line_are_refused(words, message):
    with pytest.raises(LyricEditError, match=message):
        replace_line(LYRICS, 1, words)


def test_replacing_a_line_outside_the_lyrics_or_in_an_instrumental_is_refused():
    with pytest.raises(LyricEditError, match="line 9 is not in the lyrics: they have 5"):
        replace_line(LYRICS, 9, "new")
    with pytest.raises(LyricEditError, match="no lyrics"):
        replace_line("", 1, "new")


def test_times_come_from_an_lrc_text_or_a_record_for_the_same_lyrics():
    lrc = "[00:00.50][verse]\n[00:01.00]hello there\n[00:03.00]sing along\n"
    times = times_from_lrc(lrc, _lines())
    assert [t.seconds for t in times] == [0.0, 0.5, 1.0, 3.0] + [None] * 6
    assert [t.seconds for t in times_from_record(SECONDS, _lines())] == SECONDS
    assert times_from_record(SECONDS[:-1], _lines()) is None  # recorded for other lyrics
