"""The wire layer (ds4agent/serve/wire*.py): worker events -> each API's JSON bodies and SSE
frames, checked against protocol.md §5.1-§5.8 and, where installed, the official SDKs' types."""
from __future__ import annotations

import json

import pytest

from ds4agent.serve.events import Begin, CallOut, Failure, Finish, Prefill, Reasoning, Text, \
    ToolArgs, ToolEnd, ToolStart, Usage
from ds4agent.serve.wire import clean, context_error_body, dumps, error_body, make_wire
from prompts.messages import Conversation

P, R, C = 100, 60, 25
BEGIN = Begin(Usage(P, R))
USAGE = Usage(P, R, C)
ARGS = '{"path":"src","limit":10}'
CALL = CallOut(0, "call_" + "a" * 32, "list_files", ARGS, {"path": "src", "limit": 10})
# The §5.4 concrete example: text, then one call whose arguments stream in these fragments.
FRAGS = ["{", '"path":"', "src", '"', ',"limit":', "10", "}"]


def conv(api="openai_chat", **kw) -> Conversation:
    return Conversation(api=api, **kw)


def wire(api, c=None, stream=True):
    return make_wire(api, c or conv(api), model="local-model", seq=7, created=1700000000,
                     stream=stream)


def run(w, events) -> list[str]:
    out = []
    for ev in events:
        frames = w.frames(ev)
        assert all(isinstance(f, str) and f.endswith("\n\n") for f in frames)
        out += frames
    return out


def parse(frames) -> list[tuple[str | None, object]]:
    """(event name, data) per SSE frame; data is JSON except [DONE]."""
    res = []
    for f in frames:
        name, data = None, None
        for line in f.rstrip("\n").split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                assert data is None, "one data line per frame"
                data = line[6:]
        res.append((name, data if data == "[DONE]" else json.loads(data)))
    return res


def live_call(call=CALL, frags=FRAGS):
    return [ToolStart(call.index, call.id, call.name), *[ToolArgs(call.index, f) for f in frags],
            ToolEnd(call)]


def example_events():
    return [Prefill(10, 100), BEGIN, Text("Checking."), *live_call(),
            Finish("tool_calls", "Checking.", None, (CALL,), USAGE)]


# ------------------------------------------------------------------------------------------
# OpenAI chat

def test_chat_stream_concrete_example():
    w = wire("openai_chat", conv(params={"stream": True, "include_usage": True}))
    frames = run(w, example_events())
    assert all(f.startswith("data: ") for f in frames)          # no event: lines
    got = parse(frames)
    assert got[-1] == (None, "[DONE]")
    chunks = [d for _, d in got[:-1]]
    for ch in chunks:
        assert list(ch)[:4] == ["id", "object", "created", "model"]
        assert (ch["id"], ch["object"], ch["created"], ch["model"]) == \
            ("chatcmpl-7", "chat.completion.chunk", 1700000000, "local-model")
    deltas = [ch["choices"][0]["delta"] for ch in chunks[:-1]]
    assert deltas == [
        {"role": "assistant"},
        {"content": "Checking."},
        {"tool_calls": [{"index": 0, "id": CALL.id, "type": "function",
                         "function": {"name": "list_files", "arguments": ""}}]},
        *[{"tool_calls": [{"index": 0, "function": {"arguments": f}}]} for f in FRAGS],
        {},
    ]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks[:-1]] == [None] * 10 + ["tool_calls"]
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[3:10]) == ARGS
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": P, "completion_tokens": C, "total_tokens": P + C,
        "prompt_tokens_details": {"cached_tokens": R, "cache_write_tokens": P - R}}
    # nothing after the end
    assert w.frames(Text("late")) == [] and w.frames(Failure("late")) == []


