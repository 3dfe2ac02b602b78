"""Text, prompt-completion and conversational prompt-completion samples (TRL's SFT dataset types),
ShareGPT conversations, and conversations with their own tools.

The reference is written out token by token: the test tokenizer is word-level (one token per
whitespace-separated word of :data:`helpers.CHAT_VOCAB`, unknown words ``<unk>``), with
``<|im_end|>`` as its EOS and a post-processor that starts every text with ``<|im_start|>`` as
its BOS, so that both special-token rules (EOS appended by the data, BOS added by the tokenizer)
show in the expectations. TRL's SFTTrainer (``trl``, a test dependency) tokenises the same
samples and must give the same ids and labels, as an independent second reference. Comparisons of tokens are exact (integers); the one training check compares the first
step's loss with plain HF's to 1e-5 (float32 summation order, as the parity tests).

These formats end in the same :class:`SFTDataset` as pre-tokenised data (flat ids and labels), so
the planning, sharding and parallel training of that dataset, tested at DP x CP elsewhere, are
not repeated here: one one-process fit shows the path from a file to the loss.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import (
    CHAT_VOCAB,
    CONVERSATION,
    PLAIN_TEMPLATE,
    PlainLM,
    cpu_trainer,
    make_tokenizer,
    tiny_qwen2,
    token_loss_sum,
)

from lightning_skrull import SkrullDataModule, SkrullStrategy
from lightning_skrull.data import PromptBoundaryWarning, load_sft_data
from lightning_skrull.data.cache import cached_sft_data

BOS, EOS = "<|im_start|>", "<|im_end|>"

# PLAIN_TEMPLATE with a system turn that lists the tools' names when there are tools (and a
# template variable, tool_note, after them): without tools it renders as PLAIN_TEMPLATE.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system tools: {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}{% if tool_note %}{{ tool_note }} {% endif %}<|im_end|> {% endif %}"
    + PLAIN_TEMPLATE
)
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]


def _tokenizer(template: str | None = TOOLS_TEMPLATE, eos: str | None = EOS) -> Any:
    from tokenizers import processors

    tokenizer = make_tokenizer(template)
    tokenizer.eos_token = eos
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, CHAT_VOCAB[BOS])]
    )
    return tokenizer


def _ids(words: str) -> list[int]:
    return [CHAT_VOCAB[w] for w in words.split()]


def _labels(words: str) -> list[int]:
    """``-`` is a masked token (-100)."""
    return [-100 if w == "-" else CHAT_VOCAB[w] for w in words.split()]


def _expect(ids: str, labels: str | None = None) -> dict[str, list[int]]:
    return {"input_ids": _ids(ids), "labels": _ids(ids) if labels is None else _labels(labels)}


def _samples(dataset: Any) -> list[dict[str, list[int]]]:
    return [dataset[i] for i in range(len(dataset))]


def _rows(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``samples`` with every key of any of them (``None`` where absent): Arrow and ``datasets``
    take the columns of a list of dicts from its first."""
    keys = list(dict.fromkeys(key for sample in samples for key in sample))
    return [{key: sample.get(key) for key in keys} for sample in samples]


