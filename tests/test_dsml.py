"""DSML parsing, streaming projection, structural/payload tracking, tool ids and tool memory
(protocol.md §3, §6.1-6.2; kvcache.md §2.4). Hand-written model outputs; several are ds4's own
server unit-test vectors (ds4_server.c test_dsml_*, test_openai_tool_stream_*)."""
from __future__ import annotations

import json
import random
import re
import zlib

import pytest

from prompts import tool_ids
from prompts.dsml_parse import Parsed, find_next_dsml_tool_block, parse_output, unescape_entities
from prompts.dsml_stream import (DsmlStream, ReasoningDelta, StreamError, TextDelta, ToolArgsDelta,
                                 ToolCallEnd, ToolCallStart)
from prompts.tool_ids import ToolMemory, new_tool_id

D = "｜DSML｜"
TC, TC_END = f"<{D}tool_calls>", f"</{D}tool_calls>"
INV, INV_END = f"<{D}invoke", f"</{D}invoke>"
PAR, PAR_END = f"<{D}parameter", f"</{D}parameter>"


def param(name, value, string=True, syn=D):
    s = "true" if string is True else "false" if string is False else string
    attr = f' string="{s}"' if string is not None else ""
    return f'<{syn}parameter name="{name}"{attr}>{value}</{syn}parameter>\n'


def invoke(name, *params, syn=D):
    return f'<{syn}invoke name="{name}">\n' + "".join(params) + f"</{syn}invoke>\n"


def block(*invokes, syn=D, sep="\n\n"):
    return f"{sep}<{syn}tool_calls>\n" + "".join(invokes) + f"</{syn}tool_calls>"


BASH_LS = block(invoke("bash", param("description", "list files"), param("command", "ls -la")))


# =========================================================================== parse_output

def test_single_call_content_before_block_and_exact_dsml():
    text = "I will look.\n\n" + TC + "\n" + INV + ' name="read">\n' + \
        param("path", "/tmp/a.py") + INV_END + "\n" + TC_END
    r = parse_output(text, "none")
    assert r.finish_reason == "tool_calls" and r.error is None
    assert r.reasoning is None and r.content == "I will look."
    (c,) = r.tool_calls
    assert c.name == "read" and c.arguments == {"path": "/tmp/a.py"}
    assert c.arguments_json == '{"path":"/tmp/a.py"}'
    # the block starts at the "\n\n" separator: content + block reconstructs the output
    assert c.dsml == r.dsml == text[len("I will look."):]
    assert r.content + c.dsml == text


def test_thinking_reasoning_content_and_call():
    # ds4 test_thinking_dsml_after_think_close_is_executable
    text = "<think>need a shell check</think>\n\n" + TC + "\n" + INV + ' name="bash">\n' + \
        param("command", "pwd") + INV_END + "\n" + TC_END
    r = parse_output(text, "high")
    assert r.reasoning == "need a shell check" and r.content == ""
    assert [c.name for c in r.tool_calls] == ["bash"]
    assert r.tool_calls[0].arguments == {"command": "pwd"}
    # the usual shape: the text starts inside reasoning (the prompt ended with <think>)
    r2 = parse_output("need a shell check</think>" + BASH_LS, "max")
    assert r2.reasoning == "need a shell check" and r2.content == "" and len(r2.tool_calls) == 1
    assert "need a shell check</think>" + r2.content + r2.dsml == "need a shell check</think>" + BASH_LS


def test_multiple_calls_and_argument_order_preserved():
    text = "x" + block(
        invoke("bash", param("description", "d"), param("command", "ls"), param("timeout", "10", False)),
        invoke("read", param("zeta", "1"), param("alpha", "2")))
    r = parse_output(text, "none")
    assert [c.name for c in r.tool_calls] == ["bash", "read"]
    a, b = r.tool_calls
    assert list(a.arguments) == ["description", "command", "timeout"]
    assert a.arguments_json == '{"description":"d","command":"ls","timeout":10}'
    assert list(b.arguments) == ["zeta", "alpha"] and b.arguments_json == '{"zeta":"1","alpha":"2"}'
    assert a.dsml == b.dsml == r.dsml          # one block per turn, shared by its calls


@pytest.mark.parametrize("raw,expected,compact", [
    ("10", 10, "10"),
    ("-2.5e3", -2500.0, "-2.5e3"),
    ("true", True, "true"),
    ("false", False, "false"),
    ("null", None, "null"),
    ("", None, "null"),                                     # empty JSON value -> null
    (' { "a" : [1, 2 ,3],\n "b": {"c": "x  y"} } ', {"a": [1, 2, 3], "b": {"c": "x  y"}},
     '{"a":[1,2,3],"b":{"c":"x  y"}}'),                       # minified outside strings only
    ("[ ]", [], "[]"),
    ('"quoted"', "quoted", '"quoted"'),                     # a JSON string is a string
    ('"a\\u00e9\\n"', "aé\n", '"aé\\n"'),                    # re-escaped the ds4 way
    ("10 trailing words", 10, "10"),                        # only the first JSON value counts
    ("{\"k\": \"\\u003c/｜DSML｜parameter>\"}", {"k": "</｜DSML｜parameter>"},
     "{\"k\":\"\\u003c/｜DSML｜parameter>\"}"),             # the renderer's escape survives
])
def test_string_false_values(raw, expected, compact):
    r = parse_output(block(invoke("f", param("v", raw, False))), "none")
    (c,) = r.tool_calls
    assert c.arguments == {"v": expected}
    assert c.arguments_json == '{"v":' + compact + "}"


