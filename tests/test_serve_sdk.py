"""`ds4-agent --serve` end to end: the official `openai` and `anthropic` SDKs against a live shim on
loopback, backed by the tiny 2-layer model.

Every endpoint, streamed and not; tool-call turns (the reply forced to a DSML block with
`worker.force`, every forced token still evaluated into the KV) and the follow-up turn each client
sends with the tool result; KV prefix reuse between turns, checked three ways: the API's cached
token count, the reuse path the worker took (trace `source`), and the tokens the session actually
evaluated. Exact DSML replay and disk-cache restarts live in test_serve_reuse.py.
"""
from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

import prompts  # noqa: E402
from ds4agent.serve import ServeConfig, ServerThread, Shim  # noqa: E402
from helpers_serve import Server  # noqa: E402

CAP = 96                 # the server's cap on generated tokens (a forced tool block is ~55 tokens)
N = 6                    # what the plain requests ask for
NO_THINK = {"thinking": False}
GREEDY = {"temperature": 0}     # the anthropic SDK has no temperature argument any more
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": WEATHER}}]
ANTH_TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]
RESP_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
               "parameters": WEATHER}]
BLOCK = prompts.render_tool_calls([prompts.ToolCall(None, "get_weather", '{"city":"Paris"}')])
ARGS = {"city": "Paris"}


# ------------------------------------------------------------------------------------------
# one engine, one server for the module

@pytest.fixture(scope="module")
def srv(agent_engine, tmp_path_factory):
    trace = tmp_path_factory.mktemp("serve") / "trace.jsonl"
    shim = Shim(agent_engine, ServeConfig(ctx=8192, max_tokens=CAP, trace=str(trace)))
    with ServerThread(shim) as url:
        yield Server(shim, url)


@pytest.fixture(autouse=True)
def _clean(request):
    yield
    if "srv" in request.fixturenames:
        s = request.getfixturevalue("srv")
        with s.worker.lock:
            left = list(s.worker._forced)
            s.worker._forced.clear()
        s._seen = len(s.records())
        assert not left, f"forced replies left unused: {left!r}"


def check_turn(s: Server, rec: dict, *, prompt: int, cached: int, completion: int, before: int):
    """The API's usage agrees with the worker's record, and exactly the uncached suffix of the
    prompt was evaluated (plus one step per generated token)."""
    assert rec["status"] == 200
    assert rec["prompt_tokens"] == prompt and rec["cached"] == cached and rec["gen_tokens"] == completion
    assert 0 <= cached <= prompt
    assert s.evaluated() - before == (prompt - cached) + completion


def canonical_count(s: Server, rec: dict) -> int:
    return len(s.shim.engine.tokenizer.encode(rec["prompt_text"]))


# ------------------------------------------------------------------------------------------
# 1. every endpoint through its SDK, streamed and not

@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions(srv, stream):
    before = srv.evaluated()
    kw = dict(model="deepseek-v4-flash", messages=[{"role": "user", "content": "Say hello."}],
              max_tokens=N, temperature=0, extra_body=NO_THINK)
    if not stream:
        r = srv.oc.chat.completions.create(**kw)
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        ch = r.choices[0]
        finish, content, usage = ch.finish_reason, ch.message.content, r.usage
        assert ch.message.role == "assistant" and not ch.message.tool_calls
    else:
        chunks = list(srv.oc.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                     **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert len({c.id for c in chunks}) == 1
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finishes) == 1
        finish = finishes[0]
        assert not chunks[-1].choices and chunks[-1].usage is not None
        usage = chunks[-1].usage
    rec = srv.last()
    assert finish in ("stop", "length")
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= N
    assert (finish == "length") == (usage.completion_tokens == N)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    d = usage.prompt_tokens_details
    assert 0 <= d.cached_tokens < usage.prompt_tokens
    assert content == rec["output"] and content
    assert rec["think_mode"] == "none" and rec["stream"] is stream
    if rec["source"] in ("cold", "memory-token", "memory-prefix"):
        assert usage.prompt_tokens == canonical_count(srv, rec)
    check_turn(srv, rec, prompt=usage.prompt_tokens, cached=d.cached_tokens,
               completion=usage.completion_tokens, before=before)