def _jsonl(path: Path, samples: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path


# Text: EOS appended unless the text ends with it, BOS from the tokenizer, every token supervised.
TEXT = [{"text": "hi there"}, {"text": f"hello{EOS}"}, {"text": "how are you fine thanks"}]
TEXT_EXPECTED = [
    _expect(f"{BOS} hi there {EOS}"),
    _expect(f"{BOS} hello {EOS}"),  # the EOS it ends with is not doubled
    _expect(f"{BOS} how are you fine thanks {EOS}"),
]

# Prompt-completion: the prompt's tokens (BOS included) masked, the completion and its EOS not.
PROMPT_COMPLETION = [
    {"prompt": "hi there", "completion": " hello"},
    {"prompt": "how are you", "completion": f" fine thanks{EOS}"},
    {"prompt": "", "completion": "hello"},  # no prompt: only the BOS is masked
]
PROMPT_COMPLETION_EXPECTED = [
    _expect(f"{BOS} hi there hello {EOS}", f"- - - hello {EOS}"),
    _expect(f"{BOS} how are you fine thanks {EOS}", f"- - - - fine thanks {EOS}"),
    _expect(f"{BOS} hello {EOS}", f"- hello {EOS}"),
]
# "are" + "you" tokenise jointly as one unknown word: the token straddles the end of the prompt,
# so the completion starts at it (TRL's rule) and a PromptBoundaryWarning counts the sample.
STRADDLING = {"prompt": "how are", "completion": "you"}
STRADDLING_EXPECTED = _expect(f"{BOS} how <unk> {EOS}", f"- - <unk> {EOS}")

# Conversational: the prompt rendered with the generation prompt is masked, every token after it
# supervised (the template's end of turn included, no EOS appended). The template adds no BOS
# (chat text is tokenised without special tokens, as apply_chat_template does).
CONVERSATIONAL = [
    {"prompt": CONVERSATION[:2], "completion": CONVERSATION[2:3]},
    {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]},
    {"prompt": CONVERSATION[:2], "completion": CONVERSATION[2:]},  # a completion of 3 messages
]
_TURNS = (
    f"{BOS} system be brief {EOS} {BOS} user hi there {EOS} {BOS} assistant hello {EOS} "
    f"{BOS} user how are you {EOS} {BOS} assistant fine thanks {EOS}"
)
_FIRST_TURNS = " ".join(_TURNS.split()[:14])
CONVERSATIONAL_EXPECTED = [
    _expect(_FIRST_TURNS, "- " * 12 + f"hello {EOS}"),
    _expect(_TURNS, "- " * 22 + f"fine thanks {EOS}"),
    _expect(_TURNS, "- " * 12 + " ".join(_TURNS.split()[12:])),  # the user turn too
]

# Chat: assistant turns (content and end of turn) supervised, everything else masked; a sample's
# tools (here as a JSON string, as Hub datasets store them) listed first by the template.
_CHAT_LABELS = "- " * 12 + f"hello {EOS} " + "- " * 8 + f"fine thanks {EOS}"
_TOOL_TURN = f"{BOS} system tools: weather {EOS}"
MESSAGES = [
    {"messages": CONVERSATION, "tools": json.dumps(TOOLS)},
    {"messages": CONVERSATION[:3], "tools": None},
    {"messages": CONVERSATION[:3], "tools": "[]"},  # no tools
]
MESSAGES_EXPECTED = [
    _expect(f"{_TOOL_TURN} {_TURNS}", "- - - - - " + _CHAT_LABELS),
    _expect(_FIRST_TURNS, "- " * 12 + f"hello {EOS}"),
    _expect(_FIRST_TURNS, "- " * 12 + f"hello {EOS}"),
]

