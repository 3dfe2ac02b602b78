"""Raw chat conversations to token ids and labels with a tokenizer's chat template.

Only assistant turns are supervised: every other token (system and user turns, the template's
role headers, the generation prompt that opens an assistant turn) gets label ``-100``. An
assistant turn is supervised from the end of its generation prompt up to where the next message
would start, so its content and the template's end-of-turn tokens are learned (the model learns to
stop).

Two ways to find the assistant tokens:
- a template with ``{% generation %}`` markers: transformers' ``return_assistant_tokens_mask``;
- any other template: the conversation is rendered once whole and once per assistant turn as a
  prefix (``messages[:i]`` with the generation prompt, then ``messages[: i + 1]``); the character
  span between the two prefixes is the turn, and tokens overlapping it (by the fast tokenizer's
  offsets on the whole text) are supervised. This needs a template that renders earlier turns
  the same way whatever follows; one that does not (for example one that strips reasoning from
  earlier turns) is refused with an error rather than masked wrongly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_skrull.data.dataset import IGNORE_INDEX

ASSISTANT_ROLE = "assistant"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def check_chat_tokenizer(tokenizer: Any) -> None:
    """Raises when ``tokenizer`` cannot tokenise chat data with label masking."""
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise TypeError(
            f"tokenizer must be a Hugging Face tokenizer with apply_chat_template, got "
            f"{type(tokenizer).__name__}; pass AutoTokenizer.from_pretrained(<model>)."
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer {type(tokenizer).__name__} has no chat_template, so chat data cannot be "
            "tokenised. Set tokenizer.chat_template to a Jinja template, or give pre-tokenised "
            'samples {"input_ids": [...], "labels": [...]}.'
        )
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"Chat label masking needs a fast tokenizer (character offsets), got "
            f"{type(tokenizer).__name__}; load it with AutoTokenizer.from_pretrained(<model>, "
            "use_fast=True) or pre-tokenise the data."
        )


def _check_messages(messages: object, where: str) -> list[Mapping[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(
            f"{where}: 'messages' must be a non-empty list of "
            f'{{"role": ..., "content": ...}} dicts, got {messages!r:.80}.'
        )
    for turn, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(
                f"{where}: messages[{turn}] = {message!r:.80} is not a dict with a 'role'; every "
                'message must look like {"role": "user", "content": "..."}.'
            )
    if messages[0]["role"] == ASSISTANT_ROLE:
        raise ValueError(
            f"{where}: the conversation starts with an assistant message, so it has no prompt to "
            "learn from; start it with a system or user message."
        )
    return list(messages)


def tokenize_chat(
    messages: object,
    tokenizer: Any,
    *,
    where: str = "sample",
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """Tokenises one conversation and masks everything but the assistant turns.

    Args:
        messages: ``[{"role": ..., "content": ...}, ...]``.
        tokenizer: a fast Hugging Face tokenizer with a ``chat_template``
            (checked by :func:`check_chat_tokenizer`).
        where: names the sample in error messages.
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template``
            (for example ``tools`` or template variables).

    Returns:
        ``(input_ids, labels)``: labels equal the ids on assistant tokens and ``-100`` elsewhere.

    Raises:
        ValueError: malformed messages, or a template that renders earlier turns differently
            once later turns follow.
    """
    messages = _check_messages(messages, where)
    kwargs = dict(chat_template_kwargs or {})
    if _GENERATION_TAG.search(tokenizer.chat_template):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
        ids = list(out["input_ids"])
        labels = [
            t if m else IGNORE_INDEX for t, m in zip(ids, out["assistant_masks"], strict=True)
        ]
        return ids, labels

    def render(conversation: list[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    text = render(messages, False)
    spans: list[tuple[int, int]] = []
    for turn, message in enumerate(messages):
        if message["role"] != ASSISTANT_ROLE:
            continue
        before = render(messages[:turn], True)
        through = render(messages[: turn + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                f"{where}: the chat template does not render turns 0..{turn - 1} the same once "
                f"assistant turn {turn} follows, so its tokens cannot be located. Add "
                "{% generation %} ... {% endgeneration %} around assistant content in the template "
                "(transformers then marks the assistant tokens), or pre-tokenise the data with your "
                "own labels."
            )
        spans.append((len(before), len(through)))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    labels = [IGNORE_INDEX] * len(ids)
    span = 0
    for position, (start, end) in enumerate(encoding["offset_mapping"]):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0] or (start == end and start >= spans[span][0]):
            labels[position] = ids[position]
    return ids, labels