def test_chat_thinking_default_streams_reasoning(srv):
    """Thinking is on by default: the reply starts as reasoning_content."""
    chunks = list(srv.oc.chat.completions.create(
        model="deepseek-v4-flash", messages=[{"role": "user", "content": "Think."}], max_tokens=N,
        stream=True, seed=3))
    rec = srv.last()
    assert rec["think_mode"] == "high" and rec["prompt_text"].endswith("<｜Assistant｜><think>")
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    out = rec["output"]
    if "</think>" in out:
        assert reasoning + "</think>" + content == out
    else:
        assert reasoning == out and content == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_legacy_completions(srv, stream):
    before = srv.evaluated()
    kw = dict(model="deepseek-v4-flash", prompt="Once upon a time", max_tokens=N, temperature=0,
              extra_body=NO_THINK)
    if not stream:
        r = srv.oc.completions.create(**kw)
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
    else:
        chunks = list(srv.oc.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finishes) == 1
        finish = finishes[0]
        usage = chunks[-1].usage
        assert usage is not None and not chunks[-1].choices
    rec = srv.last()
    # the fixed completions template (protocol.md §2.6)
    assert rec["prompt_text"] == (prompts.BOS + "You are a helpful assistant<｜User｜>Once upon a time"
                                  "<｜Assistant｜></think>")
    assert finish in ("stop", "length")
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= N
    assert (finish == "length") == (usage.completion_tokens == N)
    assert text == rec["output"]
    check_turn(srv, rec, prompt=usage.prompt_tokens, cached=usage.prompt_tokens_details.cached_tokens,
               completion=usage.completion_tokens, before=before)


def test_responses(srv):
    before = srv.evaluated()
    r = srv.oc.responses.create(model="deepseek-v4-flash", input="Say hello.", max_output_tokens=N,
                                temperature=0, reasoning={"effort": "none"})
    rec = srv.last()
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details is not None   # N tokens, no EOS
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text == rec["output"] and r.output_text
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens == N and u.total_tokens == u.input_tokens + N
    check_turn(srv, rec, prompt=u.input_tokens, cached=u.input_tokens_details.cached_tokens,
               completion=N, before=before)


def test_responses_stream_events(srv):
    """Raw events (the shape a client such as Codex reads): created .. deltas .. a terminal event."""
    events = list(srv.oc.responses.create(model="deepseek-v4-flash", input="Say hello.", max_output_tokens=N,
                                          temperature=0, reasoning={"effort": "none"}, stream=True))
    rec = srv.last()
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == rec["output"]
    final = events[-1].response
    assert final.usage.output_tokens == N and final.usage.input_tokens == rec["prompt_tokens"]
    assert final.output[0].content[0].text == text


def test_responses_stream_helper(srv):
    """The SDK's accumulating helper needs `response.completed`: a reply that ends on its own."""
    srv.worker.force("Hello there.")
    with srv.oc.responses.stream(model="deepseek-v4-flash", input="Say hello.", max_output_tokens=N * 4,
                                 reasoning={"effort": "none"}) as st:
        final = st.get_final_response()
    rec = srv.last()
    assert final.status == "completed" and final.output_text == "Hello there."
    assert 0 < final.usage.output_tokens <= N * 4 and final.usage.output_tokens == rec["gen_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages(srv, stream):
    before = srv.evaluated()
    kw = dict(model="deepseek-v4-flash", max_tokens=N, messages=[{"role": "user", "content": "Say hello."}],
              thinking={"type": "disabled"}, system="Be brief.", extra_body=GREEDY)
    if stream:
        with srv.ac.messages.stream(**kw) as st:
            kinds = [ev.type for ev in st]
            m = st.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    else:
        m = srv.ac.messages.create(**kw)
    rec = srv.last()
    assert m.type == "message" and m.role == "assistant"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert (m.stop_reason == "max_tokens") == (m.usage.output_tokens == N)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == rec["output"]
    u = m.usage
    assert 0 < u.output_tokens <= N
    prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert prompt == rec["prompt_tokens"] > 0
    assert "Be brief." in rec["prompt_text"]
    check_turn(srv, rec, prompt=prompt, cached=u.cache_read_input_tokens, completion=u.output_tokens,
               before=before)


def test_server_cap(srv):
    """--max-tokens caps what a client asks for; hitting it ends the turn as "stop" (an
    operator's runaway guard, not the client's limit: agents carry on), marked in the trace. A
    client's own smaller limit still ends in "length"."""
    srv.shim.cfg.max_tokens = 3
    try:
        r = srv.oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "Go on."}],
                                           max_tokens=50, temperature=0, extra_body=NO_THINK)
        rec = srv.last()
        r2 = srv.oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "Go on."}],
                                            max_tokens=2, temperature=0, extra_body=NO_THINK)
        rec2 = srv.last()
    finally:
        srv.shim.cfg.max_tokens = CAP
    assert r.usage.completion_tokens == 3 == rec["gen_tokens"]
    assert r.choices[0].finish_reason == "stop" and rec.get("capped") is True
    assert r2.usage.completion_tokens == 2 and r2.choices[0].finish_reason == "length"
    assert not rec2.get("capped")
    assert r.model == "m"                # the model string is echoed