def test_chat_stream_without_include_usage_and_with_reasoning():
    got = parse(run(wire("openai_chat"), [BEGIN, Reasoning("Hmm."), Text("Hi"),
                                          Finish("stop", "Hi", "Hmm.", (), USAGE)]))
    assert [d for _, d in got][-1] == "[DONE]"
    chunks = [d for _, d in got[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant"}, {"reasoning_content": "Hmm."}, {"content": "Hi"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)


def test_chat_calls_not_projected_live_come_whole_at_finish():
    second = CallOut(1, "call_" + "b" * 32, "read", '{"p":1e5}')
    got = parse(run(wire("openai_chat"), [BEGIN, *live_call(),
                                          Finish("tool_calls", "", None, (CALL, second), USAGE)]))
    whole = [d for _, d in got if d != "[DONE]" and d["choices"]][-2]["choices"][0]["delta"]
    # only the call whose header never went out, its arguments byte for byte
    assert whole == {"tool_calls": [{"index": 1, "id": second.id, "type": "function",
                                     "function": {"name": "read", "arguments": '{"p":1e5}'}}]}


def test_chat_body():
    body = wire("openai_chat", stream=False).body(Finish("tool_calls", "", None, (CALL,), USAGE))
    assert body.endswith("}\n")
    d = json.loads(body)
    assert list(d) == ["id", "object", "created", "model", "choices", "usage"]
    assert d["id"] == "chatcmpl-7" and d["object"] == "chat.completion"
    ch = d["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["index"] == 0
    assert ch["message"] == {"role": "assistant", "content": "",
                             "tool_calls": [{"id": CALL.id, "type": "function",
                                             "function": {"name": "list_files", "arguments": ARGS}}]}
    d2 = json.loads(wire("openai_chat", stream=False).body(Finish("stop", "4", "Simple.", (), USAGE)))
    assert d2["choices"][0]["message"] == {"role": "assistant", "content": "4",
                                           "reasoning_content": "Simple."}
    d3 = json.loads(wire("openai_chat", stream=False).body(Finish("error", "x", "", (), USAGE)))
    assert d3["choices"][0]["finish_reason"] == "error"
    assert "reasoning_content" not in d3["choices"][0]["message"]


def test_chat_sdk_models():
    chat = pytest.importorskip("openai.types.chat")
    from openai.lib.streaming.chat import ChatCompletionStreamState

    d = json.loads(wire("openai_chat", stream=False).body(
        Finish("tool_calls", "Checking.", "why", (CALL,), USAGE)))
    m = chat.ChatCompletion.model_validate(d)
    assert m.choices[0].message.tool_calls[0].function.arguments == ARGS
    assert m.usage.prompt_tokens_details.cached_tokens == R

    # the SDK's own accumulator rebuilds the same completion from the stream
    state = ChatCompletionStreamState()
    for _, data in parse(run(wire("openai_chat", conv(params={"include_usage": True})),
                             example_events())):
        if data != "[DONE]":
            state.handle_chunk(chat.ChatCompletionChunk.model_validate(data))
    final = state.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.content == "Checking."
    call = final.choices[0].message.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == (CALL.id, "list_files", ARGS)
    assert final.usage.total_tokens == P + C


def test_chat_malformed_dsml_tail_is_streamed():
    raw = "Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke>oops"
    got = parse(run(wire("openai_chat"), [BEGIN, Text("Checking."), Finish("stop", raw, None, (), USAGE)]))
    text = "".join(d["choices"][0]["delta"].get("content", "") for _, d in got[:-1])
    assert text == raw
    # thinking mode: the failed parse returns the raw text with the reasoning in front
    got = parse(run(wire("openai_chat"), [BEGIN, Reasoning("plan"), Text("Checking."),
                                          Finish("stop", "plan</think>" + raw, None, (), USAGE)]))
    assert "".join(d["choices"][0]["delta"].get("content", "") for _, d in got[:-1]) == raw


def test_ended_inside_thinking_streams_no_text():
    # ds4's parse returns the unfinished reasoning as content; the stream showed it as reasoning
    fin = Finish("length", "still thinking", None, (), USAGE, reasoning_closed=False)
    got = parse(run(wire("openai_chat"), [BEGIN, Reasoning("still thinking"), fin]))
    assert not any("content" in d["choices"][0]["delta"] for _, d in got[:-1])
    assert got[-2][1]["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------------------------------
# OpenAI legacy completions

def test_completions_stream_and_body():
    c = conv("openai_completions", params={"include_usage": True})
    got = parse(run(wire("openai_completions", c), [BEGIN, Text("Hello"), Text(" world"),
                                                    Finish("length", "Hello world", None, (), USAGE)]))
    assert got[-1][1] == "[DONE]"
    chunks = [d for _, d in got[:-1]]
    assert all(ch["id"] == "cmpl-7" and ch["object"] == "text_completion" for ch in chunks)
    assert [ch["choices"] for ch in chunks[:3]] == [
        [{"text": "Hello", "index": 0, "finish_reason": None}],
        [{"text": " world", "index": 0, "finish_reason": None}],
        [{"text": "", "index": 0, "finish_reason": "length"}]]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["total_tokens"] == P + C

    d = json.loads(wire("openai_completions", stream=False).body(
        Finish("stop", "Hello world", None, (), USAGE)))
    assert d == {"id": "cmpl-7", "object": "text_completion", "created": 1700000000,
                 "model": "local-model",
                 "choices": [{"text": "Hello world", "index": 0, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": P, "completion_tokens": C, "total_tokens": P + C,
                           "prompt_tokens_details": {"cached_tokens": R,
                                                     "cache_write_tokens": P - R}}}
    completion = pytest.importorskip("openai.types").Completion
    assert completion.model_validate(d).choices[0].text == "Hello world"


def test_completions_output_is_raw():
    # §2.6: no reasoning split; a worker that splits anyway gets `</think>` put back
    raw = "plan</think>answer"
    got = parse(run(wire("openai_completions"), [BEGIN, Reasoning("plan"), Text("answer"),
                                                 Finish("stop", raw, None, (), USAGE)]))
    assert "".join(d["choices"][0]["text"] for _, d in got[:-1]) == raw


# ------------------------------------------------------------------------------------------
# OpenAI Responses

def responses_events(reasoning=True):
    return [BEGIN, *([Reasoning("Let me "), Reasoning("look.")] if reasoning else []),
            Text("Checking."), *live_call(),
            Finish("tool_calls", "Checking.", "Let me look." if reasoning else None, (CALL,), USAGE)]


def test_responses_stream_shape():
    c = conv("responses", reasoning_summary=True)
    frames = run(wire("responses", c), responses_events())
    got = parse(frames)
    for k, (name, d) in enumerate(got):
        assert list(d)[:2] == ["type", "sequence_number"]
        assert d["sequence_number"] == k and name == d["type"]
    types = [d["type"] for _, d in got]
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    created = got[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["id"].startswith("resp_") and len(created["id"]) == 5 + 24

    dones = [d for _, d in got if d["type"] == "response.output_item.done"]
    assert [x["output_index"] for x in dones] == [0, 1, 2]
    rs, msg, fc = (x["item"] for x in dones)
    assert rs["id"].startswith("rs_") and rs["status"] == "completed"
    assert rs["summary"] == [{"type": "summary_text", "text": "Let me look."}]
    assert msg["id"].startswith("msg_") and msg["status"] == "completed"
    assert msg["content"] == [{"type": "output_text", "text": "Checking.", "annotations": []}]
    assert fc == {"id": fc["id"], "type": "function_call", "status": "completed",
                  "name": "list_files", "call_id": CALL.id, "arguments": ARGS}
    assert fc["id"].startswith("fc_")
    added_fc = got[15][1]["item"]
    assert added_fc["status"] == "in_progress" and added_fc["arguments"] == ""
    assert got[16][1]["delta"] == ARGS and got[17][1]["arguments"] == ARGS

    final = got[-1][1]["response"]
    assert final["id"] == created["id"] and final["status"] == "completed"
    assert final["output"] == [rs, msg, fc]
    assert final["usage"] == {"input_tokens": P,
                              "input_tokens_details": {"cached_tokens": R, "cache_write_tokens": P - R},
                              "output_tokens": C, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": P + C}


def test_responses_reasoning_only_with_summary_opt_in():
    got = parse(run(wire("responses"), responses_events()))
    assert not any("reasoning" in d["type"] for _, d in got)
    assert [x["type"] for x in got[-1][1]["response"]["output"]] == ["message", "function_call"]


def test_responses_terminal_states():
    c = conv("responses", reasoning_summary=True)
    got = parse(run(wire("responses", c), [BEGIN, Reasoning("hm"),
                                           Finish("length", "hm", None, (), USAGE, reasoning_closed=False)]))
    final = got[-1][1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [x["status"] for x in final["response"]["output"]] == ["incomplete"]
    assert not any(d["type"] == "response.output_text.delta" for _, d in got)

    got = parse(run(wire("responses"), [BEGIN, Text("a"), Finish("error", "a", None, (), USAGE)]))
    final = got[-1][1]
    assert final["type"] == "response.failed" and final["response"]["status"] == "failed"
    assert final["response"]["error"] == {"code": "server_error", "message": "generation failed"}
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_responses_namespace_and_tool_search():
    c = conv("responses", tool_wire={"multi_agent_v1spawn": {"name": "spawn", "namespace": "multi_agent_v1"},
                                     "tool_search": {"type": "tool_search"}})
    ns_call = CallOut(0, "call_" + "c" * 32, "multi_agent_v1spawn", '{"task":"x"}')
    ts_call = CallOut(1, "call_" + "d" * 32, "tool_search", '{"query":"files"}')
    fin = Finish("tool_calls", "", None, (ns_call, ts_call), USAGE)
    got = parse(run(wire("responses", c), [BEGIN, fin]))
    ns_done = next(d for _, d in got if d["type"] == "response.function_call_arguments.done")
    assert ns_done["name"] == "spawn" and ns_done["namespace"] == "multi_agent_v1"
    ns_item, ts_item = got[-1][1]["response"]["output"]
    assert ns_item == {"id": ns_item["id"], "type": "function_call", "status": "completed",
                       "name": "spawn", "namespace": "multi_agent_v1", "call_id": ns_call.id,
                       "arguments": '{"task":"x"}'}
    assert ts_item == {"id": ts_item["id"], "type": "tool_search_call", "status": "completed",
                       "call_id": ts_call.id, "execution": "client", "arguments": {"query": "files"}}
    # tool_search has no argument events
    assert sum(d["type"] == "response.function_call_arguments.delta" for _, d in got) == 1

    body = json.loads(wire("responses", c, stream=False).body(fin))
    assert [(x["type"], x.get("name")) for x in body["output"]] == \
        [("function_call", "spawn"), ("tool_search_call", None)]


def test_responses_body():
    c = conv("responses", reasoning_summary=True)
    text = wire("responses", c, stream=False).body(
        Finish("tool_calls", "Checking.", "why", (CALL,), USAGE))
    assert not text.endswith("\n")
    d = json.loads(text)
    assert list(d)[:5] == ["id", "object", "created_at", "status", "model"]
    assert d["object"] == "response" and d["status"] == "completed" and d["id"].startswith("resp_")
    assert [x["type"] for x in d["output"]] == ["reasoning", "message", "function_call"]
    assert d["output"][1]["content"][0]["text"] == "Checking."
    assert d["usage"]["total_tokens"] == P + C


def test_responses_sdk_models():
    rtypes = pytest.importorskip("openai.types.responses")
    from openai import omit
    from openai.lib.streaming.responses import ResponseStreamState
    from pydantic import TypeAdapter

    c = conv("responses", reasoning_summary=True, tool_wire={
        "tool_search": {"type": "tool_search"}, "nsf": {"name": "f", "namespace": "ns"}})
    calls = (CALL, CallOut(1, "call_" + "e" * 32, "tool_search", '{"q":1}'),
             CallOut(2, "call_" + "f" * 32, "nsf", "{}"))
    for fin in (Finish("tool_calls", "Checking.", "why", calls, USAGE),
                Finish("length", "", "why", (), USAGE, reasoning_closed=False),
                Finish("error", "x", None, (), USAGE)):
        m = rtypes.Response.model_validate(json.loads(wire("responses", c, stream=False).body(fin)))
        assert m.id.startswith("resp_")
    m = rtypes.Response.model_validate(json.loads(wire("responses", c, stream=False).body(
        Finish("tool_calls", "Checking.", "why", calls, USAGE))))
    assert m.output_text == "Checking." and m.output[4].namespace == "ns"

    # every event validates, and the SDK's own accumulator rebuilds the response from them
    adapter = TypeAdapter(rtypes.ResponseStreamEvent)
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    evs = [*responses_events()[:-1], Finish("tool_calls", "Checking.", "Let me look.", calls, USAGE)]
    handled = [e for _, d in parse(run(wire("responses", c), evs))
               for e in state.handle_event(adapter.validate_python(d))]
    final = handled[-1]
    assert final.type == "response.completed" and final.response.id.startswith("resp_")
    assert final.response.output_text == "Checking."
    assert [o.type for o in final.response.output] == \
        ["reasoning", "message", "function_call", "tool_search_call", "function_call"]
    err = parse(wire("responses", c).error_frames("boom"))[0]
    assert err[0] == "error" and adapter.validate_python(err[1]).message == "boom"


# ------------------------------------------------------------------------------------------
# Anthropic

def anthropic_call():
    return CallOut(0, "toolu_" + "a" * 32, "Bash", '{"command":"echo pong"}', {"command": "echo pong"})


def test_anthropic_stream_shape():
    call = anthropic_call()
    frags = ["{", '"command":"', "echo pong", '"', "}"]
    frames = run(wire("anthropic"), [Prefill(1, 2), BEGIN, Reasoning("Run it."), Text("Sure."),
                                     *live_call(call, frags),
                                     Finish("tool_calls", "Sure.", "Run it.", (call,), USAGE)])
    got = parse(frames)
    assert all(name == d["type"] for name, d in got)
    kinds = [name for name, _ in got]
    assert kinds == ["message_start",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", *["content_block_delta"] * 5, "content_block_stop",
                     "message_delta", "message_stop"]
    msg = got[0][1]["message"]
    assert msg["id"].startswith("msg_") and len(msg["id"]) == 4 + 24
    assert msg["content"] == [] and msg["stop_reason"] is None
    assert msg["usage"] == {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": R,
                            "cache_creation_input_tokens": P - R}
    assert got[1][1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "thinking", "thinking": "", "signature": ""}}
    assert got[3][1]["delta"] == {"type": "signature_delta", "signature": msg["id"]}
    assert got[8][1]["content_block"] == {"type": "tool_use", "id": call.id, "name": "Bash", "input": {}}
    assert "".join(d["delta"]["partial_json"] for _, d in got[9:14]) == call.arguments_json
    assert [d["index"] for _, d in got[1:15]] == [0] * 4 + [1] * 3 + [2] * 7
    assert got[-2][1] == {"type": "message_delta",
                          "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                          "usage": {"output_tokens": C}}


def test_anthropic_late_calls_and_empty_text_block():
    call = anthropic_call()
    got = parse(run(wire("anthropic"), [BEGIN, Finish("tool_calls", "", None, (call,), USAGE)]))
    assert [n for n, _ in got] == ["message_start", "content_block_start", "content_block_delta",
                                   "content_block_stop", "message_delta", "message_stop"]
    assert got[2][1]["delta"] == {"type": "input_json_delta", "partial_json": call.arguments_json}

    # only thinking: an empty text block follows it
    got = parse(run(wire("anthropic"), [BEGIN, Reasoning("hm"), Finish("stop", "", "hm", (), USAGE)]))
    assert [d.get("content_block", {}).get("type") for n, d in got if n == "content_block_start"] == \
        ["thinking", "text"]
    # nothing at all: still one (empty) text block, so Claude Code does not fall back
    got = parse(run(wire("anthropic"), [BEGIN, Finish("stop", "", None, (), USAGE)]))
    assert [n for n, _ in got].count("content_block_start") == 1


def test_anthropic_stop_reasons():
    def sr(fin):
        d = json.loads(wire("anthropic", stream=False).body(fin))
        return d["stop_reason"], d["stop_sequence"]
    assert sr(Finish("stop", "a", None, (), USAGE)) == ("end_turn", None)
    assert sr(Finish("stop", "a", None, (), USAGE, stop_sequence="END")) == ("stop_sequence", "END")
    assert sr(Finish("length", "a", None, (), USAGE)) == ("max_tokens", None)
    assert sr(Finish("error", "a", None, (), USAGE)) == ("end_turn", None)
    assert sr(Finish("tool_calls", "", None, (anthropic_call(),), USAGE)) == ("tool_use", None)


def test_anthropic_body():
    call = CallOut(0, "toolu_" + "b" * 32, "Calc", '{"x":1e5,"y":[1.50]}')
    w = wire("anthropic", stream=False)
    text = w.body(Finish("tool_calls", "Sure.", "Think.", (call,), USAGE))
    assert text.endswith("}\n")
    assert '"input":{"x":1e5,"y":[1.50]}' in text          # arguments embedded byte for byte
    d = json.loads(text)
    assert list(d) == ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"]
    assert d["content"] == [{"type": "thinking", "thinking": "Think.", "signature": d["id"]},
                            {"type": "text", "text": "Sure."},
                            {"type": "tool_use", "id": call.id, "name": "Calc",
                             "input": {"x": 100000.0, "y": [1.5]}}]
    assert d["usage"] == {"input_tokens": 0, "output_tokens": C, "cache_read_input_tokens": R,
                          "cache_creation_input_tokens": P - R}
    only_thinking = json.loads(wire("anthropic", stream=False).body(Finish("stop", "", "t", (), USAGE)))
    assert only_thinking["content"][-1] == {"type": "text", "text": ""}
    bad = json.loads(wire("anthropic", stream=False).body(
        Finish("tool_calls", "", None, (CallOut(0, "toolu_x", "f", "not json"),), USAGE)))
    assert bad["content"][0]["input"] == {}


def test_anthropic_sdk_models():
    atypes = pytest.importorskip("anthropic.types")
    from anthropic.lib.streaming._messages import accumulate_event
    from pydantic import TypeAdapter

    call = anthropic_call()
    fin = Finish("tool_calls", "Sure.", "Run it.", (call,), USAGE)
    body = atypes.Message.model_validate(json.loads(wire("anthropic", stream=False).body(fin)))
    assert body.content[2].input == {"command": "echo pong"}

    adapter = TypeAdapter(atypes.RawMessageStreamEvent)
    snap, bufs = None, {}
    for _, d in parse(run(wire("anthropic"), [BEGIN, Reasoning("Run it."), Text("Sure."),
                                              *live_call(call, ["{", '"command":"echo pong"', "}"]), fin])):
        snap = accumulate_event(event=adapter.validate_python(d), current_snapshot=snap, json_bufs=bufs)
    assert [b.type for b in snap.content] == ["thinking", "text", "tool_use"]
    assert snap.content[1].text == "Sure." and snap.content[2].input == {"command": "echo pong"}
    assert snap.stop_reason == "tool_use" and snap.usage.output_tokens == C


# ------------------------------------------------------------------------------------------
# Errors and text safety

def test_error_bodies():
    assert error_body("openai_chat", "missing messages") == \
        '{"error":{"message":"missing messages","type":"invalid_request_error"}}\n'
    assert json.loads(error_body("responses", "x", 503)) == {"error": {"message": "x", "type": "server_error"}}
    assert error_body("anthropic", "unknown endpoint", 404) == \
        '{"type":"error","error":{"type":"not_found_error","message":"unknown endpoint"}}\n'
    for status, t in [(400, "invalid_request_error"), (401, "authentication_error"),
                      (409, "invalid_request_error"), (413, "request_too_large"),
                      (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error")]:
        assert json.loads(error_body("anthropic", "m", status))["error"]["type"] == t
    assert json.loads(error_body("anthropic", "m", 500, kind="x"))["error"]["type"] == "x"

    assert json.loads(context_error_body("responses", 9, 8)) == {"error": {
        "message": "Prompt has 9 tokens, but the configured context size is 8 tokens",
        "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded",
        "n_prompt_tokens": 9, "n_ctx": 8}}
    assert json.loads(context_error_body("anthropic", 9, 8))["error"]["n_ctx"] == 8


def test_error_frames():
    assert wire("openai_chat").error_frames("boom") == \
        ['event: error\ndata: {"error":{"message":"boom","type":"server_error"}}\n\n']
    assert wire("anthropic").frames(Failure("boom")) == \
        ['event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n']
    d = parse(wire("responses").error_frames("boom"))[0][1]
    assert d["error"] == {"message": "boom", "type": "server_error"} and d["message"] == "boom"


@pytest.mark.parametrize("api", ["openai_chat", "openai_completions", "responses", "anthropic"])
def test_lone_surrogates_are_replaced(api):
    bad = "a\udcff\ud83d\ude00b\ud800"          # escape byte, a split pair, a lone high half
    call = CallOut(0, "call_x", "f\udc80", '{"k":"\udcff"}')
    c = conv(api, reasoning_summary=True, params={"include_usage": True})
    fin = Finish("tool_calls", bad, bad, (call,), USAGE)
    out = run(wire(api, c), [BEGIN, Reasoning(bad), Text(bad), ToolStart(0, "call_x", "f\udc80"),
                             ToolArgs(0, '{"k":"\udcff'), fin])
    out.append(wire(api, c, stream=False).body(fin))
    out += wire(api, c).error_frames(bad)
    out.append(error_body(api, bad))
    for s in out:
        s.encode("utf-8")                     # would raise on any surviving surrogate
    assert "a\ufffd\U0001F600b\ufffd" in "".join(out)
    assert clean(bad) == "a\ufffd\U0001F600b\ufffd"
    assert dumps({"k": "\n\x01\"\\/é"}) == '{"k":"\\n\\u0001\\"\\\\/é"}'


def visible_text(api, got) -> str:
    """The text a client of `api` shows, from parsed frames."""
    out = []
    for _, d in got:
        if d == "[DONE]":
            continue
        if api == "openai_chat" and d["choices"]:
            out.append(d["choices"][0]["delta"].get("content", ""))
        elif api == "openai_completions" and d["choices"]:
            out.append(d["choices"][0]["text"])
        elif api == "responses" and d["type"] == "response.output_text.delta":
            out.append(d["delta"])
        elif api == "anthropic" and d["type"] == "content_block_delta" \
                and d["delta"]["type"] == "text_delta":
            out.append(d["delta"]["text"])
    return "".join(out)


@pytest.mark.parametrize("api", ["openai_chat", "openai_completions", "responses", "anthropic"])
def test_recovered_text_tail_every_api(api):
    raw = "Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke>oops"
    got = parse(run(wire(api), [BEGIN, Text("Check"), Text("ing."), Finish("stop", raw, None, (), USAGE)]))
    assert visible_text(api, got) == raw
    if api == "responses":
        done = [d["item"] for _, d in got if d["type"] == "response.output_item.done"]
        assert done[0]["content"][0]["text"] == raw
        assert got[-1][1]["response"]["output"] == done


@pytest.mark.parametrize("api", ["openai_chat", "openai_completions", "responses", "anthropic"])
def test_failure_mid_stream(api):
    w = wire(api)
    frames = run(w, [BEGIN, Text("a"), Failure("backend died")])
    name, _ = parse(frames[-1:])[0]
    assert name == "error" and "backend died" in frames[-1]
    assert w.frames(Finish("stop", "a", None, (), USAGE)) == []