# ShareGPT: human -> user, gpt and function_call -> assistant, observation -> tool; a 'system'
# key is a first system turn. The same tokens as the messages they convert to.
_SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt"}
SHAREGPT_CONVERSATION = [
    {"from": _SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in CONVERSATION
]
SHAREGPT = [
    {"conversations": SHAREGPT_CONVERSATION},
    {"conversations": SHAREGPT_CONVERSATION[1:3], "system": "be brief"},
    {
        "conversations": [
            {"from": "human", "value": "weather paris"},
            {"from": "function_call", "value": "weather paris"},
            {"from": "observation", "value": "sunny"},
            {"from": "gpt", "value": "sunny thanks"},
        ],
        "tools": json.dumps(TOOLS),
    },
]
SHAREGPT_EXPECTED = [
    _expect(_TURNS, _CHAT_LABELS),
    _expect(_FIRST_TURNS, "- " * 12 + f"hello {EOS}"),
    _expect(
        f"{_TOOL_TURN} {BOS} user weather paris {EOS} {BOS} assistant weather paris {EOS} "
        f"{BOS} tool sunny {EOS} {BOS} assistant sunny thanks {EOS}",
        "- " * 12 + f"weather paris {EOS} " + "- " * 6 + f"sunny thanks {EOS}",
    ),
]

FORMATS = {
    "text": (TEXT, TEXT_EXPECTED),
    "prompt-completion": (PROMPT_COMPLETION, PROMPT_COMPLETION_EXPECTED),
    "conversational prompt-completion": (CONVERSATIONAL, CONVERSATIONAL_EXPECTED),
    "messages with tools": (MESSAGES, MESSAGES_EXPECTED),
    "sharegpt": (SHAREGPT, SHAREGPT_EXPECTED),
}


# ------------------------------------------------------------------ token by token
@pytest.mark.parametrize("name", FORMATS)
def test_each_format_token_by_token(name: str) -> None:
    samples, expected = FORMATS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no boundary straddles in these samples
        assert _samples(load_sft_data(samples, tokenizer=_tokenizer())) == expected


def test_a_token_across_the_prompt_boundary_is_supervised_and_warned() -> None:
    samples = [*PROMPT_COMPLETION, STRADDLING, STRADDLING]
    with pytest.warns(PromptBoundaryWarning) as record:
        dataset = load_sft_data(samples, tokenizer=_tokenizer())
    assert _samples(dataset) == [
        *PROMPT_COMPLETION_EXPECTED,
        STRADDLING_EXPECTED,
        STRADDLING_EXPECTED,
    ]
    assert len(record) == 1  # one warning that counts them
    assert str(record[0].message).startswith(
        "2 prompt-completion sample(s) have a token that straddles the end of the prompt (the "
        "first is sample 3)"
    )


def _load(samples: list[dict[str, Any]], **kwargs: Any) -> list[dict[str, list[int]]]:
    return _samples(load_sft_data(samples, tokenizer=_tokenizer(), **kwargs))


def test_sharegpt_gives_the_tokens_of_the_same_messages() -> None:
    to_role = {"human": "user", "gpt": "assistant", "function_call": "assistant"}
    to_role |= {"observation": "tool", "system": "system"}
    for sample in SHAREGPT:
        messages = [
            {"role": to_role[t["from"]], "content": t["value"]} for t in sample["conversations"]
        ]
        if "system" in sample:
            messages.insert(0, {"role": "system", "content": sample["system"]})
        tools = {"tools": sample["tools"]} if "tools" in sample else {}
        for turns in ("all", "last"):
            expected = _load([{"messages": messages, **tools}], chat_turns=turns)
            assert _load([sample], chat_turns=turns) == expected, (sample, turns)
    # "user" and "assistant" are accepted as they are (TRL renames only the keys)
    plain = [{"from": m["role"], "value": m["content"]} for m in CONVERSATION]
    assert _load([{"conversations": plain}]) == SHAREGPT_EXPECTED[:1]


def test_a_samples_tools_combine_with_the_dataset_wide_template_arguments() -> None:
    note = {"tool_note": "paris"}
    with_note = [
        _expect(
            f"{BOS} system tools: weather paris {EOS} {_FIRST_TURNS}", "- " * 18 + f"hello {EOS}"
        )
    ]
    # a list of schemas, as in memory; the dataset-wide template variables still apply
    samples = [{"messages": CONVERSATION[:3], "tools": TOOLS}]
    assert _load(samples, chat_template_kwargs=note) == with_note
    # tools given both ways for one sample are refused: which to render is ambiguous
    with pytest.raises(
        ValueError,
        match=r"sample 0 has its own tools and chat_template_kwargs holds tools too; it is "
        r"ambiguous which to render\. Give tools one way",
    ):
        _load(samples, chat_template_kwargs={"tools": TOOLS})
    # dataset-wide tools reach a sample without its own
    assert _load([{"messages": CONVERSATION[:3]}], chat_template_kwargs={"tools": TOOLS}) == [
        _expect(f"{_TOOL_TURN} {_FIRST_TURNS}", "- " * 17 + f"hello {EOS}")
    ]
    # and a conversational prompt-completion sample's own tools
    pair = [{**CONVERSATIONAL[0], "tools": json.dumps(TOOLS)}]
    assert _load(pair, chat_template_kwargs=note) == with_note


# ------------------------------------------------------------------ every input, and the cache
@pytest.mark.parametrize("name", FORMATS)
def test_every_input_kind_and_the_cache_give_the_written_out_tokens(
    tmp_path: Path, name: str
) -> None:
    samples, expected = FORMATS[name]
    tokenizer = _tokenizer()
    jsonl = _jsonl(tmp_path / "d.jsonl", samples)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(samples)), parquet)
    hf_files = datasets.Dataset.from_parquet(str(parquet), cache_dir=str(tmp_path / "hf"))
    for data in (samples, jsonl, parquet, datasets.Dataset.from_list(_rows(samples)), hf_files):
        assert _samples(load_sft_data(data, tokenizer=tokenizer)) == expected, data
    # A file of more samples than one tokenisation task holds (512), so that the cache is
    # tokenised by 2 worker processes, and through the data module as a run reads it.
    many = samples * 200
    pq.write_table(pa.Table.from_pylist(_rows(many)), tmp_path / "many.parquet")
    for data in (_jsonl(tmp_path / "many.jsonl", many), tmp_path / "many.parquet", hf_files):
        module = SkrullDataModule(
            train_data=data,
            global_batch_size=4,
            tokenizer=_tokenizer(),
            cache_dir=tmp_path / "cache",
            num_proc=2,
        )
        module.prepare_data()
        module.setup("fit")
        dataset = module.train_dataset
        assert dataset is not None and isinstance(dataset._input_ids, np.memmap)
        assert _samples(dataset) == (expected if data is hf_files else expected * 200)
    # the cache is reused, and a tokenizer whose EOS differs gets its own (for text and
    # standard prompt-completion the EOS is in the tokens)
    cache = tmp_path / "cache"
    again = cached_sft_data(jsonl, tokenizer=_tokenizer(), cache_dir=cache, progress=False)
    first = cached_sft_data(jsonl, tokenizer=_tokenizer(), cache_dir=cache, progress=False)
    assert not first.built and first.path == again.path
    other = cached_sft_data(
        jsonl, tokenizer=_tokenizer(eos="</think>"), cache_dir=cache, progress=False
    )
    assert other.built and other.path != first.path


