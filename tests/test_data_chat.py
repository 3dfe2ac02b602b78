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

from lightning_skrull.data import load_sft_data, tokenize_chat

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
        ValueError, match=r"does not render turns 0\.\.1 the same once assistant turn 2"
    ):
        load_sft_data([{"messages": CONVERSATION}], tokenizer=make_tokenizer(UNSTABLE_TEMPLATE))
    with pytest.raises(ValueError, match="No sample has a supervised token"):
        load_sft_data([{"messages": CONVERSATION[:2]}], tokenizer=tokenizer)
