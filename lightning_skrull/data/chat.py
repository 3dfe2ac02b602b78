"""Raw chat conversations to token ids and labels with a tokenizer's chat template.

Only assistant turns are supervised: every other token (system and user turns, the template's
role headers, the generation prompt that opens an assistant turn) gets label ``-100``. An
assistant turn is supervised from the end of its generation prompt through its end-of-turn token
(a special token; whitespace after it belongs to no turn), so its content and the end-of-turn
token are learned (the model learns to stop). A template without end-of-turn token (GLM-4.5's)
has the next message's role tag supervised instead, and ``eos_token`` appended after a last turn
that nothing follows.

Two ways to find the assistant tokens:
- a template with ``{% generation %}`` markers: transformers' ``return_assistant_tokens_mask``,
  each marked run trimmed as below (a template that marks its whole turn, role header and the
  newline after the end-of-turn token included, as SmolLM3's does, is supervised the same);
- any other template: the conversation is rendered once whole and once per assistant turn as a
  prefix (``messages[:i]`` with the generation prompt, then ``messages[: i + 1]``); the character
  span between the two prefixes is the turn, and tokens overlapping it (by the fast tokenizer's
  offsets on the whole text) are supervised. This needs a template that renders earlier turns
  the same way whatever follows; one that does not (for example Qwen3's, which renders a
  thinking block only on the turns after the last user message) is refused with an error rather
  than masked wrongly.

Which assistant turns are supervised is ``chat_turns``: ``"all"`` (the default), or ``"last"``, only
the conversation's last assistant turn. With ``"last"`` the sample ends with that turn: any later
message would follow every supervised token, so it could change no loss. ``"last"`` works with any
template, because the last turn is rendered as the last turn both times.

A conversational prompt-completion sample (``{"prompt": [messages], "completion": [messages]}``)
is located the same way (:func:`tokenize_chat_completion`): the prompt rendered with the
generation prompt must begin the whole conversation's rendering, and every token after it is
supervised.

A ShareGPT sample (``{"conversations": [{"from": ..., "value": ...}, ...]}``, as LLaMA-Factory,
axolotl and many Hub datasets store conversations) is converted to messages
(:func:`sharegpt_messages`) and then tokenised exactly as a ``"messages"`` sample.

A sample's own ``tools`` (a list of JSON schemas, or a JSON string of one, as TRL's SFTTrainer
reads them) reach ``apply_chat_template`` for that sample only (:func:`sample_template_kwargs`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

from lightning_skrull.data.dataset import IGNORE_INDEX

ASSISTANT_ROLE = "assistant"
ChatTurns = Literal["all", "last"]
"""Which assistant turns of a conversation are supervised."""
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

SHAREGPT_ROLES: Mapping[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "system": "system",
    "observation": "tool",
    "tool": "tool",
}
"""The role of a message for each ShareGPT ``from`` value (LLaMA-Factory's and axolotl's names).
A ``function_call`` turn is the model's output, so it is an assistant turn (supervised), its
``value`` the content; ``observation`` is a tool's result."""


_TURN_WEIGHT_KEYS = ("weight", "train")
"""Per-turn keys that switch a turn's training off in axolotl's ShareGPT data; a turn that
sets one to anything but ``1`` / ``True`` is refused rather than trained on."""


