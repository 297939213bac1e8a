"""One DSML grammar: `parse_output` is the stream fed the whole text and finished, and the
stream's outcome does not depend on how the text was cut into pieces (protocol.md §3.5-3.8).

Random DSML-ish outputs (well-formed blocks in the three syntaxes, mangled ones, reasoning
markers, entities, stray tags, multi-byte characters) are fed to `DsmlStream` whole and at
random byte boundaries. The stream stops taking text once the tool block closed (decoding
stops there), so a chunked run is compared with `parse_output` of the text it kept."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prompts.dsml_parse import parse_output
from prompts.dsml_stream import DsmlStream, ReasoningDelta, TextDelta, ToolCallEnd

NAMESPACES = ("｜DSML｜", "DSML｜", "")
VALUES = ("ls -la", "a &amp; b", "&lt;x&gt;", "&", "é€😀", '{"k": [1, 2]}', "true", "1e5", "",
          "  spaced  ", "line\nbreak", '"q"', "<", "</", "null", "{", "&#60;")


@st.composite
def tool_block(draw):
    ns = draw(st.sampled_from(NAMESPACES))
    sep = draw(st.sampled_from(("\n\n", "\n", "", " ")))
    parts = [f"{sep}<{ns}tool_calls>\n"]
    for _ in range(draw(st.integers(0, 2))):
        parts.append(f'<{ns}invoke name="{draw(st.sampled_from(("bash", "read", "a&amp;b")))}">\n')
        for _ in range(draw(st.integers(0, 3))):
            string = draw(st.sampled_from((' string="true"', ' string="false"', "", ' string="x"')))
            name = draw(st.sampled_from(("command", "path", "n")))
            value = draw(st.sampled_from(VALUES))
            if string == "" and draw(st.booleans()):     # loose nested parameters
                value = f'<{ns}parameter name="k" string="true">v</{ns}parameter>'
            parts.append(f'<{ns}parameter name="{name}"{string}>{value}</{ns}parameter>\n')
        if draw(st.integers(0, 9)):
            parts.append(f"</{ns}invoke>\n")
    if draw(st.integers(0, 5)):
        parts.append(f"</{ns}tool_calls>")
    text = "".join(parts)
    if draw(st.integers(0, 4)) == 0 and text:            # mangle: drop a slice
        i = draw(st.integers(0, len(text) - 1))
        text = text[:i] + text[i + draw(st.integers(1, 8)):]
    return text


FRAGMENTS = st.sampled_from((
    "<think>", "</think>", "\n\n", " ", "a", "é", "😀", "<", ">", "&amp;", "&", '"', "text ",
    "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", "<tool_calls>", "</tool_calls>",
    '<｜DSML｜invoke name="x">', "</｜DSML｜invoke>", "<DSML｜tool_calls>", "</DSML｜tool_calls>"))

OUTPUTS = st.lists(st.one_of(FRAGMENTS, tool_block(), st.text(max_size=3)), max_size=8).map("".join)


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


def _run(pieces, think, has_tools, finish):
    st_ = DsmlStream(think, has_tools=has_tools)
    events = []
    for p in pieces:
        if st_.done:
            break
        events += st_.feed(p)
    events += st_.finish(finish)
    return st_, events


def _shown(events):
    return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in events if isinstance(e, TextDelta)),
            [e.call for e in events if isinstance(e, ToolCallEnd)])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=OUTPUTS, think=st.booleans(), has_tools=st.booleans(),
       finish=st.sampled_from(("stop", "length", "error")),
       cuts=st.lists(st.integers(0, 10 ** 6), max_size=12))
def test_parse_output_is_the_stream_run_to_the_end(text, think, has_tools, finish, cuts):
    whole, whole_events = _run([text], think, has_tools, finish)
    assert whole.text == text
    assert whole.result == parse_output(text, think, finish=finish, has_tools=has_tools)

    chunked, chunked_events = _run(_cut(text.encode(), cuts), think, has_tools, finish)
    kept = chunked.text
    # the piece that closed the block may end inside a character (shown as U+FFFD)
    assert text.startswith(kept.rstrip("\ufffd"))
    assert chunked.result == parse_output(kept, think, finish=finish, has_tools=has_tools)
    assert _shown(chunked_events)[2] == chunked.result.tool_calls
    if kept == text:
        # the same text cut anywhere: the same outcome and the same text shown
        assert chunked.result == whole.result
        assert _shown(chunked_events) == _shown(whole_events)