@pytest.mark.parametrize("raw", ["not json", "   ", "{\"a\": 1", "+1", "0x10", ".5", "nan"])
def test_unparseable_json_value_gives_empty_arguments(raw):
    # ds4's API form of arguments is "{}" when they do not re-parse (append_json_object_or_empty);
    # strtod-only numbers (+1, 0x10, .5, nan) also end here (ds4 would forward invalid JSON).
    r = parse_output(block(invoke("f", param("ok", "fine"), param("v", raw, False))), "none")
    assert r.finish_reason == "tool_calls"
    (c,) = r.tool_calls
    assert c.name == "f" and c.arguments == {} and c.arguments_json == "{}"


def test_string_true_values_are_raw_text_with_whitespace_kept():
    body = "  line one\n\tline \"two\" \\ {not json} <tag> 日本語 \n"
    r = parse_output(block(invoke("write", param("content", body))), "none")
    assert r.tool_calls[0].arguments == {"content": body}
    assert r.tool_calls[0].arguments_json == \
        '{"content":"  line one\\n\\tline \\"two\\" \\\\ {not json} <tag> 日本語 \\n"}'


def test_entities_unescaped_in_strings_and_attributes_only():
    v = "a &lt;b&gt; &amp;&amp; &quot;c&quot; &apos;d&apos; &#60; &nbsp; &amp;lt; & end &"
    text = block(invoke("x&amp;y", param("s&quot;", v), param("j", '"&lt;"', False)))
    (c,) = parse_output(text, "none").tool_calls
    assert c.name == "x&y"
    # named entities only, left to right; numeric and unknown ones stay; &amp;lt; -> &lt;
    assert c.arguments['s"'] == "a <b> && \"c\" 'd' &#60; &nbsp; &lt; & end &"
    assert c.arguments["j"] == "&lt;"        # JSON values are not entity-decoded
    assert unescape_entities("&&amp;") == "&&" and unescape_entities("&amp") == "&amp"


def test_escaped_closing_parameter_tag_inside_a_string_value():
    # the renderer writes a literal "</｜DSML｜parameter>" in a string as "&lt;/｜DSML｜parameter>"
    text = block(invoke("bash", param("command", f"echo &lt;/{D}parameter> 2>&1 && ok")))
    (c,) = parse_output(text, "none").tool_calls
    assert c.arguments == {"command": f"echo </{D}parameter> 2>&1 && ok"}


def test_missing_string_attribute_means_string():
    (c,) = parse_output(block(invoke("f", param("n", "10", None))), "none").tool_calls
    assert c.arguments == {"n": "10"}
    (c,) = parse_output(block(invoke("f", param("n", "10", "yes"))), "none").tool_calls
    assert c.arguments == {"n": 10}          # anything but exactly "true" is JSON


def test_short_and_plain_syntaxes_recovered():
    # ds4 test_parse_short_dsml_and_canonical_suffix
    gen = ("<think>need a tool</think><DSML｜tool_calls>\n<DSML｜invoke name=\"bash\">\n"
           "<DSML｜parameter name=\"description\" string=\"true\">list files</DSML｜parameter>\n"
           "<DSML｜parameter name=\"command\" string=\"true\">ls -la</DSML｜parameter>\n"
           "</DSML｜invoke>\n</DSML｜tool_calls>")
    r = parse_output(gen, "none")
    assert r.reasoning == "need a tool" and r.content == ""
    assert r.tool_calls[0].arguments == {"description": "list files", "command": "ls -la"}
    assert r.dsml == gen[len("<think>need a tool</think>"):]
    plain = "ok" + block(invoke("read", param("path", "a.c", syn=""), syn=""), syn="")
    r = parse_output(plain, "none")
    assert r.content == "ok" and r.tool_calls[0].arguments == {"path": "a.c"}
    assert r.dsml.startswith("\n\n<tool_calls>")


def test_loose_nested_parameters_recovered():
    # ds4 test_dsml_parser_recovers_loose_nested_parameters
    gen = ("review done\n\n" + TC + "\n" + INV + ' name="edit">\n'
           + PAR + ' name="path">/private/tmp/tetris.c' + PAR_END + "\n"
           + PAR + ' name="edits">\n'
           + PAR + ' name="oldText" string="true">old &lt;text&gt;' + PAR_END + "\n"
           + PAR + ' name="newText" string="true">new text' + PAR_END + "\n"
           + INV_END + "\n" + TC_END)
    r = parse_output(gen, "none")
    assert r.content == "review done" and r.finish_reason == "tool_calls"
    (c,) = r.tool_calls
    assert c.arguments == {"path": "/private/tmp/tetris.c",
                           "edits": {"oldText": "old <text>", "newText": "new text"}}
    assert c.arguments_json == \
        '{"path":"/private/tmp/tetris.c","edits":{"oldText":"old <text>","newText":"new text"}}'
    # an explicit closing tag after the nested leaves is skipped; typed leaves keep their type
    gen2 = block(invoke("e", PAR + ' name="o">' + param("n", "3", False) + param("s", "x")
                        + PAR_END + "\n", param("after", "y")))
    assert parse_output(gen2, "none").tool_calls[0].arguments == {"o": {"n": 3, "s": "x"}, "after": "y"}


def test_block_start_priority_is_by_pattern_not_position():
    # an earlier short-syntax block loses to the full syntax (first pattern that occurs wins)
    early = "<DSML｜tool_calls>\n</DSML｜tool_calls>"
    text = "see " + early + BASH_LS
    r = parse_output(text, "none")
    assert r.content == "see " + early and len(r.tool_calls) == 1 and r.dsml == BASH_LS


