"""Chat data: tokenised with the tokenizer's chat template, every non-assistant token masked.

The tokenizer is built offline (a word-level vocabulary split on whitespace), so each word is one
token and the expected labels can be written out by hand, token by token. Exact comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from helpers import CHAT_VOCAB, CONVERSATION, PLAIN_TEMPLATE, make_tokenizer
from transformers import PreTrainedTokenizerFast

from lightning_skrull.data import load_sft_data, tokenize_chat
from lightning_skrull.data.chat import tokenize_chat_completion
from lightning_skrull.data.datamodule import SkrullDataModule

GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|im_start|>assistant {% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %} "
    "{% else %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
# Renders earlier assistant turns differently from the last one (as templates that strip
# reasoning do): the prefix rendering of an early turn is not a prefix of the whole conversation.
UNSTABLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['role'] == 'assistant' and not loop.last %}hi{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)

# Renders a thinking block only on the assistant turns after the last user message, as Qwen3's
# template does: an assistant turn is rendered one way as the last message and another way once
# a later user message follows, so "all" cannot locate the earlier turns' tokens.
THINKING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user %}<think> </think> {% endif %}"
    "{{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
THINKING_GENERATION_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant "
    "{% generation %}{% if loop.index0 > ns.last_user %}<think> </think> {% endif %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %} "
    "{% else %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)

# Independent expectation, written out: (token, supervised?). Assistant content and its
# end-of-turn token are supervised; role headers, the generation prompt and other turns are not.
EXPECTED = [
    ("<|im_start|>", False),
    ("system", False),
    ("be", False),
    ("brief", False),
    ("<|im_end|>", False),
    ("<|im_start|>", False),
    ("user", False),
    ("hi", False),
    ("there", False),
    ("<|im_end|>", False),
    ("<|im_start|>", False),
    ("assistant", False),
    ("hello", True),
    ("<|im_end|>", True),
    ("<|im_start|>", False),
    ("user", False),
    ("how", False),
    ("are", False),
    ("you", False),
    ("<|im_end|>", False),
    ("<|im_start|>", False),
    ("assistant", False),
    ("fine", True),
    ("thanks", True),
    ("<|im_end|>", True),
]
EXPECTED_IDS = [CHAT_VOCAB[word] for word, _ in EXPECTED]
EXPECTED_LABELS = [CHAT_VOCAB[word] if supervised else -100 for word, supervised in EXPECTED]


@pytest.mark.parametrize(
    "template", [PLAIN_TEMPLATE, GENERATION_TEMPLATE], ids=["prefix-rendering", "generation-tags"]
)
def test_only_assistant_turns_are_supervised_token_by_token(template: str) -> None:
    ids, labels = tokenize_chat(CONVERSATION, make_tokenizer(template))
    assert ids == EXPECTED_IDS
    assert labels == EXPECTED_LABELS


# The same conversation with only its last assistant turn supervised (chat_turns="last").
LAST_TURN_LABELS = [-100] * 22 + EXPECTED_LABELS[22:]
# The thinking template renders the last turn with "<think> </think>" before its content; both
# tokens belong to the assistant's output and are supervised.
THINKING_IDS = [
    *EXPECTED_IDS[:22],
    CHAT_VOCAB["<think>"],
    CHAT_VOCAB["</think>"],
    *EXPECTED_IDS[22:],
]
THINKING_LAST_LABELS = [-100] * 22 + THINKING_IDS[22:]


@pytest.mark.parametrize(
    ("template", "ids", "labels"),
    [
        (PLAIN_TEMPLATE, EXPECTED_IDS, LAST_TURN_LABELS),
        (GENERATION_TEMPLATE, EXPECTED_IDS, LAST_TURN_LABELS),
        (THINKING_TEMPLATE, THINKING_IDS, THINKING_LAST_LABELS),
        (THINKING_GENERATION_TEMPLATE, THINKING_IDS, THINKING_LAST_LABELS),
    ],
    ids=["prefix-rendering", "generation-tags", "thinking", "thinking-generation-tags"],
)
def test_last_turn_supervises_only_the_last_assistant_turn(
    template: str, ids: list[int], labels: list[int]
) -> None:
    tokenizer = make_tokenizer(template)
    assert tokenize_chat(CONVERSATION, tokenizer, chat_turns="last") == (ids, labels)
    # a message after the last assistant turn would follow every supervised token: it ends the
    # sample instead of being trained on as context that no loss sees
    trailing = [*CONVERSATION, {"role": "user", "content": "thanks"}]
    assert tokenize_chat(trailing, tokenizer, chat_turns="last") == (ids, labels)


def test_thinking_template_with_generation_tags_supervises_every_turn_as_rendered() -> None:
    # with generation markers transformers marks the assistant tokens of the whole rendering:
    # the early turn as the template renders it inside the conversation (no thinking block)
    ids, labels = tokenize_chat(CONVERSATION, make_tokenizer(THINKING_GENERATION_TEMPLATE))
    assert ids == THINKING_IDS
    assert labels == EXPECTED_LABELS[:22] + THINKING_IDS[22:]


def test_thinking_template_refuses_all_turns_and_names_the_fixes() -> None:
    with pytest.raises(ValueError) as caught:
        tokenize_chat(CONVERSATION, make_tokenizer(THINKING_TEMPLATE), where="sample 4")
    message = str(caught.value)
    assert message.startswith(
        "sample 4: the chat template renders assistant turn 2 differently when later messages "
        "follow it"
    )
    assert "'<think> </think> hello" in message and "'hello<|im_end|>" in message
    for fix in ("chat_turns='last'", "{% generation %}", "get_training_chat_template", "labels"):
        assert fix in message
    # the single-turn conversation renders its only assistant turn last both times: accepted
    _, labels = tokenize_chat(CONVERSATION[:3], make_tokenizer(THINKING_TEMPLATE))
    assert labels[-4:] == [CHAT_VOCAB[w] for w in ("<think>", "</think>", "hello", "<|im_end|>")]


def test_chat_samples_load_the_same_from_every_input_kind(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(PLAIN_TEMPLATE)
    samples = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:3]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    expected = [
        {"input_ids": EXPECTED_IDS, "labels": EXPECTED_LABELS},
        {"input_ids": EXPECTED_IDS[:14], "labels": EXPECTED_LABELS[:14]},
    ]
    for data in (samples, path, datasets.Dataset.from_list(samples)):
        dataset = load_sft_data(data, tokenizer=tokenizer)
        assert [dataset[i] for i in range(len(dataset))] == expected
    # Pre-tokenised and chat samples can be mixed; input_ids wins when both are present.
    mixed = load_sft_data(
        [{"input_ids": [3, 4]}, samples[1], {"input_ids": [5], "messages": CONVERSATION}],
        tokenizer=tokenizer,
    )
    assert mixed.lengths == [2, 14, 1]


def test_chat_errors() -> None:
    with pytest.raises(
        ValueError, match=r"sample 0 is a chat sample .* but no tokenizer was given"
    ):
        load_sft_data([{"messages": CONVERSATION}])
    with pytest.raises(ValueError, match="has no chat_template"):
        load_sft_data([{"messages": CONVERSATION}], tokenizer=make_tokenizer(None))
    with pytest.raises(TypeError, match="must be a Hugging Face tokenizer"):
        load_sft_data([{"messages": CONVERSATION}], tokenizer=object())
    # a slow tokenizer (as Kimi K2's and Moonlight's tiktoken one, loaded with trust_remote_code,
    # which has no fast counterpart) has no character offsets: refused, naming what to do
    slow = make_tokenizer(PLAIN_TEMPLATE)
    slow.__class__ = type("TikTokenTokenizer", (type(slow),), {"is_fast": False})
    with pytest.raises(TypeError, match=r"needs a fast tokenizer .* got TikTokenTokenizer") as got:
        load_sft_data([{"messages": CONVERSATION}], tokenizer=slow)
    assert "Kimi K2" in str(got.value) and "pre-tokenise its data" in str(got.value)
    tokenizer = make_tokenizer(PLAIN_TEMPLATE)
    with pytest.raises(ValueError, match="sample 1: the conversation starts with an assistant"):
        load_sft_data(
            [{"messages": CONVERSATION}, {"messages": CONVERSATION[2:]}], tokenizer=tokenizer
        )
    with pytest.raises(ValueError, match="'messages' must be a non-empty list"):
        load_sft_data([{"messages": []}], tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"messages\[1\] = 'hi' is not a dict with a 'role'"):
        load_sft_data([{"messages": [CONVERSATION[0], "hi"]}], tokenizer=tokenizer)
    with pytest.raises(
        ValueError, match=r"renders assistant turn 2 differently when later messages follow"
    ):
        load_sft_data([{"messages": CONVERSATION}], tokenizer=make_tokenizer(UNSTABLE_TEMPLATE))
    with pytest.raises(ValueError, match=r"chat_turns='first' is not supported; choose one of"):
        load_sft_data([{"messages": CONVERSATION}], tokenizer=tokenizer, chat_turns="first")
    with pytest.raises(
        ValueError, match=r"sample 1: the conversation has no assistant message, so chat_turns"
    ):
        load_sft_data(
            [{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}],
            tokenizer=tokenizer,
            chat_turns="last",
        )
    with pytest.raises(ValueError, match="No sample has a supervised token"):
        load_sft_data([{"messages": CONVERSATION[:2]}], tokenizer=tokenizer)


def test_chat_turns_reaches_the_cache_through_the_datamodule(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    module = SkrullDataModule(
        train_data=path,
        global_batch_size=1,
        tokenizer=make_tokenizer(THINKING_TEMPLATE),
        chat_turns="last",
        cache_dir=tmp_path / "cache",
        num_proc=1,
    )
    module.prepare_data()
    module.setup("fit")
    assert module.train_dataset is not None
    assert module.train_dataset[0] == {"input_ids": THINKING_IDS, "labels": THINKING_LAST_LABELS}
    with pytest.raises(ValueError, match=r"chat_turns='every' is not supported"):
        SkrullDataModule(train_data=path, chat_turns="every")  # type: ignore[arg-type]


# A tool-calling template in the style of Qwen2.5's: the tools are listed in the system turn, an
# assistant turn renders its tool calls, and consecutive tool results are grouped into one user
# turn of <tool_response> blocks (the group closes when the next message is not a tool result).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system tools: {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}<|im_end|> "
    "{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user {% endif %}"
    "<tool_response> {{ m['content'] }} </tool_response> "
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|> {% endif %}"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant "
    "{% if m['content'] %}{{ m['content'] }} {% endif %}"
    "{% for c in m.get('tool_calls', []) %}<tool_call> {{ c['function']['name'] }} "
    "{{ c['function']['arguments']['city'] }} </tool_call> {% endfor %}<|im_end|> "
    "{% else %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
TOOL_CONVERSATION = [
    {"role": "user", "content": "weather paris"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "paris"}}}],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "fine"},
    {"role": "assistant", "content": "sunny thanks"},
]
# (token, supervised?): the tool call and the answer are the assistant's; the tool list, the
# user turn and the grouped tool results are not
TOOL_EXPECTED = [
    ("<|im_start|>", False), ("system", False), ("tools:", False), ("weather", False),
    ("<|im_end|>", False),
    ("<|im_start|>", False), ("user", False), ("weather", False), ("paris", False),
    ("<|im_end|>", False),
    ("<|im_start|>", False), ("assistant", False),
    ("<tool_call>", True), ("weather", True), ("paris", True), ("</tool_call>", True),
    ("<|im_end|>", True),
    ("<|im_start|>", False), ("user", False),
    ("<tool_response>", False), ("sunny", False), ("</tool_response>", False),
    ("<tool_response>", False), ("fine", False), ("</tool_response>", False),
    ("<|im_end|>", False),
    ("<|im_start|>", False), ("assistant", False),
    ("sunny", True), ("thanks", True), ("<|im_end|>", True),
]  # fmt: skip


def test_tool_calls_are_supervised_and_tool_results_are_not() -> None:
    tokenizer = make_tokenizer(TOOL_TEMPLATE)
    ids, labels = tokenize_chat(TOOL_CONVERSATION, tokenizer, chat_template_kwargs={"tools": TOOLS})
    assert ids == [CHAT_VOCAB[word] for word, _ in TOOL_EXPECTED]
    assert labels == [CHAT_VOCAB[w] if sup else -100 for w, sup in TOOL_EXPECTED]
    # only the final answer with chat_turns="last"
    _, last = tokenize_chat(
        TOOL_CONVERSATION,
        tokenizer,
        chat_template_kwargs={"tools": TOOLS},
        chat_turns="last",
    )
    assert last == [
        CHAT_VOCAB[w] if sup and i >= 26 else -100 for i, (w, sup) in enumerate(TOOL_EXPECTED)
    ]


def _word_tokenizer(
    template: str, words: list[str], special: list[str], eos: str | None = None
) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``words`` (split on spaces; a newline is a token of its own,
    as in byte-level vocabularies) with ``special`` as special tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(["<unk>", "\n", *words, *special])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(" "), behavior="removed"),
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens(
        {"additional_special_tokens": special, **({"eos_token": eos} if eos else {})}
    )
    tokenizer.chat_template = template
    return tokenizer


def _supervised(tokenizer: PreTrainedTokenizerFast, ids: list[int], labels: list[int]) -> list:
    """``(token, supervised?)`` for each token of a sample."""
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert [label for label in labels if label != -100] == [
        i for i, label in zip(ids, labels, strict=True) if label != -100
    ]
    return [(token, label != -100) for token, label in zip(tokens, labels, strict=True)]


# The end-of-turn token is followed by a newline that belongs to no turn (Qwen's and Gemma's
# templates render "<|im_end|>\n" / "<end_of_turn>\n"): the model stops at the end-of-turn token
# and never emits that newline, so it is not supervised.
NEWLINE_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def test_whitespace_after_the_end_of_turn_token_is_not_supervised() -> None:
    words = ["user", "assistant", "hi", "hello", "fine"]
    tokenizer = _word_tokenizer(NEWLINE_TEMPLATE, words, ["<|im_start|>", "<|im_end|>"])
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "fine"},
    ]
    turn = [("<|im_start|>", False), ("user", False), ("hi", False), ("<|im_end|>", False)]
    turn += [("\n", False), ("<|im_start|>", False), ("assistant", False)]
    expected = [
        *turn, ("hello", True), ("<|im_end|>", True), ("\n", False),
        *turn, ("fine", True), ("<|im_end|>", True), ("\n", False),
    ]  # fmt: skip
    assert _supervised(tokenizer, *tokenize_chat(conversation, tokenizer)) == expected
    last = [(t, s and i > 10) for i, (t, s) in enumerate(expected)]
    assert (
        _supervised(tokenizer, *tokenize_chat(conversation, tokenizer, chat_turns="last")) == last
    )


# No end-of-turn token (GLM-4.5's template): an assistant turn ends where the next message's role
# tag starts, and the model hands the turn back by emitting that tag, so the tag is supervised; the
# last turn, which nothing follows, ends with the eos_token. "</tool_call>" is an added token that
# is not special: part of the text, not an end of turn.
OPEN_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} "
    "{% else %}<|assistant|> {{ m['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def test_a_template_without_end_of_turn_token_supervises_the_next_role_tag_and_eos() -> None:
    tokenizer = _word_tokenizer(
        OPEN_TEMPLATE, ["hi", "hello", "fine"], ["<|user|>", "<|assistant|>"], eos="<|endoftext|>"
    )
    tokenizer.add_tokens(["</tool_call>"])
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello </tool_call>"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "fine"},
    ]
    expected = [
        ("<|user|>", False), ("hi", False), ("<|assistant|>", False),
        ("hello", True), ("</tool_call>", True), ("<|user|>", True), ("hi", False),
        ("<|assistant|>", False), ("fine", True), ("<|endoftext|>", True),
    ]  # fmt: skip
    assert _supervised(tokenizer, *tokenize_chat(conversation, tokenizer)) == expected
    last = [(t, s and i > 6) for i, (t, s) in enumerate(expected)]
    assert (
        _supervised(tokenizer, *tokenize_chat(conversation, tokenizer, chat_turns="last")) == last
    )
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match=r"no end-of-turn token and the tokenizer has no eos_tok"):
        tokenize_chat(conversation, tokenizer)


# The template ends the conversation with eos_token when no generation prompt is asked for
# (Phi-4-mini's): inside the conversation an earlier turn is the same without it.
EOS_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
    "{% else %}{{ eos_token }}{% endif %}"
)


def test_a_template_that_ends_the_conversation_with_eos_supervises_every_turn() -> None:
    words = ["user", "assistant", "hi", "hello", "fine"]
    tokenizer = _word_tokenizer(EOS_TEMPLATE, words, ["<|im_start|>", "<|im_end|>"], eos="</s>")
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "fine"},
    ]
    turn = [("<|im_start|>", False), ("user", False), ("hi", False), ("<|im_end|>", False)]
    turn += [("<|im_start|>", False), ("assistant", False)]
    expected = [
        *turn, ("hello", True), ("<|im_end|>", True),
        *turn, ("fine", True), ("<|im_end|>", True), ("</s>", True),
    ]  # fmt: skip
    assert _supervised(tokenizer, *tokenize_chat(conversation, tokenizer)) == expected


# The generation prompt opens a reasoning block that finished turns do not show (DeepSeek-R1's
# "<｜Assistant｜><think>\n" against "<｜Assistant｜>answer"): no turn can be located, the last
# one neither, so chat_turns="last" is not offered as a fix.
OPEN_THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant <think> {% endif %}"
)


@pytest.mark.parametrize("turns", ["all", "last"])
def test_a_generation_prompt_that_does_not_begin_the_turn_is_refused(turns: str) -> None:
    tokenizer = make_tokenizer(OPEN_THINK_TEMPLATE)
    with pytest.raises(ValueError) as caught:
        tokenize_chat(CONVERSATION, tokenizer, where="sample 2", chat_turns=turns)  # type: ignore[arg-type]
    message = str(caught.value)
    turn = 2 if turns == "all" else 4
    assert message.startswith(
        f"sample 2: the chat template's generation prompt (messages 0..{turn - 1} rendered with "
        f"add_generation_prompt=True) does not begin assistant turn {turn}"
    )
    assert "'<think> '" in message and "{% generation %}" in message and "labels" in message
    assert "chat_turns='last'" not in message


# {% generation %} around the whole assistant turn, role header and empty thinking block included,
# and the newline after the end-of-turn token (as SmolLM3's template marks it with reasoning off):
# the marked run is trimmed to what the prefix rendering supervises. The generation prompt
# ("<|im_start|> assistant <think> </think>") is given to the model at inference, so it is not
# learned, and the newline after "<|im_end|>" is never emitted.
WHOLE_TURN_GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "<|im_start|> assistant <think> </think> {{ m['content'] }} <|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant <think> </think> {% endif %}"
)


def test_a_generation_run_is_trimmed_to_the_turn_after_the_generation_prompt() -> None:
    words = ["user", "assistant", "<think>", "</think>", "hi", "hello", "fine"]
    special = ["<|im_start|>", "<|im_end|>"]
    tokenizer = _word_tokenizer(WHOLE_TURN_GENERATION_TEMPLATE, words, special)
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "fine"},
    ]
    turn = [("<|im_start|>", False), ("user", False), ("hi", False), ("<|im_end|>", False)]
    turn += [("\n", False), ("<|im_start|>", False), ("assistant", False)]
    turn += [("<think>", False), ("</think>", False)]
    expected = [
        *turn, ("hello", True), ("<|im_end|>", True), ("\n", False),
        *turn, ("fine", True), ("<|im_end|>", True), ("\n", False),
    ]  # fmt: skip
    assert _supervised(tokenizer, *tokenize_chat(conversation, tokenizer)) == expected
    last = [(t, s and i > 12) for i, (t, s) in enumerate(expected)]
    assert (
        _supervised(tokenizer, *tokenize_chat(conversation, tokenizer, chat_turns="last")) == last
    )
    # the same labels as the prefix rendering of the template without the markers
    plain = _word_tokenizer(
        WHOLE_TURN_GENERATION_TEMPLATE.replace("{% generation %}", "").replace(
            "{% endgeneration %}", ""
        ),
        words,
        special,
    )
    for turns in ("all", "last"):
        assert tokenize_chat(conversation, plain, chat_turns=turns) == tokenize_chat(
            conversation, tokenizer, chat_turns=turns
        )


def test_an_end_of_turn_token_that_is_not_special_is_refused_naming_the_fix() -> None:
    # "<|im_end|>" is an added token but neither flagged special nor the eos_token: the turn's end
    # cannot be told from the text, and the "\n" and next "<|im_start|>" after it would be learned
    # as part of the turn (and "<|endoftext|>" appended after "<|im_end|>\n" at the end)
    words = ["user", "assistant", "hi", "hello", "fine"]
    tokenizer = _word_tokenizer(NEWLINE_TEMPLATE, words, ["<|im_start|>"], eos="<|endoftext|>")
    tokenizer.add_tokens(["<|im_end|>"])
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "fine"},
    ]
    for turns, turn in (("all", 1), ("last", 3)):
        with pytest.raises(ValueError) as caught:
            tokenize_chat(conversation, tokenizer, where="sample 5", chat_turns=turns)  # type: ignore[arg-type]
        message = str(caught.value)
        assert message.startswith(
            f"sample 5: the chat template ends assistant turn {turn} with '<|im_end|>', which is "
            "neither a special token of the tokenizer nor its eos_token"
        )
        assert "replace_extra_special_tokens=False" in message
        assert "tokenizer.eos_token = '<|im_end|>'" in message
    # the fix the message names gives the labels of a tokenizer that flags it special
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_end|>"]}, replace_extra_special_tokens=False
    )
    flagged = _word_tokenizer(
        NEWLINE_TEMPLATE, words, ["<|im_start|>", "<|im_end|>"], eos="<|endoftext|>"
    )
    expected = tokenize_chat(conversation, flagged)
    got = tokenize_chat(conversation, tokenizer)
    assert _supervised(tokenizer, *got) == _supervised(flagged, *expected)
    assert [t for t, s in _supervised(tokenizer, *got) if s] == [
        "hello", "<|im_end|>", "fine", "<|im_end|>"
    ]  # fmt: skip
    # a tool-call turn whose closing tag is text (Qwen's and GLM's </tool_call>) is not refused
    tools = _word_tokenizer(
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }}"
        "{% if m.get('tool_calls') %} <tool_call> call </tool_call>{% endif %} <|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}",
        [*words, "call"],
        ["<|im_start|>", "<|im_end|>"],
    )
    tools.add_tokens(["<tool_call>", "</tool_call>"])
    calls = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{}]},
    ]
    assert [t for t, s in _supervised(tools, *tokenize_chat(calls, tools)) if s] == [
        "<tool_call>", "call", "</tool_call>", "<|im_end|>"
    ]  # fmt: skip


def test_a_conversational_completion_ends_as_a_chat_turn_does() -> None:
    """A conversational prompt-completion sample's completion ends by the rules of chat data: the
    newline after its last end-of-turn token is not supervised, a template without an end-of-turn
    token gets the eos_token appended (supervised), and an end-of-turn token that is not special
    is refused. The completion's other tokens (a second message included) are all supervised."""
    words = ["user", "assistant", "tool", "hi", "hello", "fine", "sunny"]
    prompt = [{"role": "user", "content": "hi"}]
    answer = [{"role": "assistant", "content": "hello"}]
    newline = _word_tokenizer(NEWLINE_TEMPLATE, words, ["<|im_start|>", "<|im_end|>"])
    assert _supervised(newline, *tokenize_chat_completion(prompt, answer, newline)) == [
        ("<|im_start|>", False), ("user", False), ("hi", False), ("<|im_end|>", False),
        ("\n", False), ("<|im_start|>", False), ("assistant", False),
        ("hello", True), ("<|im_end|>", True), ("\n", False),
    ]  # fmt: skip
    # the same tokens and labels as the chat path gives the conversation's last turn
    conversation = prompt + answer
    assert tokenize_chat_completion(prompt, answer, newline) == tokenize_chat(
        conversation, newline, chat_turns="last"
    )
    # several completion messages: the newline between them is part of the completion
    several = [
        *answer,
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "fine"},
    ]
    labelled = _supervised(newline, *tokenize_chat_completion(prompt, several, newline))
    assert [t for t, s in labelled if s] == [
        "hello", "<|im_end|>", "\n", "<|im_start|>", "tool", "sunny", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "fine", "<|im_end|>",
    ]  # fmt: skip
    assert labelled[-1] == ("\n", False)

    open_template = _word_tokenizer(
        OPEN_TEMPLATE, ["hi", "hello"], ["<|user|>", "<|assistant|>"], eos="<|endoftext|>"
    )
    assert _supervised(
        open_template, *tokenize_chat_completion(prompt, answer, open_template)
    ) == [
        ("<|user|>", False), ("hi", False), ("<|assistant|>", False),
        ("hello", True), ("<|endoftext|>", True),
    ]  # fmt: skip
    open_template.eos_token = None
    with pytest.raises(ValueError, match=r"sample 2: .*message 1\) with no end-of-turn token"):
        tokenize_chat_completion(prompt, answer, open_template, where="sample 2")

    plain = _word_tokenizer(NEWLINE_TEMPLATE, words, ["<|im_start|>"], eos="<|endoftext|>")
    plain.add_tokens(["<|im_end|>"])
    with pytest.raises(ValueError, match=r"sample 3: the chat template ends assistant turn 1 wi"):
        tokenize_chat_completion(prompt, answer, plain, where="sample 3")
