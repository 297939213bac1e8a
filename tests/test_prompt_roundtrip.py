"""render(parse(x)): a sampled assistant turn, parsed and rendered back into the history, gives
the same bytes the model wrote — canonically when the model wrote canonical DSML, and through
exact replay (the remembered block) when it did not. This is what keeps the live KV state valid
across turns."""
from __future__ import annotations

import pytest

from prompts import (ASSISTANT, EOS, Message, ToolCall, ToolMemory, new_tool_id, parse_output,
                     render_messages, render_tool_calls)

CALLS = [ToolCall(None, "read_file", '{"path":"src/a.py","limit":40}'),
         ToolCall(None, "bash", '{"command":"grep -n \\"x < y\\" *.c && echo done","timeout":5.5,'
                                '"env":{"A":[1,true,null]}}')]
TOOLS = ['{"type":"function","function":{"name":"read_file","parameters":{"type":"object"}}}',
         '{"type":"function","function":{"name":"bash","parameters":{"type":"object"}}}']


def _assistant(parsed, ids, exact: bool):
    calls = [ToolCall(i, c.name, c.arguments_json, parsed.dsml if exact else None)
             for i, c in zip(ids, parsed.tool_calls)]
    return Message("assistant", parsed.content or "", parsed.reasoning, calls)


def _history(assistant, n_results):
    results = [Message("tool", f"result {k}", tool_call_id=c.id)
               for k, c in zip(range(n_results), assistant.tool_calls)]
    return [Message("system", "be brief"), Message("user", "look at a.py"), assistant, *results]


@pytest.mark.parametrize("think", ["none", "high"])
def test_canonical_tool_turn_round_trips(think):
    block = render_tool_calls(CALLS)
    sampled = ("I should read it first.</think>" if think == "high" else "") + "Let me check." + block
    parsed = parse_output(sampled, think)
    assert parsed.finish_reason == "tool_calls"
    assert [c.name for c in parsed.tool_calls] == ["read_file", "bash"]
    assert parsed.tool_calls[1].arguments == {"command": 'grep -n "x < y" *.c && echo done',
                                              "timeout": 5.5, "env": {"A": [1, True, None]}}
    ids = [new_tool_id("openai") for _ in CALLS]
    text = render_messages(_history(_assistant(parsed, ids, exact=False), 2), TOOLS, think)
    prefix = ASSISTANT + ("<think>" if think == "high" else "</think>")
    assert prefix + sampled + EOS in text          # the turn renders back to the sampled bytes
    assert text.count("<tool_result>") == 2 and text.endswith(prefix)


def test_loose_dsml_needs_exact_replay():
    # the model put the parameters in another order and spaced the tags its own way: the parse
    # is the same call, canonical rendering is not the same bytes, the remembered block is
    sampled = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n"
               "<｜DSML｜parameter name=\"limit\" string=\"false\">40</｜DSML｜parameter>\n"
               "<｜DSML｜parameter name=\"path\" string=\"true\">src/a.py</｜DSML｜parameter>\n"
               "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    odd = sampled.replace("<｜DSML｜invoke", "  <｜DSML｜invoke")
    parsed = parse_output(odd, "none")
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("read_file", {"limit": 40, "path": "src/a.py"})]
    mem = ToolMemory()
    cid = new_tool_id("anthropic")
    mem.remember(cid, parsed.dsml)
    exact = render_messages(_history(_assistant(parsed, [cid], exact=True), 1), TOOLS, "none")
    canon = render_messages(_history(_assistant(parsed, [cid], exact=False), 1), TOOLS, "none")
    assert ASSISTANT + "</think>" + odd + EOS in exact
    assert odd not in canon and sampled in canon   # canonical form keeps the model's argument order
    assert mem.items_for_text(exact) and mem.get(cid) == parsed.dsml