def test_the_cache_warns_of_straddling_boundaries_when_built_and_reused(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [*PROMPT_COMPLETION, STRADDLING])
    for built in (True, False):
        with pytest.warns(PromptBoundaryWarning, match=r"^1 prompt-completion sample\(s\)"):
            cached = cached_sft_data(
                path, tokenizer=_tokenizer(), cache_dir=tmp_path / "c", progress=False
            )
        assert cached.built == built
        assert _samples(cached.dataset) == [*PROMPT_COMPLETION_EXPECTED, STRADDLING_EXPECTED]


# ------------------------------------------------------------------ errors
def test_mixed_formats_are_refused_in_memory_and_across_the_cache_chunks(tmp_path: Path) -> None:
    tokenizer = _tokenizer()
    with pytest.raises(
        ValueError,
        match=r"sample 1 is a text sample but sample 0 is a prompt-completion sample; a dataset "
        r"holds one format .*\(a text sample is the prompt-completion sample",
    ):
        load_sft_data([PROMPT_COMPLETION[0], TEXT[0]], tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"sample 2 is a messages sample but sample 1 is a conv"):
        load_sft_data(
            [{"input_ids": [3]}, CONVERSATIONAL[0], {"messages": CONVERSATION}],
            tokenizer=tokenizer,
        )
    # ShareGPT and messages samples are two formats, like the others
    with pytest.raises(
        ValueError, match=r"sample 1 is a messages sample but sample 0 is a conversations sample"
    ):
        load_sft_data([SHAREGPT[0], MESSAGES[0]], tokenizer=tokenizer)
    # pre-tokenised samples mix with any format
    mixed = load_sft_data([{"input_ids": [3, 4]}, *TEXT], tokenizer=tokenizer)
    assert _samples(mixed) == [{"input_ids": [3, 4], "labels": [3, 4]}, *TEXT_EXPECTED]
    # 512 text samples fill the first task of the cache, the prompt-completion ones the second:
    # the error comes when the chunks meet, the same as loading directly
    path = _jsonl(tmp_path / "mixed.jsonl", TEXT[:1] * 512 + PROMPT_COMPLETION)
    with pytest.raises(ValueError) as direct:
        load_sft_data(path, tokenizer=tokenizer)
    with pytest.raises(ValueError) as cached:
        cached_sft_data(path, tokenizer=tokenizer, cache_dir=tmp_path / "c", num_proc=2)
    assert str(cached.value) == str(direct.value)
    assert str(direct.value).startswith(
        f"sample 512 ({path} line 513) is a prompt-completion sample but sample 0 ({path} "
        "line 1) is a text sample"
    )


