"""Tool calling in the Hermes format (Qwen2.5 and many fine-tunes): calls are
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the model's text.

`prompt` renders tools and tool turns for chat templates that do not, `grammar` builds the
grammar that forces calls (tool_choice required or named), `parser` reads calls out of the
text as it streams. Everything here takes OpenAI's shapes as plain dicts.
"""
