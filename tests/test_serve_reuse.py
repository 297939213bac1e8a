"""`ds4-agent --serve`, exact DSML replay and the disk prefix cache, through the official SDKs.

The model's tool block is forced to bytes that the canonical renderer would NOT produce (a JSON
parameter written with spaces), so it shows which bytes the next prompt carries: with exact
replay (protocol.md §6.2) the sampled block, found again by tool id, and the whole previous turn
is reused from the KV; without it the client's JSON re-rendered canonically, and reuse stops where
the bytes differ. Across a restart the block and the KV come back from the disk cache
(kvcache.md §4-5): the live session is saved at shutdown with its tool-id trailer.
"""
from __future__ import annotations

import contextlib
import json

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

import prompts  # noqa: E402
from ds4agent.serve import ServeConfig, ServerThread, Shim  # noqa: E402
from helpers_serve import Server  # noqa: E402
from sessions.kvfile import read_info  # noqa: E402

CAP = 128
N = 4
ARGS_JSON = '{"where":{"city":"Paris"}}'
CANON = prompts.render_tool_calls([prompts.ToolCall(None, "get_weather", ARGS_JSON)])
# what a model may well sample: the JSON parameter with spaces (parses to the same arguments)
SAMPLED = CANON.replace('string="false">{"city":"Paris"}<', 'string="false">{ "city": "Paris" }<')
RESULT = "sunny, 21 C"
SCHEMA = {"type": "object", "properties": {"where": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                "parameters": SCHEMA}}]
ANTH_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}]
RESP_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": SCHEMA}]
SYSTEM = "You check the weather."


def test_blocks_differ():
    assert SAMPLED != CANON and SAMPLED.startswith("\n\n<｜DSML｜tool_calls>")
    parsed = prompts.parse_output(SAMPLED, "none")
    assert [(c.name, c.arguments_json) for c in parsed.tool_calls] == [("get_weather", ARGS_JSON)]
    assert parsed.dsml == SAMPLED


@contextlib.contextmanager
def serving(engine, tmp_path, name: str, **kw):
    trace = tmp_path / f"{name}.jsonl"
    shim = Shim(engine, ServeConfig(ctx=8192, max_tokens=CAP, trace=str(trace), **kw))
    with ServerThread(shim) as url:
        yield Server(shim, url, one_record_each=False)
    # leaving the block stopped the shim: the shutdown moment has passed
    assert not shim.worker._forced


def disk_cfg(d) -> dict:
    return dict(kv_disk_dir=str(d), kv_cache_min_tokens=16, kv_cache_boundary_align_tokens=0,
                kv_cache_boundary_trim_tokens=0, kv_cache_cold_max_tokens=4096)


# ------------------------------------------------------------------------------------------
# per-API turn 1 (a forced tool call) and turn 2 (the tool result), each as its client sends it

def turn1(s: Server, api: str) -> dict:
    s.worker.force(SAMPLED)
    if api == "chat":
        r = s.oc.chat.completions.create(
            model="m", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paris?"}],
            tools=CHAT_TOOLS, temperature=0, extra_body={"thinking": False})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls"
        tc = c.message.tool_calls[0]
        out = dict(id=tc.id, name=tc.function.name, args=json.loads(tc.function.arguments),
                   raw_args=tc.function.arguments, p=r.usage.prompt_tokens, c=r.usage.completion_tokens,
                   reply=r)
    elif api == "anthropic":
        m = s.ac.messages.create(model="m", max_tokens=CAP, system=SYSTEM,
                                 messages=[{"role": "user", "content": "Paris?"}], tools=ANTH_TOOLS,
                                 thinking={"type": "disabled"}, extra_body={"temperature": 0})
        assert m.stop_reason == "tool_use"
        tu = [b for b in m.content if b.type == "tool_use"][0]
        u = m.usage
        out = dict(id=tu.id, name=tu.name, args=tu.input, raw_args=None,
                   p=u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens,
                   c=u.output_tokens, reply=m)
    else:
        r = s.oc.responses.create(model="m", instructions=SYSTEM, input=[{"role": "user", "content": "Paris?"}],
                                  tools=RESP_TOOLS, reasoning={"effort": "none"}, temperature=0)
        assert r.status == "completed"
        fc = [o for o in r.output if o.type == "function_call"][0]
        out = dict(id=fc.call_id, name=fc.name, args=json.loads(fc.arguments), raw_args=fc.arguments,
                   p=r.usage.input_tokens, c=r.usage.output_tokens, reply=r)
    rec = out["rec"] = s.last()
    assert rec["output"] == SAMPLED and out["name"] == "get_weather"
    assert out["args"] == {"where": {"city": "Paris"}}
    if out["raw_args"] is not None:
        assert out["raw_args"] == ARGS_JSON          # compact re-serialization, DSML order (§7.1)
    assert out["c"] == len(s.shim.engine.tokenizer.encode(SAMPLED))
    return out