@pytest.mark.parametrize(
    ("samples", "tokenizer", "error", "message"),
    [
        (TEXT, None, ValueError, r"sample 0 is a text sample but no tokenizer was given; pass"),
        (PROMPT_COMPLETION, None, ValueError, "sample 0 is a prompt-completion sample but no tok"),
        (CONVERSATIONAL, None, ValueError, "sample 0 is a conversational prompt-completion sam"),
        (TEXT, "no eos", ValueError, "has no eos_token, which text samples end with"),
        (CONVERSATIONAL, "no template", ValueError, "has no chat_template"),
        (TEXT, object(), TypeError, "tokenizer must be a Hugging Face tokenizer, got object"),
        ([{"text": ""}], "ok", ValueError, "sample 0: text is empty; there is nothing to learn"),
        ([{"text": 3}], "ok", ValueError, "sample 0: text must be a string, got a int"),
        (
            [{"prompt": "hi", "completion": ""}],
            "ok",
            ValueError,
            "sample 0: completion is empty; there is nothing to learn from it",
        ),
        (
            [{"prompt": CONVERSATION[:2], "completion": []}],
            "ok",
            ValueError,
            "sample 0: completion is an empty list, so there is nothing to learn",
        ),
        (
            [{"prompt": [], "completion": CONVERSATION[2:3]}],
            "ok",
            ValueError,
            "sample 0: 'prompt' must be a non-empty list",
        ),
        (
            [{"prompt": "hi", "completion": CONVERSATION[2:3]}],
            "ok",
            ValueError,
            "sample 0: prompt is a string and completion is a list; give both as strings",
        ),
        (
            [{"prompt": "hi", "answer": "hello"}],
            "ok",
            ValueError,
            r"sample 0 has a 'prompt' but no 'completion'; a prompt-completion sample needs both",
        ),
        (
            [{"text": "hi", "prompt": "hi", "completion": "hello"}],
            "ok",
            ValueError,
            r"sample 0 holds \['text', 'prompt', 'completion'\], the keys of more than one format",
        ),
        (
            [{"question": "hi", "answer": "hello"}],
            "ok",
            ValueError,
            r"sample 0 has keys \['answer', 'question'\]; none of them names a sample format. "
            r"Accepted formats: \{'input_ids': \[...\], 'labels': \[...\]\} \(labels optional\), "
            r"\{'messages': \[...\]\}, \{'conversations': \[\{'from': ..., 'value': ...\}\]\}, "
            r"\{'text': '...'\}, \{'prompt': '...', 'completion': '...'\} or \{'prompt': "
            r"\[messages\], 'completion': \[messages\]\}",
        ),
        (SHAREGPT, None, ValueError, r"sample 0 is a ShareGPT chat sample \('conversations'\) but"),
        (
            [{"conversations": CONVERSATION}],
            "ok",
            ValueError,
            r"sample 0: conversations\[0\] = \{'role': 'system', 'content': 'be brief'\} is not a "
            r"dict with 'from' and 'value'; every ShareGPT turn must look like",
        ),
        (
            [{"conversations": [{"from": "bot", "value": "hi"}]}],
            "ok",
            ValueError,
            r"sample 0: conversations\[0\] has from='bot', which is not a known ShareGPT role\. "
            r"Accepted roles: 'human' -> 'user', 'user' -> 'user', 'gpt' -> 'assistant', "
            r"'assistant' -> 'assistant', 'function_call' -> 'assistant', 'system' -> 'system', "
            r"'observation' -> 'tool', 'tool' -> 'tool'\. Rename the role in the data to one of "
            r"them, or convert the sample to \{'messages'",
        ),
        (
            [
                {
                    "conversations": [
                        {"from": "human", "value": "hi"},
                        {"from": "gpt", "value": "hello", "weight": 1},
                        {"from": "human", "value": "and?"},
                        {"from": "gpt", "value": "bye", "weight": 0},
                    ]
                }
            ],
            "ok",
            ValueError,
            r"sample 0: conversations\[3\] has weight=0 \(axolotl's per-turn training switch\), "
            r"which is not read here: every assistant turn is supervised",
        ),
        (
            [{"conversations": SHAREGPT_CONVERSATION, "system": "be brief"}],
            "ok",
            ValueError,
            r"sample 0 has a 'system' prompt and a first turn from 'system'; give the system",
        ),
        (
            [{"messages": CONVERSATION, "tools": "[{'name': 'weather'}]"}],
            "ok",
            ValueError,
            r"sample 0: tools is a string but not valid JSON \(Expecting property name",
        ),
        (
            [{"messages": CONVERSATION, "tools": TOOLS[0]}],
            "ok",
            ValueError,
            r"sample 0: tools must be a list of JSON schemas \(dicts\) or a JSON string of one, "
            r"got \{'type': 'function'.*; for one tool give \[schema\]",
        ),
        (
            [{"prompt": "hi", "completion": "hello", "tools": TOOLS}],
            "ok",
            ValueError,
            r"sample 0 is a prompt-completion sample with tools; tools are rendered by the chat "
            r"template, so only conversations",
        ),
    ],
)
def test_bad_samples_and_tokenizers_are_refused(
    samples: list[Any], tokenizer: Any, error: type[Exception], message: str
) -> None:
    if tokenizer == "ok":
        tokenizer = _tokenizer()
    elif tokenizer == "no eos":
        tokenizer = _tokenizer(eos=None)
    elif tokenizer == "no template":
        tokenizer = _tokenizer(template=None)
    with pytest.raises(error, match=message):
        load_sft_data(samples, tokenizer=tokenizer)