# ------------------------------------------------------------------------------------------
# 2 + 3. tool-call turns, the tool-result turn, and KV reuse between them

def _chat_stream_collect(stream):
    """Accumulate a chat stream the way clients do (tool calls by index)."""
    content, calls, finish, usage = "", {}, None, None
    for c in stream:
        if c.usage is not None:
            usage = c.usage
        if not c.choices:
            continue
        ch = c.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or ():
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                slot["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
        finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, usage


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tool_call_turn(srv, stream):
    msgs = [{"role": "system", "content": "You can check the weather."},
            {"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="deepseek-v4-flash", tools=CHAT_TOOLS, temperature=0, extra_body=NO_THINK)
    srv.worker.force(BLOCK)
    before = srv.evaluated()
    if not stream:
        r = srv.oc.chat.completions.create(messages=msgs, **kw)
        msg = r.choices[0].message
        finish, usage = r.choices[0].finish_reason, r.usage
        assert msg.content == ""
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in msg.tool_calls]
        assert msg.tool_calls[0].type == "function"
    else:
        content, calls, finish, usage = _chat_stream_collect(srv.oc.chat.completions.create(
            messages=msgs, stream=True, stream_options={"include_usage": True}, **kw))
        assert content == ""
    rec1 = srv.last()
    assert finish == "tool_calls" and rec1["finish"] == "tool_calls"
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == ARGS and calls[0]["arguments"] == '{"city":"Paris"}'
    tid = calls[0]["id"]
    assert tid.startswith("call_") and len(tid) == 37
    assert rec1["output"] == BLOCK
    p1, c1 = usage.prompt_tokens, usage.completion_tokens
    assert c1 == len(srv.shim.engine.tokenizer.encode(BLOCK)) <= CAP
    check_turn(srv, rec1, prompt=p1, cached=usage.prompt_tokens_details.cached_tokens, completion=c1,
               before=before)
    assert srv.worker.memory.get(tid) == BLOCK and srv.worker.memory.source(tid) == "ram"

    # turn 2: the client appends the assistant turn (as the SDK returned it) and the tool result
    msgs += [{"role": "assistant", "content": "",
              "tool_calls": [{"id": tid, "type": "function",
                              "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
             {"role": "tool", "tool_call_id": tid, "content": "sunny, 21 C"}]
    before = srv.evaluated()
    r2 = srv.oc.chat.completions.create(messages=msgs, max_tokens=N, **kw)
    rec2 = srv.last()
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls", "error")
    u2 = r2.usage
    # everything up to the end of the sampled tool block is reused, only the result is prefilled
    assert rec2["prompt_text"].endswith(BLOCK + prompts.EOS + "<｜User｜><tool_result>sunny, 21 C</tool_result>"
                                        "<｜Assistant｜></think>")
    assert rec2["source"] in ("memory-token", "memory-text")
    assert u2.prompt_tokens_details.cached_tokens == p1 + c1
    assert 0 < u2.prompt_tokens - (p1 + c1) < 40
    check_turn(srv, rec2, prompt=u2.prompt_tokens, cached=u2.prompt_tokens_details.cached_tokens,
               completion=u2.completion_tokens, before=before)
    assert u2.completion_tokens <= N


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_use_turn(srv, stream):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="deepseek-v4-flash", max_tokens=CAP, tools=ANTH_TOOLS, extra_body=GREEDY,
              thinking={"type": "disabled"})
    srv.worker.force(BLOCK)
    before = srv.evaluated()
    if stream:
        with srv.ac.messages.stream(messages=msgs, **kw) as st:
            m = st.get_final_message()
    else:
        m = srv.ac.messages.create(messages=msgs, **kw)
    rec1 = srv.last()
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input == ARGS
    assert uses[0].id.startswith("toolu_") and len(uses[0].id) == 38
    assert not [b for b in m.content if b.type == "text" and b.text]
    u1 = m.usage
    p1 = u1.input_tokens + u1.cache_read_input_tokens + u1.cache_creation_input_tokens
    c1 = u1.output_tokens
    check_turn(srv, rec1, prompt=p1, cached=u1.cache_read_input_tokens, completion=c1, before=before)

    # turn 2: the assistant content as returned, then a user turn with the tool_result
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                           "content": "sunny, 21 C"}]}]
    before = srv.evaluated()
    m2 = srv.ac.messages.create(messages=msgs, **dict(kw, max_tokens=N))
    rec2 = srv.last()
    assert m2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    u2 = m2.usage
    p2 = u2.input_tokens + u2.cache_read_input_tokens + u2.cache_creation_input_tokens
    assert BLOCK + prompts.EOS + "<｜User｜><tool_result>sunny, 21 C</tool_result>" in rec2["prompt_text"]
    # §7.2: the live tool binding is tried before the token prefix
    assert rec2["source"] == "anthropic-tool-output"
    assert u2.cache_read_input_tokens == p1 + c1 and u2.cache_creation_input_tokens == p2 - (p1 + c1) > 0
    check_turn(srv, rec2, prompt=p2, cached=u2.cache_read_input_tokens, completion=u2.output_tokens,
               before=before)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_turn(srv, stream):
    items = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="deepseek-v4-flash", tools=RESP_TOOLS, reasoning={"effort": "none"}, temperature=0,
              instructions="You can check the weather.")
    srv.worker.force(BLOCK)
    before = srv.evaluated()
    if stream:
        with srv.oc.responses.stream(input=items, **kw) as st:
            r = st.get_final_response()
    else:
        r = srv.oc.responses.create(input=items, **kw)
    rec1 = srv.last()
    assert r.status == "completed"
    fcs = [o for o in r.output if o.type == "function_call"]
    assert len(fcs) == 1 and len(r.output) == 1
    fc = fcs[0]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == ARGS
    assert fc.call_id.startswith("call_") and fc.id.startswith("fc_") and fc.status == "completed"
    u1 = r.usage
    p1, c1 = u1.input_tokens, u1.output_tokens
    check_turn(srv, rec1, prompt=p1, cached=u1.input_tokens_details.cached_tokens, completion=c1,
               before=before)
    # instructions are the system text, after the tool schemas
    assert rec1["prompt_text"].startswith(prompts.BOS + "## Tools\n")
    assert rec1["prompt_text"].endswith("You can check the weather.<｜User｜>Weather in Paris?<｜Assistant｜></think>")

    # turn 2: the whole input again, the output items, and the function_call_output
    items = items + [o.model_dump(exclude_none=True) for o in r.output] + \
        [{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 21 C"}]
    before = srv.evaluated()
    r2 = srv.oc.responses.create(input=items, max_output_tokens=N, **kw)
    rec2 = srv.last()
    assert r2.status in ("completed", "incomplete")
    u2 = r2.usage
    assert BLOCK + prompts.EOS + "<｜User｜><tool_result>sunny, 21 C</tool_result>" in rec2["prompt_text"]
    # §7.2 step 1: the remembered visible transcript is a prefix of the new prompt
    assert rec2["source"] == "responses-visible"
    assert u2.input_tokens_details.cached_tokens == p1 + c1 < u2.input_tokens
    check_turn(srv, rec2, prompt=u2.input_tokens, cached=u2.input_tokens_details.cached_tokens,
               completion=u2.output_tokens, before=before)
    assert u2.output_tokens <= N


# ------------------------------------------------------------------------------------------
# 3. plain multi-turn conversations: the resent history is found in the live KV

REPLY = "Hello there, friend."


def test_chat_second_turn_reuses_prefix(srv):
    msgs = [{"role": "user", "content": "Greet me."}]
    kw = dict(model="m", temperature=0, extra_body=NO_THINK)
    srv.worker.force(REPLY)
    r1 = srv.oc.chat.completions.create(messages=msgs, **kw)
    srv.last()
    assert r1.choices[0].finish_reason == "stop" and r1.choices[0].message.content == REPLY
    p1, c1 = r1.usage.prompt_tokens, r1.usage.completion_tokens
    msgs += [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "Again."}]
    before = srv.evaluated()
    r2 = srv.oc.chat.completions.create(messages=msgs, max_tokens=N, **kw)
    rec2 = srv.last()
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert rec2["source"] == "memory-token"
    assert cached == p1 + c1 and r2.usage.prompt_tokens > cached
    assert r2.usage.prompt_tokens == canonical_count(srv, rec2)
    check_turn(srv, rec2, prompt=r2.usage.prompt_tokens, cached=cached,
               completion=r2.usage.completion_tokens, before=before)


def test_chat_second_turn_after_sampled_reply(srv):
    """A sampled (not forced) reply cut by max_tokens: the KV holds no EOS after it, the next
    prompt does; what the client resends is still found up to at least the first prompt."""
    msgs = [{"role": "user", "content": "Tell me something."}]
    kw = dict(model="m", temperature=0, extra_body=NO_THINK, max_tokens=N)
    r1 = srv.oc.chat.completions.create(messages=msgs, **kw)
    srv.last()
    p1, c1 = r1.usage.prompt_tokens, r1.usage.completion_tokens
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "More."}]
    before = srv.evaluated()
    r2 = srv.oc.chat.completions.create(messages=msgs, **kw)
    rec2 = srv.last()
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert rec2["source"] in ("memory-token", "memory-text", "memory-prefix")
    assert p1 <= cached <= p1 + c1 < r2.usage.prompt_tokens
    check_turn(srv, rec2, prompt=r2.usage.prompt_tokens, cached=cached,
               completion=r2.usage.completion_tokens, before=before)