def turn2(s: Server, api: str, t1: dict) -> dict:
    """Returns the trace record plus usage as (prompt, cached, completion)."""
    before = s.evaluated()
    if api == "chat":
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paris?"},
                t1["reply"].choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": t1["id"], "content": RESULT}]
        r = s.oc.chat.completions.create(model="m", messages=msgs, tools=CHAT_TOOLS, max_tokens=N,
                                         temperature=0, extra_body={"thinking": False})
        u = r.usage
        usage = (u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens)
    elif api == "anthropic":
        m = t1["reply"]
        msgs = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": t1["id"], "content": RESULT}]}]
        m2 = s.ac.messages.create(model="m", max_tokens=N, system=SYSTEM, messages=msgs, tools=ANTH_TOOLS,
                                  thinking={"type": "disabled"}, extra_body={"temperature": 0})
        u = m2.usage
        usage = (u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens,
                 u.cache_read_input_tokens, u.output_tokens)
    else:
        items = [{"role": "user", "content": "Paris?"}] + \
            [o.model_dump(exclude_none=True) for o in t1["reply"].output] + \
            [{"type": "function_call_output", "call_id": t1["id"], "output": RESULT}]
        r = s.oc.responses.create(model="m", instructions=SYSTEM, input=items, tools=RESP_TOOLS,
                                  max_output_tokens=N, reasoning={"effort": "none"}, temperature=0)
        assert r.status in ("completed", "incomplete")
        u = r.usage
        usage = (u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens)
    rec = s.last()
    prompt, cached, completion = usage
    assert rec["status"] == 200
    assert (rec["prompt_tokens"], rec["cached"], rec["gen_tokens"]) == usage
    assert 0 < completion <= N
    # only the uncached suffix was evaluated
    assert s.evaluated() - before == (prompt - cached) + completion
    assert f"<tool_result>{RESULT}</tool_result>" in rec["prompt_text"]
    return dict(rec, usage=usage)


# ------------------------------------------------------------------------------------------
# exact replay in memory

def test_exact_replay_reuses_the_whole_tool_turn(agent_engine, tmp_path):
    with serving(agent_engine, tmp_path, "on") as s:
        t1 = turn1(s, "chat")
        assert s.worker.memory.get(t1["id"]) == SAMPLED
        rec = turn2(s, "chat", t1)
    # the prompt carries the sampled bytes, so the live KV is a token prefix of it
    assert SAMPLED + prompts.EOS in rec["prompt_text"] and CANON not in rec["prompt_text"]
    assert rec["source"] == "memory-token"
    assert rec["cached"] == t1["p"] + t1["c"]


@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
def test_without_exact_replay_the_block_is_canonical(agent_engine, tmp_path, api):
    with serving(agent_engine, tmp_path, "off", exact_replay=False) as s:
        assert s.worker.memory is None
        t1 = turn1(s, api)
        rec = turn2(s, api, t1)
    assert CANON + prompts.EOS in rec["prompt_text"] and SAMPLED not in rec["prompt_text"]
    if api == "responses":
        # Responses never canonicalizes: the trailing tool outputs answer the live call ids, so
        # the live session (sampled block) is extended with the tool-result tail (§7.2 step 2)
        assert not t1["rec"].get("canonicalized")
        assert rec["source"] == "responses-tool-output"
        assert rec["cached"] == t1["p"] + t1["c"]
    else:
        # chat / Anthropic: after the tool-call turn the live timeline was brought to the canonical
        # rendering + EOS (§6.3), so the next request continues it token for token
        assert t1["rec"].get("canonicalized") is True
        assert rec["source"] == "memory-token"
        canon = len(s.shim.engine.tokenizer.encode(CANON + prompts.EOS))
        assert rec["cached"] == t1["p"] + canon


# ------------------------------------------------------------------------------------------
# exact replay across a restart, from the disk cache

@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
def test_exact_replay_survives_restart(agent_engine, tmp_path, api):
    d = tmp_path / "kv"
    with serving(agent_engine, tmp_path, "first", **disk_cfg(d)) as s:
        t1 = turn1(s, api)
        cache = s.worker.cache
    # the shutdown moment saved the whole live session with its tool map
    files = {e.path: read_info(e.path) for e in cache.entries()}
    full = [i for i in files.values() if i.tokens == t1["p"] + t1["c"]]
    assert len(full) == 1, [(i.tokens, i.header.reason_name) for i in files.values()]
    info = full[0]
    assert info.header.reason_name == "shutdown"
    assert info.tool_map == {t1["id"]: SAMPLED}
    if api == "responses":
        assert info.header.key_kind == "responses-visible"
    # a cold save of the stable prefix (tools + system) was made on the way
    assert any(i.header.reason_name == "cold" and i.tokens < t1["p"] for i in files.values())

    with serving(agent_engine, tmp_path, "second", **disk_cfg(d)) as s:
        assert t1["id"] not in s.worker.memory and s.worker.session.pos == 0
        rec = turn2(s, api, t1)
        assert s.worker.memory.source(t1["id"]) == "disk"
        assert s.worker.memory.get(t1["id"]) == SAMPLED
    assert SAMPLED + prompts.EOS in rec["prompt_text"] and CANON not in rec["prompt_text"]
    assert rec["source"] == "disk-text"
    assert rec["cached"] == t1["p"] + t1["c"]

    if api != "chat":
        return
    # the same request to a shim without exact replay: canonical bytes, only the stable prefix
    # comes from disk
    with serving(agent_engine, tmp_path, "third", exact_replay=False, **disk_cfg(d)) as s:
        rec = turn2(s, "chat", t1)
    assert CANON + prompts.EOS in rec["prompt_text"] and SAMPLED not in rec["prompt_text"]
    assert rec["source"] == "disk-text"
    assert 0 < rec["cached"] < t1["p"]


