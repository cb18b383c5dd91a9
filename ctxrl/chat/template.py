"""The ChatML chat template with Hermes/Qwen-style tools that ctxrl's tiny models ship with.

It follows the layout of Qwen2.5's template (tools listed inside ``<tools></tools>`` in the
system turn; calls as ``<tool_call>{json}</tool_call>``; consecutive tool results grouped in one
``user`` turn as ``<tool_response>…</tool_response>``), so code trained against the tiny model
serves a real Qwen checkpoint unchanged. It is written for ctxrl, not copied.

Assistant messages in ctxrl keep their raw sampled text (tool-call blocks included) in
``content``; the template prints ``content`` as is and only renders ``tool_calls`` when the
content does not already contain them.
"""

CHATML_TOOLS_TEMPLATE = (
    # HF renders templates with trim_blocks, so every newline is printed by an expression.
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% if not loop.first %}{{ '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% elif message.role == 'user' %}"
    "{{ '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{% elif message.role == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' + message.content }}"
    "{% if message.tool_calls and '<tool_call>' not in message.content %}"
    "{% for call in message.tool_calls %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": '"
    " + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Like Qwen2.5, the tool tags are single added (non-special) tokens: they survive decoding with
# ``skip_special_tokens=True`` and a model emits each in one step.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
