"""Render a conversation with the target's own chat template and build the assistant-only loss mask.

Most chat templates have no `{% generation %}` markers, so the mask is found from the rendered text:
1. render the whole conversation once (the tokens we train on);
2. locate each assistant reply in that text: render the conversation up to the reply with the
   generation prompt; when the template is prefix-consistent the reply starts right there, otherwise
   (e.g. templates that move the system prompt into the last user turn) search for it after the
   preceding user turn;
3. tokenize with offset mappings and mask every token overlapping a reply, plus the end-of-turn
   token that closes it (the first special token after the reply, e.g. <|im_end|>, <|eot_id|>, </s>;
   whitespace between the reply and it is included too).
Role headers, user turns and the system prompt (given or the template's default) stay unmasked.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple


class TemplateError(ValueError):
    """The template could not render the conversation, or a reply is not in the rendered text."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def render(tok, messages: List[Dict[str, str]], add_generation_prompt: bool = False) -> str:
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as err:  # jinja `raise_exception` (roles must alternate, ...) and render errors
        raise TemplateError("template_error", f"{type(err).__name__}: {err}") from None
    return text if isinstance(text, str) else text[0]


def _find(text: str, content: str, start: int) -> Tuple[int, int]:
    """(begin, end) of `content` in `text` at or after `start`; templates often strip/trim replies."""
    for needle in (content, content.strip()):
        i = text.find(needle, start)
        if i >= 0:
            return i, i + len(needle)
    return -1, -1


def reply_spans(tok, messages: List[Dict[str, str]], text: Optional[str] = None,
                stop: Optional[int] = None) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant reply in it
    (only the replies starting before character `stop`, when given)."""
    text = render(tok, messages) if text is None else text
    stop = len(text) if stop is None else stop
    spans, cursor = [], 0
    for k, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        if cursor >= stop:
            break
        prefix = render(tok, messages[:k], add_generation_prompt=True)
        if len(prefix) >= stop and text.startswith(prefix):
            break
        if text.startswith(prefix) and len(prefix) >= cursor:
            begin, end = _find(text, msg["content"], len(prefix))
            # everything after the generation prompt is the model's to generate (e.g. the space in
            # "[/INST] 4"); only whitespace may sit between the prompt and the reply
            if begin >= 0:
                begin = len(prefix) if not text[len(prefix):begin].strip() else -1
        else:
            # prefix-inconsistent template: step over the user turn first so a short reply is not
            # matched inside it
            user = messages[k - 1]["content"]
            ub, ue = _find(text, user, cursor) if user.strip() else (-1, -1)
            begin, end = _find(text, msg["content"], ue if ub >= 0 else cursor)
            # a space the template puts before the reply is generated with it (newlines belong to headers)
            while begin > max(cursor, ue) and text[begin - 1] == " ":
                begin -= 1
        if begin < 0:
            raise TemplateError("template_mismatch", f"assistant turn {k} is not in the rendered text "
                                                     "(the template rewrites replies)")
        spans.append((begin, end))
        cursor = end
    return text, spans


def special_ids(tok) -> set:
    ids = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return ids | set(tok.all_special_ids)


def _cut(tok, text: str, max_length: Optional[int], specials: set) -> int:
    """Where to stop tokenizing a conversation that will be truncated anyway: right before a special
    token past ~6 characters per token of budget. Tokenizers split special tokens out before anything
    else, so every token before that point is the same as in the full tokenization."""
    want = None if max_length is None else 6 * max_length
    if want is None or len(text) <= want:
        return len(text)
    strings = tuple(sorted(tok.convert_ids_to_tokens(sorted(specials)), key=len, reverse=True))
    m = re.compile("|".join(map(re.escape, strings))).search(text, want) if strings else None
    return m.start() if m else len(text)


def tokenize_conversation(tok, messages: List[Dict[str, str]], max_length: Optional[int] = None,
                          specials: Optional[set] = None) -> Dict[str, object]:
    """{input_ids, loss_mask, truncated}; loss_mask is 1 on assistant reply tokens incl. end-of-turn."""
    specials = special_ids(tok) if specials is None else specials
    text = render(tok, messages)
    cut = _cut(tok, text, max_length, specials)
    # the template writes its own BOS (if any), so the tokenizer must not add another
    enc = tok(text[:cut], add_special_tokens=False, return_offsets_mapping=True)
    if cut < len(text) and len(enc["input_ids"]) <= max_length:  # denser text than guessed: all of it
        cut = len(text)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    text, spans = reply_spans(tok, messages, text, stop=cut)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    t = 0
    for begin, end in spans:
        while t < len(ids) and offsets[t][1] <= begin:
            t += 1
        # tokens overlapping the reply
        while t < len(ids) and offsets[t][0] < end:
            mask[t] = 1
            t += 1
        # the end-of-turn token closing it (with any whitespace before it)
        j = t
        while j < len(ids) and ids[j] not in specials and not text[offsets[j][0]:offsets[j][1]].strip():
            j += 1
        if j < len(ids) and ids[j] in specials:
            for i in range(t, j + 1):
                mask[i] = 1
            t = j + 1
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask, "truncated": truncated}
