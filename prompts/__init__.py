"""The prompt layer: messages and tools -> rendered text (special markers inline) -> tokens; model
output -> reasoning, text and DSML tool calls, whole or streaming.

Rendering and parsing follow ds4 byte for byte (spec/protocol.md §1-3); tokenizing the rendered
text is engine.Tokenizer's job. Nothing here touches arrays.
"""
from .dsml_block import Parsed, ParsedCall
from .dsml_parse import parse_output
from .dsml_render import render_tool_calls
from .dsml_stream import (DsmlStream, Event, ReasoningDelta, StreamError, TextDelta, ToolArgsDelta,
                          ToolCallEnd, ToolCallStart)
from .dsml_syntax import find_next_dsml_tool_block, thinking_enabled
from .errors import ContextLengthError, RequestError
from .messages import (Conversation, Message, ToolCall, from_anthropic, from_openai_chat,
                       from_openai_completions, from_responses)
from .render import (ASSISTANT, BOS, EOS, MARKERS, THINK_MAX_MIN_CONTEXT, THINK_MAX_PREFIX, USER,
                     Rendered, assistant_prefix, attach_replay, render_agent_tool_results,
                     render_completion, render_live_tool_tail, render_messages, render_request,
                     render_tool_results, think_mode_for_context, to_bytes)
from .tool_ids import ToolMemory, new_tool_id

__all__ = [
    "ASSISTANT", "BOS", "EOS", "MARKERS", "THINK_MAX_MIN_CONTEXT", "THINK_MAX_PREFIX", "USER",
    "ContextLengthError", "Conversation", "DsmlStream", "Event", "Message", "Parsed", "ParsedCall",
    "ReasoningDelta", "Rendered", "RequestError", "StreamError", "TextDelta", "ToolArgsDelta",
    "ToolCall", "ToolCallEnd", "ToolCallStart", "ToolMemory", "assistant_prefix", "attach_replay",
    "find_next_dsml_tool_block", "from_anthropic", "from_openai_chat", "from_openai_completions",
    "from_responses", "new_tool_id", "parse_output", "render_agent_tool_results", "render_completion",
    "render_live_tool_tail", "render_messages", "render_request", "render_tool_calls",
    "render_tool_results", "think_mode_for_context", "thinking_enabled", "to_bytes",
]