def sharegpt_messages(
    conversations: object, where: str, *, system: object = None
) -> list[dict[str, Any]]:
    """The messages of a ShareGPT conversation: each ``{"from": f, "value": v}`` becomes
    ``{"role": SHAREGPT_ROLES[f], "content": v}`` (other keys of a turn are not read, except
    that a turn switched off by ``weight`` / ``train``, :data:`_TURN_WEIGHT_KEYS`, is refused).

    Args:
        conversations: ``[{"from": ..., "value": ...}, ...]``.
        where: names the sample in error messages.
        system: the sample's ``system`` prompt (LLaMA-Factory's column), put first as a system
            message; ``None`` for none.

    Raises:
        ValueError: not a non-empty list of such dicts, a ``from`` not in :data:`SHAREGPT_ROLES`,
            a turn with ``weight`` / ``train`` other than ``1`` / ``True``,
            a ``system`` that is not a string, or one given both as the column and as a first
            system turn.
    """
    if (
        isinstance(conversations, (str, bytes))
        or not isinstance(conversations, Sequence)
        or not conversations
    ):
        raise ValueError(
            f"{where}: 'conversations' must be a non-empty list of "
            f'{{"from": ..., "value": ...}} dicts, got {conversations!r:.80}.'
        )
    messages: list[dict[str, Any]] = []
    for turn, message in enumerate(conversations):
        if not isinstance(message, Mapping) or "from" not in message or "value" not in message:
            raise ValueError(
                f"{where}: conversations[{turn}] = {message!r:.80} is not a dict with 'from' "
                "and 'value'; every ShareGPT turn must look like "
                '{"from": "human", "value": "..."}.'
            )
        role = message["from"]
        if role not in SHAREGPT_ROLES:
            accepted = ", ".join(f"{k!r} -> {v!r}" for k, v in SHAREGPT_ROLES.items())
            raise ValueError(
                f"{where}: conversations[{turn}] has from={role!r}, which is not a known "
                f"ShareGPT role. Accepted roles: {accepted}. Rename the role in the data to one "
                "of them, or convert the sample to {'messages': [{'role': ..., 'content': ...}]} "
                "with the roles the chat template expects."
            )
        for key in _TURN_WEIGHT_KEYS:
            weight = message.get(key)
            if weight is not None and weight is not True and weight != 1:
                raise ValueError(
                    f"{where}: conversations[{turn}] has {key}={weight!r} (axolotl's per-turn "
                    "training switch), which is not read here: every assistant turn is "
                    "supervised, and this one would be trained on. Remove the turn, keep only "
                    "the last assistant turn supervised (chat_turns='last'), or give the sample "
                    "as input_ids with your own labels (-100 for the turns not to train on)."
                )
        messages.append({"role": SHAREGPT_ROLES[role], "content": message["value"]})
    if system is not None:
        if not isinstance(system, str):
            raise ValueError(f"{where}: system must be a string, got {system!r:.80}.")
        if messages[0]["role"] == "system":
            raise ValueError(
                f"{where} has a 'system' prompt and a first turn from 'system'; give the system "
                "prompt one way (drop the 'system' key, or the system turn)."
            )
        if system:
            messages.insert(0, {"role": "system", "content": system})
    return messages


def sample_template_kwargs(
    sample: Mapping[str, Any], where: str, chat_template_kwargs: Mapping[str, Any] | None
) -> Mapping[str, Any] | None:
    """The ``apply_chat_template`` arguments of one conversational sample: the dataset-wide
    ``chat_template_kwargs``, with ``tools=`` the sample's ``tools`` when it has some.

    ``tools`` is a list of JSON schemas (dicts), or a JSON string of one (how Hub datasets for
    function calling store it, so that Arrow keeps each schema as written). ``None``, ``[]``, an
    empty string and ``"[]"`` are no tools: the dataset-wide ones, if any, apply.

    Raises:
        ValueError: ``tools`` that is not valid JSON, not a list of dicts, or given both by the
            sample and by ``chat_template_kwargs`` (which one is meant is ambiguous).
    """
    tools = sample.get("tools")
    if isinstance(tools, str):
        if not tools.strip():
            return chat_template_kwargs
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{where}: tools is a string but not valid JSON ({error}); give a list of JSON "
                "schemas or a JSON string of one."
            ) from None
    if tools is None or (isinstance(tools, Sequence) and not isinstance(tools, str) and not tools):
        return chat_template_kwargs
    if (
        isinstance(tools, (str, bytes, Mapping))
        or not isinstance(tools, Sequence)
        or not all(isinstance(t, Mapping) or callable(t) for t in tools)
    ):
        raise ValueError(
            f"{where}: tools must be a list of JSON schemas (dicts) or a JSON string of one, got "
            f"{tools!r:.80}; for one tool give [schema]."
        )
    if chat_template_kwargs and "tools" in chat_template_kwargs:
        raise ValueError(
            f"{where} has its own tools and chat_template_kwargs holds tools too; it is "
            "ambiguous which to render. Give tools one way: per sample (the 'tools' key or "
            "column), or for every sample (chat_template_kwargs={'tools': [...]}), not both."
        )
    return {**(chat_template_kwargs or {}), "tools": list(tools)}