def test_whitespace_separator_is_not_content():
    # ds4 test_tool_separator_whitespace_is_not_content
    gen = "<think>need a tool</think>I will inspect the files.\n\n\n\n" + BASH_LS[2:]
    r = parse_output(gen, "none")
    assert r.content == "I will inspect the files." and r.reasoning == "need a tool"
    assert r.dsml == "\n\n" + BASH_LS[2:]
    # a single "\n" separator is stripped from content and is NOT part of the block (§6.2)
    r = parse_output("text\n" + BASH_LS[2:], "none")
    assert r.content == "text" and r.dsml == BASH_LS[2:]
    # leading whitespace and whitespace inside/around tags are tolerated or kept
    loose = ("  hi \n\n" + TC + " \t\n " + INV + ' name="f" >\r\n' + PAR + ' name="a" string="true" >v'
             + PAR_END + "  " + INV_END + "\n\n" + TC_END)
    r = parse_output(loose, "none")
    assert r.content == "  hi" and r.tool_calls[0].arguments == {"a": "v"}


def test_text_after_block_is_discarded():
    r = parse_output("a" + BASH_LS + "\ntrailing words", "none")
    assert r.content == "a" and r.dsml == BASH_LS and r.finish_reason == "tool_calls"


def test_plain_answer_without_tools():
    r = parse_output("Hello there.\n", "none")
    assert r == Parsed(reasoning=None, content="Hello there.\n", tool_calls=[], finish_reason="stop")
    r = parse_output("hmm</think>Hello.", "high")
    assert (r.reasoning, r.content, r.finish_reason) == ("hmm", "Hello.", "stop")
    assert parse_output("cut short", "none", finish="length").finish_reason == "length"


@pytest.mark.parametrize("bad", [
    TC + "\n" + INV + ">\n" + TC_END,                                        # ds4 vector: no name
    TC + "\n" + INV + ' name="f">\n' + PAR + ' string="true">v' + PAR_END + INV_END + TC_END,
    TC + "\n" + INV + ' name="f">\n' + PAR + ' name="a" string="true">v' + INV_END + TC_END,
    TC + "\n" + INV + ' name="f">\n' + "garbage" + INV_END + TC_END,          # bytes between tags
    TC + "\n" + "<DSML｜invoke name=\"f\">\n</DSML｜invoke>\n" + TC_END,       # mixed syntaxes
    TC + "\n" + INV + ' name="f">\n' + PAR + ' name="o">' + PAR + ' string="true">x' + PAR_END
    + INV_END + TC_END,                                                       # nested leaf w/o name
])
def test_malformed_block_recovers_as_plain_text(bad):
    # ds4 test_tool_parse_failure_returns_recoverable_finish
    for mode, text in (("none", "trying a tool\n\n" + bad), ("high", "plan</think>trying\n\n" + bad)):
        r = parse_output(text, mode)
        assert r.finish_reason == "stop" and r.error == "invalid tool call"
        assert r.content == text and r.reasoning is None and r.tool_calls == []
        assert parse_output(text, mode, finish="length").finish_reason == "length"
        # without tools ds4 returns the same text and flags nothing
        r = parse_output(text, mode, has_tools=False)
        assert (r.finish_reason, r.error, r.content) == ("stop", None, text)


@pytest.mark.parametrize("cut", [len("\n\n" + TC), 40, 90, -len(TC_END), -1])
def test_truncated_block_is_an_error(cut):
    text = "doing it" + BASH_LS[:cut]
    for finish in ("stop", "length"):
        r = parse_output(text, "none", finish=finish)
        assert r.finish_reason == "error" and r.error == "unterminated tool call"
        assert r.content == text and r.reasoning is None and r.tool_calls == []


def test_dsml_inside_thinking_is_not_executable():
    # ds4 test_thinking_dsml_is_not_executable_before_think_close
    inner = block(invoke("bash", param("command", "true")), sep="\n\n")
    gen = ("<think>I might mention a malformed or tentative tool call here:" + inner +
           "\nBut it is still reasoning, not an assistant action.</think>Final answer.")
    r = parse_output(gen, "high")
    assert r.tool_calls == [] and r.finish_reason == "stop" and r.error is None
    assert TC in r.reasoning and r.content == "Final answer."
    # reasoning never closed: nothing executes; ds4 returns it all as content
    r = parse_output("thinking" + inner, "high")
    assert r.tool_calls == [] and r.reasoning is None and r.content == "thinking" + inner
    assert r.finish_reason == "stop" and r.error is None
    # an unterminated block inside reasoning is not an error either
    r = parse_output("plan " + TC + "\n</think>Done.", "high")
    assert (r.reasoning, r.content, r.finish_reason, r.error) == ("plan " + TC + "\n", "Done.", "stop", None)
    # non-thinking mode: the same block is executable
    assert len(parse_output("x" + inner, "none").tool_calls) == 1


def test_tool_search_starts_after_last_think_close():
    gen = "r1</think>c1</think>c2" + BASH_LS
    r = parse_output(gen, "high")
    assert r.reasoning == "r1" and r.content == "c1</think>c2" and len(r.tool_calls) == 1


def test_non_thinking_split_quirk():
    # ds4 splits on </think> in every mode (split_reasoning_content)
    r = parse_output("hello </think> world", "none")
    assert (r.reasoning, r.content) == ("hello ", " world")