def test_anthropic_second_turn_reuses_prefix(srv):
    msgs = [{"role": "user", "content": "Greet me."}]
    kw = dict(model="m", extra_body=GREEDY, thinking={"type": "disabled"}, system="Be kind.")
    srv.worker.force(REPLY)
    m1 = srv.ac.messages.create(messages=msgs, max_tokens=CAP, **kw)
    srv.last()
    assert m1.stop_reason == "end_turn" and m1.content[0].text == REPLY
    p1 = m1.usage.cache_read_input_tokens + m1.usage.cache_creation_input_tokens + m1.usage.input_tokens
    c1 = m1.usage.output_tokens
    msgs += [{"role": "assistant", "content": m1.content[0].text}, {"role": "user", "content": "Again."}]
    before = srv.evaluated()
    m2 = srv.ac.messages.create(messages=msgs, max_tokens=N, **kw)
    rec2 = srv.last()
    u = m2.usage
    assert rec2["source"] == "memory-token"
    assert u.cache_read_input_tokens == p1 + c1 > 0 and u.input_tokens == 0
    p2 = u.cache_read_input_tokens + u.cache_creation_input_tokens
    check_turn(srv, rec2, prompt=p2, cached=u.cache_read_input_tokens, completion=u.output_tokens,
               before=before)