def check_chat_turns(turns: object) -> ChatTurns:
    """``turns`` if it is a :data:`ChatTurns` value; raises ``ValueError`` naming the choices."""
    choices = get_args(ChatTurns)
    if turns not in choices:
        raise ValueError(
            f"chat_turns={turns!r} is not supported; choose one of {', '.join(map(repr, choices))}: "
            '"all" supervises every assistant turn, "last" only the last one of each conversation.'
        )
    return turns  # type: ignore[return-value]


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
            "use_fast=True) or pre-tokenise the data. A checkpoint that ships only a slow "
            "tokenizer (Kimi K2's and Moonlight's tiktoken TikTokenTokenizer, loaded with "
            "trust_remote_code) has no fast one: pre-tokenise its data with your own labels."
        )


def _check_messages(
    messages: object, where: str, *, name: str = "messages", first_may_be_assistant: bool = False
) -> list[Mapping[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(
            f"{where}: '{name}' must be a non-empty list of "
            f'{{"role": ..., "content": ...}} dicts, got {messages!r:.80}.'
        )
    for turn, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(
                f"{where}: {name}[{turn}] = {message!r:.80} is not a dict with a 'role'; every "
                'message must look like {"role": "user", "content": "..."}.'
            )
    if not first_may_be_assistant and messages[0]["role"] == ASSISTANT_ROLE:
        raise ValueError(
            f"{where}: the conversation starts with an assistant message, so it has no prompt to "
            "learn from; start it with a system or user message."
        )
    return list(messages)


_LAST_FIX = (
    "chat_turns='last' supervises only each conversation's last assistant turn (exact with any "
    "template whose generation prompt begins the rendered turn); "
)
_TEMPLATE_FIXES = (
    "use a template that renders every turn the same whatever follows, with {% generation %} ... "
    "{% endgeneration %} around assistant output (for Qwen3, trl's "
    "get_training_chat_template(tokenizer) returns one); or pre-tokenise the data with your own "
    "labels."
)
_UNSTABLE_FIXES = f"Fixes: {_LAST_FIX}or {_TEMPLATE_FIXES}"


def _divergence(first: str, second: str) -> str:
    """Where ``second`` stops continuing ``first``: the two texts from their first difference."""
    common = 0
    for a, b in zip(first, second):
        if a != b:
            break
        common += 1
    return f"{first[common : common + 40]!r} vs {second[common : common + 40]!r}"


def _last_run(mask: list[int]) -> list[int]:
    """``mask`` with every 1 cleared except the last run of consecutive 1s."""
    out = [0] * len(mask)
    end = len(mask)
    while end > 0 and not mask[end - 1]:
        end -= 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    out[start:end] = mask[start:end]
    return out


def tokenize_chat(
    messages: object,
    tokenizer: Any,
    *,
    where: str = "sample",
    chat_template_kwargs: Mapping[str, Any] | None = None,
    chat_turns: ChatTurns = "all",
) -> tuple[list[int], list[int]]:
    """Tokenises one conversation and masks everything but the assistant turns.

    Args:
        messages: ``[{"role": ..., "content": ...}, ...]``.
        tokenizer: a fast Hugging Face tokenizer with a ``chat_template``
            (checked by :func:`check_chat_tokenizer`).
        where: names the sample in error messages.
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template``
            (for example ``tools`` or template variables).
        chat_turns: ``"all"`` supervises every assistant turn, ``"last"`` only the last one (the
            sample then ends with it).

    Returns:
        ``(input_ids, labels)``: labels equal the ids on supervised assistant tokens and
        ``-100`` elsewhere.

    Raises:
        ValueError: malformed messages, a conversation without an assistant turn under
            ``chat_turns="last"``, or (``"all"``) a template that renders an assistant turn
            differently once later turns follow.
    """
    messages = _check_messages(messages, where)
    turns = check_chat_turns(chat_turns)
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == ASSISTANT_ROLE]
    if turns == "last":
        if not assistant_turns:
            raise ValueError(
                f"{where}: the conversation has no assistant message, so chat_turns='last' has no "
                "turn to supervise; give every conversation an assistant reply, or remove it."
            )
        messages = messages[: assistant_turns[-1] + 1]
        assistant_turns = assistant_turns[-1:]
    kwargs = dict(chat_template_kwargs or {})
    if _GENERATION_TAG.search(tokenizer.chat_template):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
        ids = list(out["input_ids"])
        mask = list(out["assistant_masks"])
        if turns == "last":
            mask = _last_run(mask)
        return _trim_generation_runs(tokenizer, messages, ids, mask, assistant_turns, kwargs)

    def render(conversation: list[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def prompt_begins_turn(turn: int) -> bool:
        return render(messages[: turn + 1], False).startswith(render(messages[:turn], True))

    text = render(messages, False)
    eos = getattr(tokenizer, "eos_token", None)
    stops = _special_tokens(tokenizer)
    spans: list[tuple[int, int]] = []
    for turn in assistant_turns:
        before = render(messages[:turn], True)
        through = render(messages[: turn + 1], False)
        if not through.startswith(before):
            last_helps = turns == "all" and prompt_begins_turn(assistant_turns[-1])
            raise ValueError(
                f"{where}: the chat template's generation prompt (messages 0..{turn - 1} rendered "
                f"with add_generation_prompt=True) does not begin assistant turn {turn} as the "
                f"template renders it ({_divergence(before, through)}): for example, the "
                "generation prompt opens a reasoning block that finished turns drop "
                "(DeepSeek-R1's '<think>\\n'), or the template writes other whitespace before a "
                "finished reply than after the prompt; so the turn's tokens cannot be located. "
                "Fixes: "
                f"{_LAST_FIX if last_helps else ''}{'or ' if last_helps else ''}{_TEMPLATE_FIXES}"
            )
        end = len(through)
        if not text.startswith(through):
            if eos and through.endswith(eos) and text.startswith(through[: -len(eos)]):
                # the template ends the conversation with eos_token (Phi-4-mini's): inside the
                # conversation the turn is the same without it
                end -= len(eos)
            else:
                raise ValueError(
                    f"{where}: the chat template renders assistant turn {turn} differently when "
                    f"later messages follow it (as the last message vs inside the conversation: "
                    f"{_divergence(through, text)}), as templates do that show reasoning only on "
                    "the turns after the last user message (Qwen3's), end only the last turn with "
                    "the end-of-generation token (gpt-oss's <|return|>), or list the tools before "
                    f"the last user message (Mistral's). {_UNSTABLE_FIXES}"
                )
        _check_turn_ends_in_a_stop(where, turn, messages[turn], text[len(before) : end], stops)
        spans.append((len(before), _turn_end(text, len(before), end, stops)))
    start, end = spans[-1] if spans else (0, 0)
    if spans and end == len(text) and not any(text.endswith(stop) for stop in stops):
        # the template ends assistant turns with no end-of-turn token (GLM-4.5's: the model hands
        # the turn back by emitting the next role tag), and no message follows the last one
        if not eos:
            raise ValueError(
                f"{where}: the chat template ends assistant turn {assistant_turns[-1]} with no "
                "end-of-turn token and the tokenizer has no eos_token, so the model would not "
                "learn to stop. Set tokenizer.eos_token to the token that ends a reply, or "
                "pre-tokenise the data with your own labels."
            )
        text += eos
        spans[-1] = (start, len(text))
    return _label_spans(tokenizer, text, spans)


def _trim_generation_runs(
    tokenizer: Any,
    messages: list[Mapping[str, Any]],
    ids: list[int],
    mask: list[int],
    assistant_turns: Sequence[int],
    kwargs: Mapping[str, Any],
) -> tuple[list[int], list[int]]:
    """Labels from a ``{% generation %}`` mask, each marked run trimmed to the assistant turn as
    the prefix rendering supervises it: without the generation prompt at its start (a template
    may mark its whole turn, role header included, as SmolLM3's does) and without whitespace after
    its end-of-turn token (see :func:`_turn_end`)."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, **kwargs
    )
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoding["offset_mapping"]
    if list(encoding["input_ids"]) != ids:  # pragma: no cover - same text, same tokenizer
        return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]
    prompts = set()
    for turn in assistant_turns:
        without = tokenizer.apply_chat_template(
            messages[:turn], tokenize=False, add_generation_prompt=False, **kwargs
        )
        with_prompt = tokenizer.apply_chat_template(
            messages[:turn], tokenize=False, add_generation_prompt=True, **kwargs
        )
        if with_prompt.startswith(without) and len(with_prompt) > len(without):
            prompts.add(with_prompt[len(without) :])
    stops = _special_tokens(tokenizer)
    spans: list[tuple[int, int]] = []
    position = 0
    while position < len(mask):
        if not mask[position]:
            position += 1
            continue
        first = position
        while position < len(mask) and mask[position]:
            position += 1
        start, end = offsets[first][0], offsets[position - 1][1]
        start += max((len(p) for p in prompts if text.startswith(p, start)), default=0)
        through = _through_stop(text[start:end], stops)
        if through is not None:
            end = start + through
        if start < end:
            spans.append((start, end))
    return _label_spans(tokenizer, text, spans)


def _special_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special tokens, where chat templates' end-of-turn tokens and role tags are
    (added tokens not marked special, such as Qwen's ``</tool_call>``, are part of the text)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    special = {t.content for t in added if t.special} | set(tokenizer.all_special_tokens)
    return tuple(token for token in special if token)


def _check_turn_ends_in_a_stop(
    where: str, turn: int, message: Mapping[str, Any], rendered: str, stops: Sequence[str]
) -> None:
    """Raises when the template writes text after a plain assistant reply (``rendered``, the
    turn as it appears in the conversation) that does not end in a special token.

    Such text is the template's end-of-turn token with the tokenizer not flagging it special and
    not naming it ``eos_token``: the turn's end cannot be told from its text, so the whitespace
    after it and the next message's role tag would be supervised, and ``eos_token`` appended
    after the last turn. A template that writes nothing after the reply (GLM-4.5's, whose model
    hands the turn back with the next role tag) passes; so do turns with tool calls (their
    closing tags, such as ``</tool_call>``, are text) and contents the template rewrites.
    """
    content = message.get("content")
    if message.get("tool_calls") or not isinstance(content, str) or not content.strip():
        return
    if _through_stop(rendered, stops) is not None:
        return
    body = rendered.rstrip()
    at = body.rfind(content.strip())
    tail = body[at + len(content.strip()) :].strip() if at >= 0 else ""
    if tail:
        raise ValueError(
            f"{where}: the chat template ends assistant turn {turn} with {tail[-40:]!r}, which is "
            "neither a special token of the tokenizer nor its eos_token, so where the turn ends "
            "cannot be told from the text (the whitespace and the next role tag after it would "
            "be supervised as part of the turn). If it is the token that ends a reply, flag it "
            "special (tokenizer.add_special_tokens({'additional_special_tokens': "
            f"[{tail!r}]}}, replace_extra_special_tokens=False)) "
            f"or set tokenizer.eos_token = {tail!r}; otherwise pre-tokenise the data with your "
            "own labels."
        )


def _through_stop(turn: str, stops: Sequence[str]) -> int | None:
    """The length of ``turn`` through its end-of-turn token (one of ``stops``; the whitespace a
    template puts after it belongs to no turn), or ``None`` when it ends in none."""
    body = turn.rstrip()
    return len(body) if any(body.endswith(stop) for stop in stops) else None


def _turn_end(text: str, start: int, end: int, stops: Sequence[str]) -> int:
    """Where the assistant turn ``text[start:end]`` ends as the model must emit it: after its
    end-of-turn token (a special token; whitespace the template puts after it belongs to no
    turn), or, when the template renders no such token, after the token that opens the next
    message (the model hands the turn back by emitting it)."""
    through = _through_stop(text[start:end], stops)
    if through is not None:
        return start + through
    following = [stop for stop in stops if text.startswith(stop, end)]
    return end + max(map(len, following), default=0)


def _label_spans(
    tokenizer: Any, text: str, spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """Tokenises ``text`` (no special tokens added) and supervises the tokens that overlap one
    of ``spans`` (sorted character ranges), by the fast tokenizer's offsets."""
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


def tokenize_chat_completion(
    prompt: object,
    completion: object,
    tokenizer: Any,
    *,
    where: str = "sample",
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """Tokenises a conversational prompt-completion sample; only the completion is supervised.

    The prompt is rendered with the generation prompt, and the whole conversation
    (``prompt + completion``) without it; the completion is the rendering's suffix after the
    first, so every token of it (its messages, the template's end-of-turn tokens) is supervised
    and nothing of the prompt or the generation prompt is. Its end follows the rules of
    :func:`tokenize_chat`: whitespace the template writes after the last end-of-turn token
    belongs to no turn (masked), and a completion that ends with an assistant message the
    template closes with no end-of-turn token (GLM-4.5's) gets the ``eos_token`` appended,
    supervised. Otherwise nothing is appended, as by TRL's SFTTrainer for this format.

    Args:
        prompt: ``[{"role": ..., "content": ...}, ...]``, the conversation so far.
        completion: the messages to learn, a non-empty list (usually one assistant message).
        tokenizer: a fast Hugging Face tokenizer with a ``chat_template``.
        where: names the sample in error messages.
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template``.

    Returns:
        ``(input_ids, labels)``: labels equal the ids on the completion's tokens and ``-100``
        elsewhere.

    Raises:
        ValueError: malformed messages, an empty completion, a template whose rendering of the
            prompt (with the generation prompt) does not begin the whole conversation's, or one
            whose last assistant message ends in a token that is not special (or in none, with
            no ``eos_token``).
    """
    prompt = _check_messages(prompt, where, name="prompt")
    if isinstance(completion, list) and not completion:
        raise ValueError(
            f"{where}: completion is an empty list, so there is nothing to learn; give at least one "
            "message to learn, or remove the sample."
        )
    completion = _check_messages(completion, where, name="completion", first_may_be_assistant=True)
    kwargs = dict(chat_template_kwargs or {})
    before = tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, **kwargs
    )
    text = tokenizer.apply_chat_template(
        prompt + completion, tokenize=False, add_generation_prompt=False, **kwargs
    )
    if not text.startswith(before):
        raise ValueError(
            f"{where}: the chat template renders the prompt (with the generation prompt) "
            f"differently once the completion follows ({_divergence(before, text)}), so the "
            "completion's tokens cannot be located. Fixes: use a template that renders the "
            "prompt the same whatever follows it, or pre-tokenise the data with your own labels."
        )
    stops = _special_tokens(tokenizer)
    last = len(prompt) + len(completion) - 1
    if completion[-1]["role"] == ASSISTANT_ROLE:
        _check_turn_ends_in_a_stop(where, last, completion[-1], text[len(before) :], stops)
    through = _through_stop(text[len(before) :], stops)
    if through is not None:
        return _label_spans(tokenizer, text, [(len(before), len(before) + through)])
    eos = getattr(tokenizer, "eos_token", None)
    if completion[-1]["role"] != ASSISTANT_ROLE:
        return _label_spans(tokenizer, text, [(len(before), len(text))])
    # the template ends assistant turns with no end-of-turn token (GLM-4.5's), as in chat data
    if not eos:
        raise ValueError(
            f"{where}: the chat template ends the completion's last message (message {last}) "
            "with no end-of-turn token and the tokenizer has no eos_token, so the model would "
            "not learn to stop. Set tokenizer.eos_token to the token that ends a reply, or "
            "pre-tokenise the data with your own labels."
        )
    return _label_spans(tokenizer, text + eos, [(len(before), len(text) + len(eos))])