def test_empty_block_finishes_as_tool_calls_without_calls():
    r = parse_output("x" + block(), "none")
    assert r.finish_reason == "tool_calls" and r.tool_calls == [] and r.dsml == block()


def test_block_without_tools_is_still_returned_as_calls():
    r = parse_output("x" + BASH_LS, "none", has_tools=False)
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1


def test_duplicate_keys_and_ds4_json_escaping():
    (c,) = parse_output(block(invoke("f", param("k", "1"), param("k", "2"),
                                     param("c", "\x01\x08\x0c\x7f/é"))), "none").tool_calls
    assert c.arguments_json == '{"k":"1","k":"2","c":"\\u0001\\u0008\\u000c\x7f/é"}'
    assert c.arguments == {"k": "2", "c": "\x01\x08\x0c\x7f/é"}


def test_think_mode_values():
    assert parse_output("a</think>b", True).reasoning == "a"
    assert parse_output("a</think>b", False).content == "b"
    with pytest.raises(ValueError):
        parse_output("x", "medium")


# =========================================================================== streaming

def run_stream(pieces, mode="none", **kw):
    st = DsmlStream(mode, **kw)
    events = []
    for p in pieces:
        events += st.feed(p)
    events += st.finish()
    return st, events


def summarize(events):
    """What a client sees: reasoning, text, per-call names/argument text, ended calls, errors."""
    s = {"reasoning": "", "text": "", "names": {}, "args": {}, "ended": {}, "errors": []}
    for e in events:
        if isinstance(e, ReasoningDelta):
            s["reasoning"] += e.text
        elif isinstance(e, TextDelta):
            s["text"] += e.text
        elif isinstance(e, ToolCallStart):
            assert e.index not in s["names"]
            s["names"][e.index] = e.name
        elif isinstance(e, ToolArgsDelta):
            assert e.index in s["names"]
            s["args"][e.index] = s["args"].get(e.index, "") + e.text
        elif isinstance(e, ToolCallEnd):
            assert e.index in s["names"] and e.index not in s["ended"]
            s["ended"][e.index] = e.call
        elif isinstance(e, StreamError):
            s["errors"].append((e.message, e.recovered))
    return s


def texts(events, kind):
    return [e.text for e in events if isinstance(e, kind)]


def test_stream_basic_tool_turn():
    text = "thinking hard</think>Let me run it." + block(
        invoke("bash", param("command", "echo &amp; a &lt;b&gt; \"q\""),
               param("n", '{ "a": [1, 2] }', False)))
    st, ev = run_stream(text, "high")
    s = summarize(ev)
    assert s["reasoning"] == "thinking hard" and s["text"] == "Let me run it."
    assert s["names"] == {0: "bash"}
    # OpenAI-style fragments: strings unescaped then JSON-escaped, JSON values forwarded raw
    assert s["args"][0] == '{"command":"echo & a <b> \\"q\\"","n":{ "a": [1, 2] }}'
    assert json.loads(s["args"][0]) == s["ended"][0].arguments
    assert s["ended"][0] == st.result.tool_calls[0] and s["errors"] == []
    assert st.done and st.result == parse_output(text, "high")
    assert s["reasoning"] + "</think>" + s["text"] + st.result.dsml == text


def test_stream_holds_partial_marker_at_piece_end():
    st = DsmlStream("none")
    assert texts(st.feed("Hello <｜DS"), TextDelta) == ["Hello"]      # '<' and the space held
    assert st.feed("ML｜tool_c") == []
    ev = st.feed("alls>\n")
    assert texts(ev, TextDelta) == [] and not st.done
    assert st.in_dsml_syntax
    # a '<' that turns out to be text is released once a later '<' or 80 bytes pass, or at finish
    st, ev = run_stream(["a <b", " and", " more"], "none")
    assert "".join(texts(ev, TextDelta)) == "a <b and more"
    st = DsmlStream("none")
    out = st.feed("x < y " + "z" * 90)
    assert "".join(texts(out, TextDelta)) == "x < y " + "z" * 90
    # without tools only UTF-8 is held back
    st = DsmlStream("none", has_tools=False)
    assert texts(st.feed("Hello <｜DS"), TextDelta) == ["Hello <｜DS"]


def test_stream_think_close_split_across_pieces():
    st = DsmlStream("high")
    ev = st.feed("<think>plan it</thi")
    assert "".join(texts(ev, ReasoningDelta)) == "plan "       # 7 bytes held back, "<think>" dropped
    ev = st.feed("nk>Answer")
    assert "".join(texts(ev, ReasoningDelta)) == "it"
    assert texts(ev, TextDelta) == ["Answer"]
    ev = st.finish()
    assert ev == [] and st.result.reasoning == "plan it" and st.result.content == "Answer"


def test_stream_reasoning_truncated_stays_reasoning():
    st, ev = run_stream(["still thinking", " about ", "</thi"], "high")
    s = summarize(ev)
    assert s["reasoning"] == "still thinking about </thi" and s["text"] == ""
    # the non-stream result follows ds4: unclosed reasoning comes back as content
    assert st.result.reasoning is None and st.result.content == "still thinking about </thi"