def test_responses_second_turn_reuses_prefix(srv):
    kw = dict(model="m", temperature=0, reasoning={"effort": "none"})
    srv.worker.force(REPLY)
    r1 = srv.oc.responses.create(input="Greet me.", **kw)
    srv.last()
    assert r1.status == "completed" and r1.output_text == REPLY
    p1, c1 = r1.usage.input_tokens, r1.usage.output_tokens
    items = [{"role": "user", "content": "Greet me."}] + [o.model_dump(exclude_none=True) for o in r1.output] \
        + [{"role": "user", "content": "Again."}]
    before = srv.evaluated()
    r2 = srv.oc.responses.create(input=items, max_output_tokens=N, **kw)
    rec2 = srv.last()
    u = r2.usage
    assert rec2["source"] == "responses-visible"
    assert u.input_tokens_details.cached_tokens == p1 + c1 < u.input_tokens
    check_turn(srv, rec2, prompt=u.input_tokens, cached=u.input_tokens_details.cached_tokens,
               completion=u.output_tokens, before=before)


def test_changed_history_is_not_reused_past_the_change(srv):
    """Editing an earlier turn: the reuse stops at the first differing token (no false hit)."""
    kw = dict(model="m", temperature=0, extra_body=NO_THINK)
    srv.worker.force(REPLY)
    r1 = srv.oc.chat.completions.create(messages=[{"role": "user", "content": "Greet me."}], **kw)
    srv.last()
    p1 = r1.usage.prompt_tokens
    msgs = [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": "Something else."},
            {"role": "user", "content": "Again."}]
    before = srv.evaluated()
    r2 = srv.oc.chat.completions.create(messages=msgs, max_tokens=N, **kw)
    rec2 = srv.last()
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # the old prompt is a prefix, the reply is not: the timeline is cut back to the prompt
    assert rec2["source"] == "memory-prefix" and cached == p1
    check_turn(srv, rec2, prompt=r2.usage.prompt_tokens, cached=cached,
               completion=r2.usage.completion_tokens, before=before)


