"""Chat templates in the styles of the families' instruct checkpoints (written here, not copied
from them: the formats are what matter), each using what its family's real template uses:
bos_token and eos_token, a system prompt folded into the first turn or a header, roles checked
with raise_exception, strftime_now, trim, namespace(). tests/test_families.py renders them with
pdqueue's tokenizer and with transformers' ``apply_chat_template``, which must agree.
"""

LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

CHATML = (   # Qwen2.5 / Qwen3: a default system prompt when the chat has none
    "{%- for message in messages %}"
    "{%- if loop.first and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

GEMMA = (   # no system role: it is folded into the first user turn; roles must alternate
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

MISTRAL = (
    "{{- bos_token }}{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] + '\\n\\n' %}"
    "{%- elif message['role'] == 'user' %}{{- '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    "{%- set ns.system = '' %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user, system and assistant roles are supported!') }}{%- endif %}"
    "{%- endfor %}")

PHI3 = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")

TEMPLATES = {"llama": LLAMA3, "qwen": CHATML, "gemma": GEMMA, "mistral": MISTRAL, "phi3": PHI3}

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "  Capital of Italy? "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about KV caches."}],
]