def test_stream_utf8_split_in_bytes_pieces():
    text = "思考é</think>Réponse 🚩 " + block(invoke("write", param("content", "flag 🚩 é"),
                                                      param("j", '["日本"]', False)))
    data = text.encode()
    pieces = [data[i:i + 1] for i in range(len(data))]       # every byte alone
    st, ev = run_stream(pieces, "high")
    assert all("\ufffd" not in e.text for e in ev if hasattr(e, "text"))
    s = summarize(ev)
    assert s["reasoning"] == "思考é" and s["text"] == "Réponse 🚩"
    assert json.loads(s["args"][0]) == {"content": "flag 🚩 é", "j": ["日本"]}
    assert st.result == parse_output(text, "high")


def test_stream_holds_partial_utf8_argument():
    # ds4 test_openai_tool_stream_holds_partial_utf8_arguments
    prefix = (TC + "\n" + INV + ' name="write">\n' + PAR + ' name="content" string="true">flag ').encode()
    flag = "🚩".encode()
    st = DsmlStream("none")
    ev = st.feed(prefix + flag[:2])
    assert texts(ev, ToolArgsDelta) == ["{", '"content":"', "flag "]
    ev = st.feed(flag[2:] + (" done" + PAR_END + "\n" + INV_END + "\n" + TC_END).encode())
    assert "".join(texts(ev, ToolArgsDelta)) == '🚩 done"}'


def test_stream_holds_partial_entities():
    # ds4 test_openai_tool_stream_holds_partial_dsml_entities
    st = DsmlStream("none")
    ev = st.feed(TC + "\n" + INV + ' name="bash">\n' + PAR + ' name="command" string="true">echo &amp')
    assert texts(ev, ToolArgsDelta)[-1] == "echo "
    ev = st.feed("; done" + PAR_END + "\n" + INV_END + "\n" + TC_END)
    assert texts(ev, ToolArgsDelta)[:2] == ["& done", '"']
    (end,) = [e for e in ev if isinstance(e, ToolCallEnd)]
    assert st.done and end.call.arguments == {"command": "echo & done"}
    # a partial closing tag in a value is held too, and a '<' that is not one is released
    st = DsmlStream("none")
    ev = st.feed(TC + INV + ' name="f">' + PAR + ' name="a" string="true">x </｜DS')
    assert texts(ev, ToolArgsDelta)[-1] == "x "
    ev = st.feed("ML｜param")
    assert texts(ev, ToolArgsDelta) == []
    ev = st.feed("x a<b")
    assert "".join(texts(ev, ToolArgsDelta)) == "</｜DSML｜paramx a<b"


def test_stream_multiple_calls():
    # ds4 test_openai_tool_stream_handles_multiple_calls
    raw = (TC + "\n" + INV + ' name="read">\n' + param("path", "a.c") + INV_END + "\n"
           + INV + ' name="bash">\n' + param("command", "wc -l a.c") + INV_END + "\n" + TC_END)
    st, ev = run_stream([raw], "none")
    s = summarize(ev)
    assert s["names"] == {0: "read", 1: "bash"}
    assert s["args"] == {0: '{"path":"a.c"}', 1: '{"command":"wc -l a.c"}'}
    assert [s["ended"][i] for i in (0, 1)] == st.result.tool_calls
    # calls end only once the whole block parsed (the parse is all or nothing)
    kinds = [type(e).__name__ for e in ev]
    assert kinds.index("ToolCallEnd") > kinds.index("ToolCallStart", kinds.index("ToolCallStart") + 1)


def test_stream_done_at_closing_tag_and_ignores_the_rest():
    st = DsmlStream("none")
    ev = st.feed("ok" + BASH_LS)
    assert st.done and any(isinstance(e, ToolCallEnd) for e in ev)
    assert st.feed("<｜end▁of▁sentence｜>more") == []
    assert st.finish() == [] and st.result.finish_reason == "tool_calls"
    assert st.text == "ok" + BASH_LS


def test_stream_unterminated_block_reports_error():
    st, ev = run_stream(["ok\n\n", TC, "\n", INV, ' name="bash">\n', PAR, ' name="c" string="true">ls'])
    s = summarize(ev)
    assert s["names"] == {0: "bash"} and s["ended"] == {}
    assert s["errors"] == [("unterminated tool call", False)]
    assert st.result.finish_reason == "error" and st.result.content == st.text


def test_stream_malformed_block_recovers():
    bad = "trying\n\n" + TC + "\n" + INV + ' name="f">\n' + "garbage" + INV_END + TC_END
    st, ev = run_stream([bad], "none")
    s = summarize(ev)
    assert s["errors"] == [("invalid tool call", True)] and s["ended"] == {}
    assert s["names"] == {0: "f"}                 # already shown; the error retracts it
    assert st.result.content == bad and st.result.finish_reason == "stop"


def test_stream_loose_dsml_projection_fails_but_call_is_recovered():
    gen = "edit it" + block(invoke("edit", param("path", "/a", None),
                                   PAR + ' name="edits">\n' + param("old", "x") + param("new", "y"),
                                   param("after", "z")))
    st, ev = run_stream(list(gen), "none")
    s = summarize(ev)
    assert s["names"] == {0: "edit"} and s["args"][0] == "{"      # the projection stopped
    # without a closing tag after the nested leaves every following leaf joins the object (ds4)
    assert s["ended"][0].arguments == {"path": "/a", "edits": {"old": "x", "new": "y", "after": "z"}}
    assert s["errors"] == [] and st.result.finish_reason == "tool_calls"


def test_stream_dsml_inside_thinking_is_reasoning():
    inner = block(invoke("bash", param("command", "rm -rf /")))
    st, ev = run_stream(list("let me think" + inner + " no.</think>Fine."), "high")
    s = summarize(ev)
    assert s["reasoning"] == "let me think" + inner + " no." and s["text"] == "Fine."
    assert s["names"] == {} and s["ended"] == {} and s["errors"] == []
    assert not st.saw_tool_start and st.result.tool_calls == []