def test_errors_name_the_file_line_and_row(tmp_path: Path) -> None:
    tokenizer = _tokenizer()
    path = _jsonl(tmp_path / "d.jsonl", [TEXT[0], {"txt": "hi"}])
    with pytest.raises(ValueError, match=rf"sample 1 \({path} line 2\) has keys \['txt'\]; none"):
        load_sft_data(path, tokenizer=tokenizer)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "hi", "answer": "x"}]), parquet)
    with pytest.raises(ValueError, match=r"d.parquet has columns \['question', 'answer'\]; none"):
        load_sft_data(parquet, tokenizer=tokenizer)
    # a table made by mixing sources has nulls where a row lacks a column: read per row
    nulls = {"text": None, "prompt": None, "completion": None}
    table = pa.Table.from_pylist([{**nulls, **TEXT[0]}, {**nulls, **PROMPT_COMPLETION[0]}, nulls])
    pq.write_table(table, parquet)
    with pytest.raises(ValueError, match=r"sample 1 \(.*d.parquet row 1\) is a prompt-complet"):
        load_sft_data(parquet, tokenizer=tokenizer)
    pq.write_table(table.slice(1), parquet)
    with pytest.raises(
        ValueError,
        match=r"sample 1 \(.*d.parquet row 1\) has keys \['completion', 'prompt', 'text'\], and "
        r"\['text', 'prompt', 'completion'\] are null; none of them names a sample format",
    ):
        load_sft_data(parquet, tokenizer=tokenizer)
    # and so are the nulls of JSON Lines written from such a table
    jsonl = _jsonl(tmp_path / "nulls.jsonl", table.slice(1, 1).to_pylist())
    assert '"text": null' in jsonl.read_text()
    assert _samples(load_sft_data(jsonl, tokenizer=tokenizer)) == PROMPT_COMPLETION_EXPECTED[:1]
    with pytest.raises(ValueError, match="val_data is one sample dict"):
        SkrullDataModule(val_data=TEXT[0])


def test_a_template_that_renders_the_prompt_otherwise_before_a_completion_is_refused() -> None:
    # the generation prompt opens a thinking block that the rendered conversation does not hold
    template = PLAIN_TEMPLATE.replace(
        "<|im_start|>assistant {% endif %}", "<|im_start|>assistant <think> {% endif %}"
    )
    with pytest.raises(
        ValueError,
        match=r"sample 0: the chat template renders the prompt \(with the generation prompt\) "
        r"differently once the completion follows \('<think> ' vs 'hello<|im_end|> '\)",
    ):
        load_sft_data(CONVERSATIONAL[:1], tokenizer=_tokenizer(template))


