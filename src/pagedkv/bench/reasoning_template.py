"""A ChatML chat template of our own that strips reasoning the way Qwen3's does.

The generation prompt opens a think block (`<|im_start|>assistant\\n<think>\\n`),
as the templates of Qwen3's thinking models and of DeepSeek-R1 do, so every
answer starts as reasoning. An assistant turn of the current tool loop (after the
last user message) renders as it was generated; an earlier one loses its
`<think>` header and everything up to its last `</think>` (Qwen3's
`content.split('</think>')[-1]`). Tool results render as user turns wrapped in
`<tool_response>`, and do not start a new loop. The tests serve a tiny model
with it (`tiny_reasoning_dir` in `tests/fixtures_models.py`); it lives under
`bench/` for the planned `agent-reasoning` workload (not built yet).
"""

REASONING_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
    "{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] or '' -%}"
    "{%- if loop.index0 > ns.last_query -%}"
    "{{- '<|im_start|>assistant\n<think>\n' + content -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\n' + content.split('</think>')[-1].lstrip('\n') -}}"
    "{%- endif -%}"
    "{%- for call in m.get('tool_calls', []) -%}"
    "{{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\n<tool_response>\n' + m['content'] -}}"
    "{{- '\n</tool_response><|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n<think>\n' -}}{%- endif -%}"
)
