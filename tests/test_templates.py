"""Assistant-only loss masks for real chat templates: decode the masked tokens of every reply and
compare them with the reply text + its end-of-turn token, exactly.

Templates are the public ones (tool branches left out), set on a copy of the SmolLM2 tokenizer with
their special tokens added; none of them has `{% generation %}` markers."""

from __future__ import annotations

import copy

import pytest

from eagle_train.data_prep.templates import TemplateError, reply_spans, tokenize_conversation

QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# Llama-3.1: always a system header with the knowledge/today dates, the system prompt inside it
LLAMA31 = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

# Mistral-7B-Instruct-v0.1: no generation prompt, no system role, roles must alternate
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

# later Mistral templates: the system prompt goes into the LAST user turn, so rendering a prefix of
# the conversation is not a prefix of the full rendering
MISTRAL_SYS_LAST = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}{{- bos_token }}"
    "{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.index0 == ns.last_user and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}{%- endif %}"
    "{%- endfor %}")

# Vicuna v1.1: plain-text role names (no special tokens around the reply start)
VICUNA = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set sys = 'A chat between a curious user and an artificial "
    "intelligence assistant. The assistant gives helpful, detailed, and polite answers to the user\\'s questions.' %}"
    "{% set loop_messages = messages %}{% endif %}{{ bos_token + sys + ' ' }}{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")

# name -> (template, added special tokens, bos, eos, expected masked text of a reply)
TEMPLATES = {
    "smollm2": (None, [], None, None, lambda c: c + "<|im_end|>"),
    "qwen2.5": (QWEN25, [], None, None, lambda c: c + "<|im_end|>"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", lambda c: c.strip() + "<|eot_id|>"),
    "llama3.1": (LLAMA31, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                 "<|begin_of_text|>", "<|eot_id|>", lambda c: c.strip() + "<|eot_id|>"),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", lambda c: c + "</s>"),
    "mistral-sys-last": (MISTRAL_SYS_LAST, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>",
                         lambda c: " " + c.strip() + "</s>"),
    "vicuna": (VICUNA, ["<s>", "</s>"], "<s>", "</s>", lambda c: " " + c + "</s>"),
}

SYSTEM = "You are a terse assistant. Answer in one line."
CONVERSATIONS = [
    # multi-turn; a reply equal to the user's text; unicode; replies starting with punctuation/digits
    [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes"},
     {"role": "user", "content": "Yes"}, {"role": "assistant", "content": "Yes"},
     {"role": "user", "content": "2+2? Answer with a number."}, {"role": "assistant", "content": "4, obviously 🙂"}],
    [{"role": "user", "content": "Write a list:\n- a\n- b"},
     {"role": "assistant", "content": "(1) apples — green\n(2) pears\n\n```python\nprint('hi')\n```"}],
    # a reply with trailing whitespace (Llama templates trim it)
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?\n\n"},
     {"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Why did the chicken cross?"}],
]


@pytest.fixture(scope="module")
def tokenizers(smollm2_tokenizer):
    toks = {}
    for name, (template, specials, bos, eos, _) in TEMPLATES.items():
        tok = copy.deepcopy(smollm2_tokenizer)
        if template is not None:
            tok.add_tokens(specials, special_tokens=True)
            tok.chat_template = template
            if bos:
                tok.bos_token = bos
            if eos:
                tok.eos_token = eos
        toks[name] = tok
    return toks