@pytest.mark.slow
def test_restart_without_disk_cache_is_cold(agent_engine, tmp_path):
    """Control: the same two turns across a restart with no disk folder reuse nothing, and the
    block is rendered canonically (the id is unknown to the new shim)."""
    with serving(agent_engine, tmp_path, "a") as s:
        t1 = turn1(s, "chat")
    with serving(agent_engine, tmp_path, "b") as s:
        rec = turn2(s, "chat", t1)
        assert t1["id"] not in s.worker.memory
    assert rec["source"] == "cold" and rec["cached"] == 0
    assert CANON in rec["prompt_text"] and SAMPLED not in rec["prompt_text"]


def test_alternating_conversations_come_back_from_disk(agent_engine, tmp_path):
    """Conversation B replaces A in the one live session; A's saved KV (the evict moment: saved
    whole before the live timeline was cut back) serves A's next turn from disk, in-process."""
    with serving(agent_engine, tmp_path, "alt", **disk_cfg(tmp_path / "kv")) as s:
        t1 = turn1(s, "chat")
        r = s.oc.chat.completions.create(
            model="m", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Other topic."}],
            tools=CHAT_TOOLS, max_tokens=N, temperature=0, extra_body={"thinking": False})
        rb = s.last()
        # B shares the tools + system prefix with A, and nothing after it
        assert rb["source"] == "memory-prefix" and 0 < rb["cached"] < t1["p"]
        assert r.usage.prompt_tokens_details.cached_tokens == rb["cached"]
        evicted = [e for e in s.worker.cache.entries() if e.header.reason_name == "evict"]
        assert [e.tokens for e in evicted] == [t1["p"] + t1["c"]]
        rec = turn2(s, "chat", t1)
    assert rec["source"] == "disk-text" and rec["cached"] == t1["p"] + t1["c"]
    assert SAMPLED + prompts.EOS in rec["prompt_text"]


def test_parallel_calls_after_text_share_one_replayed_block(agent_engine, tmp_path):
    """Text, then two calls in one block, streamed: the text arrives without the block's leading
    blank line, both ids map to the one sampled block, and resending both results reuses it all."""
    two = prompts.render_tool_calls([prompts.ToolCall(None, "get_weather", '{"where":{"city":"Paris"}}'),
                                     prompts.ToolCall(None, "get_weather", '{"where":{"city":"Rome"}}')])
    sampled = "Checking both." + two.replace('{"city":', '{ "city": ')
    msgs = [{"role": "user", "content": "Paris and Rome?"}]
    kw = dict(model="m", tools=CHAT_TOOLS, temperature=0, extra_body={"thinking": False})
    with serving(agent_engine, tmp_path, "par") as s:
        s.worker.force(sampled)
        content, calls, finish, p1, c1 = "", {}, None, None, None
        for ch in s.oc.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True},
                                               **kw):
            if ch.usage is not None:
                p1, c1 = ch.usage.prompt_tokens, ch.usage.completion_tokens
            if not ch.choices:
                continue
            content += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
            for tc in ch.choices[0].delta.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] = (tc.function.name if tc.function else None) or slot["name"]
                slot["arguments"] += (tc.function.arguments if tc.function else None) or ""
        s.last()
        assert content == "Checking both." and finish == "tool_calls"
        assert [json.loads(calls[i]["arguments"]) for i in (0, 1)] == [{"where": {"city": "Paris"}},
                                                                       {"where": {"city": "Rome"}}]
        ids = [calls[0]["id"], calls[1]["id"]]
        assert len(set(ids)) == 2
        block = sampled[len("Checking both."):]
        assert [s.worker.memory.get(i) for i in ids] == [block, block]
        msgs += [{"role": "assistant", "content": content,
                  "tool_calls": [{"id": calls[i]["id"], "type": "function",
                                  "function": {"name": calls[i]["name"], "arguments": calls[i]["arguments"]}}
                                 for i in (0, 1)]},
                 {"role": "tool", "tool_call_id": ids[0], "content": "sunny"},
                 {"role": "tool", "tool_call_id": ids[1], "content": "rain"}]
        before = s.evaluated()
        r2 = s.oc.chat.completions.create(messages=msgs, max_tokens=N, **kw)
        rec = s.last()
        u = r2.usage
        assert s.evaluated() - before == u.prompt_tokens - u.prompt_tokens_details.cached_tokens + u.completion_tokens
    assert sampled + prompts.EOS + "<｜User｜><tool_result>sunny</tool_result><tool_result>rain</tool_result>" \
        in rec["prompt_text"]
    assert rec["source"] == "memory-token" and u.prompt_tokens_details.cached_tokens == p1 + c1
