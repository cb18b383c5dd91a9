"""The ChatML chat template with Hermes/Qwen-style tools that ctxrl's tiny models ship with.

It follows the layout of Qwen2.5's template (tools listed inside ``<tools></tools>`` in the
system turn; calls as ``<tool_call>{json}</tool_call>``; consecutive tool results grouped in one
``user`` turn as ``<tool_response>…</tool_response>``), so code trained against the tiny model
serves a real Qwen checkpoint unchanged. It is written for ctxrl, not copied.

Assistant messages in ctxrl keep their raw sampled text (tool-call blocks included) in
``content``; the template prints ``content`` as is and only renders ``tool_calls`` when the
content does not already contain them.
"""

def turns_template(start: str, end: str, *, assistant: str = "assistant", bos: bool = False) -> str:
    """The template below with other turn markers: each turn is ``{start}{role}\\n…{end}\\n``, the model's turns
    under the role ``assistant`` (``bos``: the tokenizer's ``bos_token`` opens the conversation)."""
    # HF renders templates with trim_blocks, so every newline is printed by an expression.
    return (
        ("{{ bos_token }}" if bos else "")
        + "{% if tools %}"
        f"{{{{ '{start}system\\n' }}}}"
        "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
        "{{ '# Tools\\n<tools>' }}"
        "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
        "{{ '\\n</tools>\\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."
        f"{end}\\n' }}}}"
        "{% elif messages[0].role == 'system' %}"
        f"{{{{ '{start}system\\n' + messages[0].content + '{end}\\n' }}}}"
        "{% endif %}"
        "{% for message in messages %}"
        "{% if message.role == 'system' %}"
        f"{{% if not loop.first %}}{{{{ '{start}system\\n' + message.content + '{end}\\n' }}}}{{% endif %}}"
        "{% elif message.role == 'user' %}"
        f"{{{{ '{start}user\\n' + message.content + '{end}\\n' }}}}"
        "{% elif message.role == 'assistant' %}"
        f"{{{{ '{start}{assistant}\\n' + message.content }}}}"
        "{% if message.tool_calls and '<tool_call>' not in message.content %}"
        "{% for call in message.tool_calls %}"
        "{{ '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": '"
        " + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
        "{% endfor %}"
        "{% endif %}"
        f"{{{{ '{end}\\n' }}}}"
        "{% elif message.role == 'tool' %}"
        f"{{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}}{{{{ '{start}user' }}}}{{% endif %}}"
        "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        f"{{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}}{{{{ '{end}\\n' }}}}{{% endif %}}"
        "{% endif %}"
        "{% endfor %}"
        f"{{% if add_generation_prompt %}}{{{{ '{start}{assistant}\\n' }}}}{{% endif %}}"
    )


CHATML_TOOLS_TEMPLATE = turns_template("<|im_start|>", "<|im_end|>")
GEMMA_TURNS_TEMPLATE = turns_template("<start_of_turn>", "<end_of_turn>", assistant="model", bos=True)
"""Gemma's turn markers (``<start_of_turn>`` / ``<end_of_turn>``, the model's turns as ``model``) in the layout
above, the system turn and the tools included, for a Gemma checkpoint that ships no template (the base
Gemma 3 270M GGUF: ``ctxrl.models.named``)."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Like Qwen2.5, the tool tags are single added (non-special) tokens: they survive decoding with
# ``skip_special_tokens=True`` and a model emits each in one step.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