# ------------------------------------------------------------------ TRL gives the same labels
def test_labels_equal_trl_sft_trainer(tmp_path: Path) -> None:
    import trl

    tokenizer = _tokenizer()
    model = tiny_qwen2()
    cases = [TEXT, [*PROMPT_COMPLETION, STRADDLING], CONVERSATIONAL]
    for samples in cases:
        args = trl.SFTConfig(
            output_dir=str(tmp_path / "trl"), report_to=[], max_length=None, use_cpu=True
        )
        trainer = trl.SFTTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(samples),
            processing_class=tokenizer,
        )
        theirs = [
            {"input_ids": row["input_ids"], "labels": row["labels"]}
            for row in trainer.train_dataset
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PromptBoundaryWarning)
            ours = _samples(load_sft_data(samples, tokenizer=tokenizer))
        assert ours == theirs, samples[0]


# Tool calls and tool schemas whose keys differ between samples: Arrow stores each nested column
# as one struct type, the union of every row's keys, so each read back holds None for the keys
# only the other sample has. The template renders the schemas and the calls with tojson, and tests
# for the key "tool_calls" (as Llama 3.1's does).
CALLS_TEMPLATE = (
    "{% if tools %}<s>tools:{{ tools | tojson }}</s>{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}:{% if 'tool_calls' in m %}"
    "{% for c in m['tool_calls'] %}{{ c['function'] | tojson }}{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def _schema(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CALLS = [
    {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [_call("weather", {"city": "Paris"})]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ],
        "tools": [_schema("weather", {"city": {"type": "string"}})],
    },
    {
        "messages": [
            {"role": "user", "content": "time?"},
            {"role": "assistant", "tool_calls": [_call("time", {"zone": "UTC"})]},
        ],
        "tools": [_schema("time", {"zone": {"type": "string", "enum": ["UTC", None]}})],
    },
]