def test_stream_without_tools_shows_dsml_as_text_and_calls_at_finish():
    text = "x" + BASH_LS
    st = DsmlStream("none", has_tools=False)
    ev = []
    for ch in text:
        ev += st.feed(ch)
        assert not st.in_dsml_syntax and not st.done
    ev += st.finish()
    s = summarize(ev)
    assert s["text"] == text
    call = st.result.tool_calls[0]
    assert s["names"] == {0: "bash"} and s["args"] == {0: call.arguments_json} and s["ended"] == {0: call}


def test_stream_stop_sequences():
    # ds4 test_stop_list_streaming_holds_and_trims_stop_text (plain stream, no tools)
    st = DsmlStream("none", has_tools=False, stop=["</END>", "STOP"])
    assert texts(st.feed("hello </"), TextDelta) == ["hel"]
    st = DsmlStream("none", stop=["STOP"])
    ev = st.feed("answer ST")
    ev += st.feed("OP hidden")
    assert st.done and st.stopped and st.feed("more") == []
    ev += st.finish()
    assert "".join(texts(ev, TextDelta)) == "answer " and st.result.content == "answer "
    # a stop inside an open tool block leaves it unterminated
    st, ev = run_stream(["go", BASH_LS[:60], "HALT", "rest"], "none", stop=["HALT"])
    assert st.stopped and st.result.finish_reason == "error"


def test_stream_finish_length():
    st, ev = run_stream(["plain ", "answer"], "none")
    assert st.result.finish_reason == "stop"
    st = DsmlStream("none")
    st.feed("cut")
    st.finish("length")
    assert st.result.finish_reason == "length"


# --------------------------------------------------------------------------- property: splits

def _corpus():
    full = block(invoke("bash", param("description", "run &amp; check"), param("command", "ls -la 'a b'")),
                 invoke("edit", param("path", "/t/é.py"),
                        param("edits", '[{"old": "a\\"<b", "new": "c &amp; d"}]', False),
                        param("n", " 12 ", False), param("flag", "true", False)))
    return [
        ("none", "Just text with a < sign, & ampersand, 日本語 and </think-ish> bits."),
        ("none", "Short." + BASH_LS),
        ("none", "Two calls:" + full),
        ("none", "x\n" + BASH_LS[2:]),
        ("none", "   " + BASH_LS),
        ("none", "ok" + block(invoke("f", param("a", "1", False)), syn="DSML｜")),
        ("none", "ok" + block(invoke("f", param("a", "v", syn=""), syn=""), syn="")),
        ("none", "ok" + block(invoke("f", param("a", "1", None)))),           # projection fails
        ("none", "ok" + BASH_LS[:70]),                                         # unterminated
        ("none", "bad\n\n" + TC + INV + ">" + INV_END + TC_END),               # malformed
        ("none", "ok" + BASH_LS + "\ntrailing"),
        ("high", "plan 🚩 carefully</think>Answer " + full),
        ("high", "<think>plan</think>\n\nText only, <b>bold</b>."),
        ("high", "quote " + BASH_LS + " in reasoning</think>then" + BASH_LS),
        ("high", "never closes " + BASH_LS),
        ("high", "ok</think>" + block()),
    ]


