"""Sample formats, and text and prompt-completion samples to token ids and labels.

A sample is one of (the keys decide; a dataset holds one format, pre-tokenised samples mix with
any):

- ``"tokens"``: ``{"input_ids": [...], "labels": [...]}`` (``labels`` optional), read as given;
- ``"messages"``: ``{"messages": [...]}``, a conversation (:mod:`lightning_skrull.data.chat`);
- ``"conversations"``: ``{"conversations": [{"from": ..., "value": ...}, ...]}``, a ShareGPT
  conversation, converted to messages
  (:func:`~lightning_skrull.data.chat.sharegpt_messages`);
- ``"text"``: ``{"text": "..."}``, language modelling: every token supervised;
- ``"prompt-completion"``: ``{"prompt": "...", "completion": "..."}``, only the completion
  supervised;
- ``"conversational prompt-completion"``: ``{"prompt": [messages], "completion": [messages]}``,
  rendered with the chat template, only the completion supervised
  (:func:`~lightning_skrull.data.chat.tokenize_chat_completion`).

The last three are TRL's SFTTrainer dataset types, tokenised as its SFTTrainer does by default
(``completion_only_loss`` on for prompt-completion data), so that the same data gives the same
tokens and labels:

- text: the tokenizer's ``eos_token`` is appended to the text (unless it already ends with it),
  and the text is tokenised with the tokenizer's special tokens (a BOS where the tokenizer adds
  one);
- prompt-completion: ``eos_token`` is appended to the completion (unless it already ends with
  it); ``prompt + completion`` is tokenised as one text (with special tokens) and so is the
  prompt alone; the completion starts where the two token sequences first differ. Usually that
  is the end of the prompt's tokens; when a token of the joint text straddles the boundary (a
  prompt ending in a space before a completion that starts with a word, for a BPE tokenizer),
  the completion starts at that token, which is then supervised, and a
  :class:`PromptBoundaryWarning` counts such samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from lightning_skrull.data.dataset import IGNORE_INDEX

SampleFormat = Literal[
    "tokens",
    "messages",
    "conversations",
    "text",
    "prompt-completion",
    "conversational prompt-completion",
]
"""The format of one sample, from its keys."""

ACCEPTED_FORMATS = (
    "{'input_ids': [...], 'labels': [...]} (labels optional), {'messages': [...]}, "
    "{'conversations': [{'from': ..., 'value': ...}]}, "
    "{'text': '...'}, {'prompt': '...', 'completion': '...'} or "
    "{'prompt': [messages], 'completion': [messages]}"
)
"""Every accepted format, for error messages."""

RAW_COLUMNS = ("messages", "conversations", "text", "prompt", "completion")
"""The keys (columns) of the formats that are tokenised here, not given as ``input_ids``."""


class PromptBoundaryWarning(UserWarning):
    """Warned once per dataset whose prompt-completion samples have a token that straddles the
    end of the prompt (the completion then starts at that token)."""


def sample_format(sample: Mapping[str, Any], where: str) -> SampleFormat:
    """The format of ``sample`` from its keys whose value is not ``None`` (``input_ids`` wins over
    any other). A null is an absent key: data exported from a mix of sources (JSON Lines written
    by ``datasets``) holds one wherever a sample lacks a column.

    Raises:
        ValueError: no known key, a ``prompt`` without ``completion`` (or the reverse), keys of
            two formats, or a prompt and a completion that are neither both strings nor both
            lists of messages.
    """
    if sample.get("input_ids") is not None:
        return "tokens"
    found = [key for key in RAW_COLUMNS if sample.get(key) is not None]
    if not found:
        nulls = [key for key in ("input_ids", *RAW_COLUMNS) if key in sample]
        null = f", and {nulls} {'is' if len(nulls) == 1 else 'are'} null" if nulls else ""
        raise ValueError(
            f"{where} has keys {sorted(map(str, sample))}{null}; none of them names a sample "
            f"format. Accepted formats: {ACCEPTED_FORMATS}. Rename the keys (columns) of the "
            "data."
        )
    pair = [key for key in found if key in ("prompt", "completion")]
    if len(pair) == 1:
        missing = "completion" if pair[0] == "prompt" else "prompt"
        raise ValueError(
            f"{where} has a '{pair[0]}' but no '{missing}'; a prompt-completion sample needs "
            f"both. Accepted formats: {ACCEPTED_FORMATS}."
        )
    if len(found) > (len(pair) or 1):
        raise ValueError(
            f"{where} holds {found}, the keys of more than one format; a sample has one format. "
            f"Accepted formats: {ACCEPTED_FORMATS}. Keep one of them in each sample."
        )
    if found == ["messages"]:
        return "messages"
    if found == ["conversations"]:
        return "conversations"
    if found == ["text"]:
        return "text"
    prompt, completion = sample["prompt"], sample["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return "prompt-completion"
    if isinstance(prompt, list) and isinstance(completion, list):
        return "conversational prompt-completion"
    raise ValueError(
        f"{where}: prompt is {_kind(prompt)} and completion is {_kind(completion)}; give both as "
        "strings (standard) or both as lists of {'role': ..., 'content': ...} messages "
        "(conversational)."
    )


def _kind(value: object) -> str:
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__} ({value!r:.40})"


def mixed_formats_error(
    where: str, format_: SampleFormat, first_where: str, first: SampleFormat
) -> ValueError:
    """The error for a dataset whose samples ``first_where`` and ``where`` differ in format."""
    return ValueError(
        f"{where} is a {format_} sample but {first_where} is a {first} sample; a dataset holds "
        "one format (pre-tokenised samples mix with any), so that every sample is supervised by "
        "one rule. Fix: convert the samples to one format (a text sample is the prompt-completion "
        "sample {'prompt': '', 'completion': text}; a conversation is {'prompt': messages[:-1], "
        "'completion': messages[-1:]}), or pre-tokenise one of the sources."
    )


class OneFormat:
    """The format of a dataset's samples that are not pre-tokenised, taken from the first such
    sample; :meth:`see` refuses a sample (or a chunk of samples) of another format."""

    def __init__(self) -> None:
        self.format: SampleFormat | None = None
        self.where = ""  # the first sample of that format

    def see(self, format_: SampleFormat | None, where: str) -> None:
        """Record ``format_`` (``None`` or ``"tokens"``: nothing to record) of ``where``.

        Raises:
            ValueError: an earlier sample had another format (:func:`mixed_formats_error`).
        """
        if format_ is None or format_ == "tokens":
            return
        if self.format is None:
            self.format, self.where = format_, where
        elif format_ != self.format:
            raise mixed_formats_error(where, format_, self.where, self.format)


def check_text_tokenizer(tokenizer: Any, format_: SampleFormat, where: str) -> None:
    """Raises when ``tokenizer`` cannot tokenise ``format_`` samples (text or standard
    prompt-completion): none given, not callable, or without an ``eos_token``."""
    if tokenizer is None:
        raise ValueError(
            f"{where} is a {format_} sample but no tokenizer was given; pass "
            "tokenizer=AutoTokenizer.from_pretrained(<model>) to tokenise it with the model's "
            "tokenizer."
        )
    if not callable(tokenizer) or not callable(getattr(tokenizer, "convert_tokens_to_ids", None)):
        raise TypeError(
            f"tokenizer must be a Hugging Face tokenizer, got {type(tokenizer).__name__}; pass "
            "AutoTokenizer.from_pretrained(<model>)."
        )
    if not getattr(tokenizer, "eos_token", None):
        raise ValueError(
            f"The tokenizer {type(tokenizer).__name__} has no eos_token, which {format_} samples "
            "end with (so that the model learns to stop). Set tokenizer.eos_token to the model's "
            "end-of-sequence token, or give pre-tokenised samples."
        )


def _check_text(value: object, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: {name} must be a string, got {_kind(value)}.")
    if not value:
        raise ValueError(
            f"{where}: {name} is empty; there is nothing to learn from it. Remove the sample."
        )
    return value


def _with_eos(text: str, eos_token: str) -> str:
    return text if text.endswith(eos_token) else text + eos_token


def _tokenize(tokenizer: Any, text: str) -> list[int]:
    # verbose=False: no "longer than model_max_length" message for long documents (the length
    # rule is max_tokens, checked at setup)
    return list(tokenizer(text, verbose=False)["input_ids"])


def tokenize_text(text: object, tokenizer: Any, *, where: str = "sample") -> list[int]:
    """Token ids of a ``"text"`` sample: the text with ``eos_token`` appended (unless it ends
    with it), tokenised with the tokenizer's special tokens. Every token is supervised.

    Raises:
        ValueError: a text that is not a non-empty string.
    """
    return _tokenize(tokenizer, _with_eos(_check_text(text, "text", where), tokenizer.eos_token))


def tokenize_prompt_completion(
    prompt: object, completion: object, tokenizer: Any, *, where: str = "sample"
) -> tuple[list[int], list[int], bool]:
    """Token ids and labels of a standard prompt-completion sample (see the module docstring).

    Returns:
        ``(input_ids, labels, straddles)``: labels are ``-100`` on the prompt's tokens and equal
        the ids on the completion's (its ``eos_token`` included); ``straddles`` is whether a
        token straddles the boundary (the completion then starts at it).

    Raises:
        ValueError: a prompt that is not a string, or a completion that is not a non-empty
            string.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: prompt must be a string, got {_kind(prompt)}.")
    completion = _with_eos(_check_text(completion, "completion", where), tokenizer.eos_token)
    prompt_ids = _tokenize(tokenizer, prompt)
    ids = _tokenize(tokenizer, prompt + completion)
    start = 0
    for a, b in zip(prompt_ids, ids):
        if a != b:
            break
        start += 1
    labels = [IGNORE_INDEX] * start + ids[start:]
    return ids, labels, start < len(prompt_ids)


def boundary_warning_text(count: int, first: str) -> str:
    """The :class:`PromptBoundaryWarning` message for ``count`` samples, the first ``first``."""
    return (
        f"{count} prompt-completion sample(s) have a token that straddles the end of the prompt "
        f"(the first is {first}): the joint tokenisation of prompt + completion merges the "
        "prompt's last characters with the completion's first, so the completion starts at that "
        "token, which is supervised, and the model is trained on a prompt tokenised otherwise "
        "than alone. Fix: end each prompt on a token boundary (no trailing space before the "
        "completion, or start the completion with the separator)."
    )