def _char_tokenizer(template: str) -> Any:
    """One token per character (printable ASCII), ``<s>`` and ``</s>`` special, ``</s>`` the EOS:
    any difference in the rendered text is a difference in the ids."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {token: i for i, token in enumerate(["<unk>", *chars, "<s>", "</s>"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<s>"], "eos_token": "</s>"})
    tokenizer.chat_template = template
    return tokenizer


def test_nested_values_read_from_arrow_render_as_written(tmp_path: Path) -> None:
    tokenizer = _char_tokenizer(CALLS_TEMPLATE)
    expected = _samples(load_sft_data(CALLS, tokenizer=tokenizer))  # plain Python: no Arrow
    first = "".join(tokenizer.convert_ids_to_tokens(expected[0]["input_ids"]))
    assert '{"name": "weather", "arguments": {"city": "Paris"}}' in first
    assert "null" not in first and first.count("weather") == 3
    # what Arrow gives back: the union of the samples' keys, None for each one a sample lacks
    table = pa.Table.from_pylist(CALLS)
    read_back = table.to_pylist()[0]
    assert read_back["messages"][1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris",
        "zone": None,
    }
    assert read_back["messages"][0]["tool_calls"] is None
    parquet = tmp_path / "calls.parquet"
    pq.write_table(table, parquet)
    hf_files = datasets.Dataset.from_parquet(str(parquet), cache_dir=str(tmp_path / "hf"))
    for data in (parquet, datasets.Dataset.from_list(CALLS), hf_files):
        assert _samples(load_sft_data(data, tokenizer=tokenizer)) == expected, data
    cached = cached_sft_data(parquet, tokenizer=tokenizer, cache_dir=tmp_path / "c", progress=False)
    assert _samples(cached.dataset) == expected
    # a None inside a list is kept: only dict entries are dropped
    second = "".join(tokenizer.convert_ids_to_tokens(expected[1]["input_ids"]))
    assert second.count('"enum": ["UTC", null]') == 1


def test_tools_and_sharegpt_render_as_trl_sft_trainer(tmp_path: Path) -> None:
    """A sample's own tools (a JSON string or a list) render as TRL renders them, and a ShareGPT
    sample with TRL's role names tokenises as TRL's conversion of it. TRL supervises every token
    of a messages sample by default (chat labels are compared token by token above), so the ids
    are compared here; conversational prompt-completion labels too."""
    import trl

    tokenizer = _tokenizer()
    plain = [{"from": m["role"], "value": m["content"]} for m in CONVERSATION]
    cases = [
        ([{**s, "tools": json.dumps(TOOLS)} for s in CONVERSATIONAL], True),
        ([{**CONVERSATIONAL[0], "tools": TOOLS}, CONVERSATIONAL[1]], True),
        (MESSAGES, False),
        ([{"conversations": plain}, {"conversations": plain[:3]}], False),
    ]
    for samples, compare_labels in cases:
        args = trl.SFTConfig(
            output_dir=str(tmp_path / "trl"), report_to=[], max_length=None, use_cpu=True
        )
        trainer = trl.SFTTrainer(
            model=tiny_qwen2(),
            args=args,
            train_dataset=datasets.Dataset.from_list(_rows(samples)),
            processing_class=tokenizer,
        )
        ours = _samples(load_sft_data(samples, tokenizer=tokenizer))
        theirs = list(trainer.train_dataset)
        assert [s["input_ids"] for s in ours] == [s["input_ids"] for s in theirs], samples[0]
        if compare_labels:
            assert [s["labels"] for s in ours] == [s["labels"] for s in theirs], samples[0]
        # the first sample's tools were rendered (its ids open with the tool turn)
        has_tools = "tools" in samples[0] and samples[0]["tools"]
        assert (ours[0]["input_ids"][:5] == _ids(_TOOL_TURN)) == bool(has_tools), samples[0]


# ------------------------------------------------------------------ a fit from a file
FIT_SAMPLES = [
    {"prompt": "be brief hi there how are you", "completion": " fine thanks"},
    {"prompt": "hi", "completion": " hello"},
    {"prompt": "how are you", "completion": " fine"},
    {"prompt": "hi there hi there hi there", "completion": " hello there hello there"},
    {"prompt": "be brief", "completion": " hello how are you"},
    {"prompt": "hi", "completion": " fine thanks fine thanks fine thanks"},
]
FIT_EXPECTED = [
    _expect(
        f"{BOS} be brief hi there how are you fine thanks {EOS}",
        f"- - - - - - - - fine thanks {EOS}",
    ),
    _expect(f"{BOS} hi hello {EOS}", f"- - hello {EOS}"),
    _expect(f"{BOS} how are you fine {EOS}", f"- - - - fine {EOS}"),
    _expect(
        f"{BOS} hi there hi there hi there hello there hello there {EOS}",
        f"- - - - - - - hello there hello there {EOS}",
    ),
    _expect(f"{BOS} be brief hello how are you {EOS}", f"- - - hello how are you {EOS}"),
    _expect(
        f"{BOS} hi fine thanks fine thanks fine thanks {EOS}",
        f"- - fine thanks fine thanks fine thanks {EOS}",
    ),
]


def test_fit_from_a_prompt_completion_file_has_plain_hf_loss(
    world_of_one: None, tmp_path: Path
) -> None:
    path = _jsonl(tmp_path / "qa.jsonl", FIT_SAMPLES)
    data = SkrullDataModule(
        train_data=path,
        global_batch_size=len(FIT_SAMPLES),
        shuffle=False,
        tokenizer=_tokenizer(),
        cache_dir=tmp_path / "cache",
        num_proc=1,
    )
    module = PlainLM()
    # 50 tokens in buckets of 16: several micro-batches in the step
    trainer = cpu_trainer(SkrullStrategy(bucket_size=16), max_steps=1, log_every_n_steps=1)
    trainer.fit(module, data)
    assert data.train_dataset is not None
    assert _samples(data.train_dataset) == FIT_EXPECTED
    assert trainer.callback_metrics["skrull/micro_batches_max"] >= 2
    # the reference: plain HF on the written-out tokens, one sequence at a time, before the step
    reference = tiny_qwen2()
    with torch.no_grad():
        sums = [token_loss_sum(reference, sample) for sample in FIT_EXPECTED]
    loss = float(sum(s for s, _ in sums)) / sum(n for _, n in sums)
    # float32 summation order of the packed computation (as the parity tests)
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(loss, abs=1e-5)