def masked_runs(tok, ids, mask):
    """Decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def _with_system(conv, name):
    return conv if name == "mistral" else [{"role": "system", "content": SYSTEM}] + conv


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("system", [False, True])
def test_mask_is_exactly_the_replies(tokenizers, name, system):
    tok, expect = tokenizers[name], TEMPLATES[name][4]
    for conv in CONVERSATIONS:
        msgs = _with_system(conv, name) if system else conv
        out = tokenize_conversation(tok, msgs)
        assert len(out["input_ids"]) == len(out["loss_mask"]) and not out["truncated"]
        replies = [m["content"] for m in msgs if m["role"] == "assistant"]
        assert masked_runs(tok, out["input_ids"], out["loss_mask"]) == [expect(r) for r in replies]
        # the unmasked rest is the prompt side: it decodes to the full text minus the replies
        full = tok.decode(out["input_ids"])
        rest = tok.decode([i for i, m in zip(out["input_ids"], out["loss_mask"]) if not m])
        assert len(rest) == len(full) - sum(len(expect(r)) for r in replies)
        # the system prompt (given or the template's default) is in the text but never masked
        assert (SYSTEM in full) == (system and name != "mistral")
        assert not any(s in run for run in masked_runs(tok, out["input_ids"], out["loss_mask"])
                       for s in (SYSTEM, "SmolLM", "Qwen, created", "Cutting Knowledge", "curious user"))


def test_default_system_prompts_are_rendered(tokenizers):
    conv = CONVERSATIONS[0]
    assert "You are a helpful AI assistant named SmolLM" in reply_spans(tokenizers["smollm2"], conv)[0]
    assert "You are Qwen, created by Alibaba Cloud" in reply_spans(tokenizers["qwen2.5"], conv)[0]
    assert "Cutting Knowledge Date" in reply_spans(tokenizers["llama3.1"], conv)[0]


def test_prefix_inconsistent_template_still_finds_replies(tokenizers):
    tok = tokenizers["mistral-sys-last"]
    msgs = _with_system(CONVERSATIONS[0], "mistral-sys-last")
    text, spans = reply_spans(tok, msgs)
    # the system prompt sits in the last user turn, after the first two replies
    assert text.index(SYSTEM) > spans[1][1]
    assert [text[b:e] for b, e in spans] == [" Yes", " Yes", " 4, obviously 🙂"]
    # the reply "Yes" after a user turn "Yes" is the reply, not the user's text
    assert text[spans[1][0] - len("[/INST]"):spans[1][0]] == "[/INST]"


def test_token_straddling_header_and_reply_is_masked(tokenizers):
    # "assistant\n" + "  Hi": byte-level BPE makes one token of "\n " (header newline + a reply space).
    # The model has to predict it to start the reply, so it is masked; the rest of the header is not.
    tok = tokenizers["smollm2"]
    msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "  Hi!"}]
    out = tokenize_conversation(tok, msgs)
    assert masked_runs(tok, out["input_ids"], out["loss_mask"]) == ["\n  Hi!<|im_end|>"]


def test_truncation(tokenizers):
    tok = tokenizers["smollm2"]
    msgs = CONVERSATIONS[1]
    full = tokenize_conversation(tok, msgs)
    n = len(full["input_ids"]) - 5
    out = tokenize_conversation(tok, msgs, max_length=n)
    assert out["truncated"] and len(out["input_ids"]) == len(out["loss_mask"]) == n
    assert out["input_ids"] == full["input_ids"][:n] and out["loss_mask"] == full["loss_mask"][:n]
    assert not tokenize_conversation(tok, msgs, max_length=len(full["input_ids"]))["truncated"]


@pytest.mark.parametrize("name", ["smollm2", "llama3.1", "mistral-sys-last", "vicuna"])
def test_truncated_long_conversation_matches_the_full_tokenization(tokenizers, name):
    # long chats are tokenized only up to a special token past the budget: the kept tokens and mask
    # must be exactly those of the full tokenization
    tok = tokenizers[name]
    msgs = []
    for i in range(40):
        msgs += [{"role": "user", "content": f"Question {i}: why is the sky blue? " * (1 + i % 3)},
                 {"role": "assistant", "content": f"Answer {i}: Rayleigh scattering. " * (2 + i % 4)}]
    full = tokenize_conversation(tok, msgs)
    assert len(full["input_ids"]) > 1500
    for n in (50, 333, 700, len(full["input_ids"]) - 1, len(full["input_ids"])):
        out = tokenize_conversation(tok, msgs, max_length=n)
        assert out["input_ids"] == full["input_ids"][:n] and out["loss_mask"] == full["loss_mask"][:n]
        assert out["truncated"] == (n < len(full["input_ids"]))


def test_template_errors_have_reasons(tokenizers):
    # Mistral v0.1 refuses non-alternating roles
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(TemplateError) as err:
        tokenize_conversation(tokenizers["mistral"], msgs)
    assert err.value.reason == "template_error" and "alternate" in str(err.value)
    # a template that rewrites replies cannot be masked by text search
    tok = copy.deepcopy(tokenizers["smollm2"])
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | upper"
                         " + '<|im_end|>\\n' }}{% endfor %}")
    with pytest.raises(TemplateError) as err:
        tokenize_conversation(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    assert err.value.reason == "template_mismatch"