def _random_pieces(rng, text, how):
    if how == "char":
        return list(text)
    if how == "bytes":
        data = text.encode()
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, len(data) // 3)))
        return [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
    if how == "whole":
        return [text]
    pieces, i = [], 0
    while i < len(text):                       # token-like: 1..7 characters
        k = rng.randint(1, 7)
        pieces.append(text[i:i + k])
        i += k
    return pieces


@pytest.mark.parametrize("mode,text", _corpus())
def test_stream_is_split_invariant_and_agrees_with_parse_output(mode, text):
    rng = random.Random(zlib.crc32(text.encode()))
    ref = None
    for how in ["whole", "char", "bytes"] + ["tokens"] * 6:
        st, ev = run_stream(_random_pieces(rng, text, how), mode)
        s = summarize(ev)
        assert all("\ufffd" not in e.text for e in ev if hasattr(e, "text"))
        assert st.result == parse_output(st.text, mode)
        assert list(s["ended"].values()) == st.result.tool_calls
        if ref is None:
            ref = s
            continue
        assert s == ref, how
    res = parse_output(text, mode)
    assert ref["ended"] == dict(enumerate(res.tool_calls))
    if res.tool_calls and res.finish_reason == "tool_calls":
        # text deltas never show DSML; reasoning/text agree with the final parse
        assert "DSML" not in ref["text"] and "<tool_calls" not in ref["text"]
        assert ref["text"] == res.content and ref["reasoning"] == (res.reasoning or "")
        for i, c in enumerate(res.tool_calls):
            if i in ref["args"] and ref["args"][i].endswith("}"):
                assert json.loads(ref["args"][i]) == c.arguments
    if res.finish_reason == "tool_calls" and text.endswith(res.dsml):
        # reasoning + "</think>" + content + (separator whitespace ds4 drops) + block == text
        head = ref["reasoning"] + "</think>" if mode != "none" else ""
        assert text.startswith(head + ref["text"])
        assert text[len(head + ref["text"]):len(text) - len(res.dsml)].strip(" \t\n") == ""


# --------------------------------------------------------------------------- §3.7 tracker

def _states_along(pieces, **kw):
    st = DsmlStream("none", **kw)
    out = []
    for p in pieces:
        st.feed(p)
        out.append((p, st.dsml_state, st.in_dsml_syntax))
    return out


def test_tracker_states_along_a_tool_block():
    pieces = ["Sure", ".", "\n\n", "<", D, "tool", "_c", "alls", ">", "\n",
              "<", D, "inv", "oke", ' name="', "edit", '">', "\n",
              "<", D, "parameter", ' name="path"', ' string="true">', "/tmp", "/a.py",
              "</", D, "parameter", ">", "\n",
              "<", D, "parameter", ' name="edits" string="false">', "[{", '"new', 'Text":"', "for i",
              ' \\"x\\"', '"', "}]", "</", D, "parameter", ">", "\n",
              "</", D, "invoke", ">", "\n", "</", D, "tool_calls", ">"]
    got = _states_along(pieces)
    expect = {
        "Sure": "outside", "alls": "outside", ">": None, '">': "structural",
        "/tmp": "string_body", "/a.py": "string_body", "[{": "json_structural",
        '"new': "json_string", 'Text":"': "json_string", "for i": "json_string",
        ' \\"x\\"': "json_string", '"': "json_structural", "}]": "json_structural",
    }
    for p, state, greedy in got:
        if p in expect and expect[p]:
            assert state == expect[p], (p, state)
        assert greedy == (state in ("structural", "json_structural"))
    # the opening tag, tags, the "</" tail of a value and whitespace between tags are greedy
    i = pieces.index(">")
    assert got[i][1] == "structural" and got[i + 1][1] == "structural"
    assert got[pieces.index("</")][1] == "structural"
    assert got[pieces.index(' string="true">')][1] == "string_body"
    assert got[-1][1] == "outside"


def test_tracker_ds4_vectors_and_done_state():
    # ds4 test_dsml_decode_state_separates_structure_and_payload (each text fed whole)
    pre = TC + "\n" + INV + ' name="edit">\n'
    cases = [(pre, "structural"),
             (pre + PAR + ' name="path" string="true">/tmp/a.py', "string_body"),
             (pre + PAR + ' name="path" string="true">/tmp/a.py</', "structural"),
             (pre + PAR + ' name="edits" string="false">[{', "json_structural"),
             (pre + PAR + ' name="edits" string="false">[{"newText":"for i in', "json_string"),
             (pre + PAR + ' name="edits" string="false">[]' + PAR_END + "\n" + INV_END + "\n" + TC_END,
              "outside"),
             (pre + PAR + ' name="n">12', "json_structural")]      # no string attr: JSON here
    for text, state in cases:
        st = DsmlStream("none")
        st.feed(text)
        assert st.dsml_state == state, text
    # after the first block closes, nothing more is tracked (a second block samples freely)
    # (one piece carries the close and a new block; decoding would have stopped at the close)
    st = DsmlStream("none")
    st.feed("a" + BASH_LS + "\n" + TC + "\n" + INV + ' name="x">')
    assert st.dsml_state == "outside" and st.done


def test_tracker_ds4_quirks():
    # the tracker does not consult think state: DSML quoted in reasoning is sampled greedily
    st = DsmlStream("high")
    st.feed("maybe " + TC + "\n" + INV)
    assert st.in_dsml_syntax and not st.saw_tool_start
    # a lone '<' at the end of a payload token is stepped over: the closing tag after it is not
    # recognised (token-by-token ds4 parity; "</" is one token in practice)
    st = DsmlStream("none")
    st.feed(TC + INV + ' name="f">' + PAR + ' name="a" string="true">x <')
    assert st.dsml_state == "string_body"
    st.feed("/" + D + "parameter>")
    assert st.dsml_state == "string_body"
    st = DsmlStream("none")
    st.feed(TC + INV + ' name="f">' + PAR + ' name="a" string="true">x ')
    st.feed("</")
    assert st.dsml_state == "structural"
    st.feed(D + "parameter>")
    assert st.dsml_state == "structural"


# =========================================================================== tool ids

def test_tool_id_format_and_uniqueness():
    ids = {new_tool_id("openai") for _ in range(2000)}
    assert len(ids) == 2000 and all(re.fullmatch(r"call_[0-9a-f]{32}", i) for i in ids)
    assert re.fullmatch(r"call_[0-9a-f]{32}", new_tool_id("responses"))
    assert re.fullmatch(r"toolu_[0-9a-f]{32}", new_tool_id("anthropic"))
    with pytest.raises(ValueError):
        new_tool_id("gemini")


def test_tool_id_redrawn_when_taken(monkeypatch):
    draws = iter(["0" * 32, "0" * 32, "1" * 32])
    monkeypatch.setattr(tool_ids.secrets, "token_hex", lambda n: next(draws))
    mem = ToolMemory()
    mem.remember("call_" + "0" * 32, BASH_LS)
    assert new_tool_id("openai", taken=mem) == "call_" + "1" * 32


# =========================================================================== tool memory

def _blk(cmd):
    return block(invoke("bash", param("command", cmd)))


def test_tool_memory_remember_get_and_bounds():
    m = ToolMemory()
    m.remember("call_a", _blk("a"))
    assert m.get("call_a") == _blk("a") and m.get("nope") is None and "call_a" in m
    m.remember("x" * 256, "d")
    m.remember("é" * 128, "d")                       # 256 bytes
    for bad_id in ("", "x" * 257, "é" * 129):
        with pytest.raises(ValueError):
            m.remember(bad_id, "d")
    with pytest.raises(ValueError):
        m.remember("call_b", "")
    with pytest.raises(ValueError):
        m.remember("call_b", "d", source="cloud")


def test_tool_memory_rejects_oversized_blocks(monkeypatch):
    monkeypatch.setattr(tool_ids, "TOOL_MEMORY_MAX_BYTES", 8)
    m = ToolMemory()
    m.remember("call_a", "12345678")
    with pytest.raises(ValueError):
        m.remember("call_a", "123456789")
    with pytest.raises(ValueError):
        m.remember("call_a", "1234567é")             # 9 bytes


def test_tool_memory_evicts_least_recently_used():
    # ds4 test_tool_memory_max_ids_prunes_oldest
    m = ToolMemory(max_ids=2)
    for k in "abc":
        m.remember("call_" + k, _blk(k))
    assert m.get("call_a") is None and m.ids() == ["call_b", "call_c"] and len(m) == 2
    # get() and a repeated remember() touch: the untouched entry goes first
    m.get("call_b")
    m.remember("call_d", _blk("d"))
    assert m.ids() == ["call_b", "call_d"]
    m.remember("call_b", _blk("b"))
    m.remember("call_e", _blk("e"))
    assert m.ids() == ["call_b", "call_e"]


def test_tool_memory_byte_limit_and_shared_blocks():
    big = _blk("x" * 1000)
    m = ToolMemory(max_bytes=2500)
    m.remember("call_1", big)
    m.remember("call_2", big)                        # same block: stored and charged once
    one = m.bytes
    assert len(m) == 2 and one < 2 * len(big)
    m.remember("call_3", _blk("y" * 1000))
    assert m.ids() == ["call_2", "call_3"] or m.ids() == ["call_3"]
    assert m.bytes <= 2500
    m.forget("call_3")
    m.forget("call_2")
    assert m.bytes == 0 and len(m) == 0


def test_tool_memory_replace_and_source():
    m = ToolMemory()
    m.remember("call_a", _blk("a"), source="disk")
    assert m.source("call_a") == "disk"
    m.remember("call_a", _blk("a"))                  # the sampled copy wins
    assert m.source("call_a") == "ram"
    m.remember("call_a", _blk("z"), source="disk")   # a different block replaces
    assert m.get("call_a") == _blk("z") and m.source("call_a") == "disk"


def test_tool_memory_items_for_text():
    # ds4 kv_tool_map_write: blocks in text order, each once, its ids newest first
    a, b, c = _blk("a"), _blk("b"), _blk("c")
    m = ToolMemory()
    m.remember("call_a1", a)
    m.remember("call_b", b)
    m.remember("call_a2", a)
    m.remember("call_c", c)
    text = "<｜begin▁of▁sentence｜>...<｜Assistant｜></think>one" + b + \
        "<｜end▁of▁sentence｜>...two" + a + "<｜end▁of▁sentence｜>again" + b
    assert m.items_for_text(text) == [("call_b", b), ("call_a2", a), ("call_a1", a)]
    assert m.items_for_text("nothing here") == []
    # only a block as ds4 delimits it counts: a remembered block without its "\n\n" is not found
    # when the text has the separator (the scan takes the "\n\n" form)
    m.remember("call_bare", a[2:])
    assert ("call_bare", a[2:]) not in m.items_for_text("x" + a)
    assert m.items_for_text("x\n" + a[2:]) == [("call_bare", a[2:])]
    assert find_next_dsml_tool_block("no end " + TC) == (-1, -1)


# =========================================================================== one reading (parse == stream)

def test_orphan_end_just_before_the_start_does_not_close_the_block():
    # §3.6: only an end AFTER a start counts. ds4's loop searched from its 80-byte hold point
    # once a start was seen, so an orphan end just before the start stopped decoding a token
    # later; fed token by token or whole, the block is still open (unterminated).
    text = TC_END + "\n\n" + TC + "\n" + INV + ' name="bash">\n'
    whole = parse_output(text, "none")
    assert whole.finish_reason == "error" and whole.error == "unterminated tool call"
    st = DsmlStream("none")
    for piece in re.findall(r"<[^>]*>|[^<]+", text):
        st.feed(piece)
        assert not st.done
    st.finish()
    assert st.result == whole


def test_dsml_inside_a_reopened_reasoning_block_is_not_executable():
    # ds4 feeds its thinking state byte by byte: after `</think>answer<think>` the model is
    # reasoning again and a malformed block there neither stops decoding nor is an error; the
    # same text in one piece reads the same (parse_output used to scan after the last </think>).
    text = "r</think>answer<think>more\n\n" + TC + "junk" + TC_END
    r = parse_output(text, "high")
    assert r.finish_reason == "stop" and r.error is None and r.tool_calls == []
    st = DsmlStream("high")
    for piece in re.findall(r"</?think>|<[^>]*>|[^<]+", text):
        st.feed(piece)
    assert not st.done
    st.finish()
    assert st.result == r


def test_a_start_before_reasoning_reopens_is_still_unterminated():
    # the start was seen outside reasoning (token by token ds4 sees it then), so one piece
    # holding `</think>`, the start and `<think>` reads the same: unterminated
    text = "r</think>a\n\n" + TC + "\n<think>b"
    r = parse_output(text, "high")
    assert r.finish_reason == "error" and r.error == "unterminated tool call"
    st = DsmlStream("high")
    st.feed(text)
    st.finish()
    assert st.result == r