# ------------------------------------------------------------------------------------------
# thinking mode (the default): hidden reasoning stays in the KV though clients drop it

def test_chat_thinking_turn_reuses_hidden_reasoning(srv):
    """The client resends only the visible answer; the KV holds the reasoning too. The
    thinking-visible binding (§7.2 step 6) still continues the live session."""
    msgs = [{"role": "user", "content": "Think, then greet."}]
    srv.worker.force("Let me think.</think>Hello.")
    r1 = srv.oc.chat.completions.create(model="m", messages=msgs)
    rec1 = srv.last()
    m = r1.choices[0].message
    assert rec1["think_mode"] == "high" and r1.choices[0].finish_reason == "stop"
    assert m.content == "Hello." and getattr(m, "reasoning_content", None) == "Let me think."
    p1, c1 = r1.usage.prompt_tokens, r1.usage.completion_tokens
    msgs += [{"role": "assistant", "content": m.content}, {"role": "user", "content": "Again."}]
    before = srv.evaluated()
    r2 = srv.oc.chat.completions.create(model="m", messages=msgs, max_tokens=N)
    rec2 = srv.last()
    assert "Let me think." not in rec2["prompt_text"]          # old reasoning is not rendered
    assert rec2["source"] == "thinking-visible"
    assert r2.usage.prompt_tokens_details.cached_tokens == p1 + c1
    check_turn(srv, rec2, prompt=r2.usage.prompt_tokens, cached=p1 + c1,
               completion=r2.usage.completion_tokens, before=before)


def test_anthropic_thinking_tool_use_stream(srv):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="m", tools=ANTH_TOOLS, thinking={"type": "enabled", "budget_tokens": 1024})
    srv.worker.force("Checking.</think>" + BLOCK)
    with srv.ac.messages.stream(messages=msgs, max_tokens=CAP, **kw) as st:
        kinds = [ev.type for ev in st]
        m = st.get_final_message()
    rec1 = srv.last()
    assert rec1["think_mode"] == "high" and "content_block_delta" in kinds
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].thinking == "Checking." and m.content[0].signature == m.id
    assert m.content[1].input == ARGS
    u = m.usage
    p1, c1 = u.cache_read_input_tokens + u.cache_creation_input_tokens, u.output_tokens
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[1].id,
                                           "content": "sunny, 21 C"}]}]
    before = srv.evaluated()
    m2 = srv.ac.messages.create(messages=msgs, max_tokens=N, **kw)
    rec2 = srv.last()
    # tool context: the resent thinking is rendered back, so the prompt matches the KV byte for byte
    assert "<think>Checking.</think>" + BLOCK + prompts.EOS in rec2["prompt_text"]
    assert rec2["source"] == "anthropic-tool-output"
    u2 = m2.usage
    assert u2.cache_read_input_tokens == p1 + c1
    check_turn(srv, rec2, prompt=u2.cache_read_input_tokens + u2.cache_creation_input_tokens,
               cached=p1 + c1, completion=u2.output_tokens, before=before)
