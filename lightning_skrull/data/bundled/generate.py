"""Deterministic generator of the bundled demo datasets.

Regenerate the shipped file with ``python -m lightning_skrull.data.bundled.generate``; the output
is byte-identical on every platform (it uses only :class:`random.Random` and integer arithmetic).

``mixed_tiny``: synthetic prompt/answer samples over a 256-token vocabulary, long-tailed like the
paper's SFT sets scaled down (most samples 16-255 tokens, a few 256-1023, a dozen 1024-2048).
Every sample is ``[BOS, TASK, prompt..., SEP, answer..., EOS]``; ``BOS`` to ``SEP`` are masked
(label ``-100``), the answer and ``EOS`` are supervised. The answer is a fixed function of the
prompt, so the loss of a model that learns falls visibly:

- ``TASK_CHAIN``: ``answer[0] = f(prompt[-1])``, ``answer[j + 1] = f(answer[j])``: each answer
  token follows from the previous one (a bigram rule, learned within a few steps);
- ``TASK_MAP``: ``answer[j] = f(prompt[j])``: each answer token maps the prompt token at the same
  offset (needs attention over the prompt, learned more slowly).

``f`` is one fixed permutation of the content tokens.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from lightning_skrull.data.dataset import IGNORE_INDEX

BOS, EOS, TASK_CHAIN, TASK_MAP, SEP = 0, 1, 2, 3, 4
FIRST_CONTENT_TOKEN = 8
VOCAB_SIZE = 256

MIXED_TINY_SEED = 2505_19609
# (how many samples, shortest, longest, spacing) of each length band.
MIXED_TINY_BANDS = ((336, 16, 255, "log"), (36, 256, 1023, "log"), (12, 1024, 2048, "uniform"))


def _band_lengths(rng: random.Random, count: int, low: int, high: int, spacing: str) -> list[int]:
    """``count`` lengths in ``[low, high]``: log-uniform (weight 1/n) or uniform.

    Only correctly rounded float arithmetic is used (no log/exp), so the draw is the same on
    every platform.
    """
    population = range(low, high + 1)
    if spacing == "uniform":
        return [rng.randint(low, high) for _ in range(count)]
    cumulative = list(itertools.accumulate(1.0 / n for n in population))
    return rng.choices(population, cum_weights=cumulative, k=count)


def _sample(rng: random.Random, length: int, mapping: list[int]) -> dict[str, list[int]]:
    """One sample of exactly ``length`` tokens (``length >= 8``)."""
    answer_len = max(1, (length - 4) // 4)
    prompt_len = length - 4 - answer_len
    prompt = [rng.randrange(FIRST_CONTENT_TOKEN, VOCAB_SIZE) for _ in range(prompt_len)]
    task = rng.choice((TASK_CHAIN, TASK_MAP))
    if task == TASK_CHAIN:
        answer = [mapping[prompt[-1]]]
        while len(answer) < answer_len:
            answer.append(mapping[answer[-1]])
    else:
        answer = [mapping[token] for token in prompt[:answer_len]]
    input_ids = [BOS, task, *prompt, SEP, *answer, EOS]
    labels = [IGNORE_INDEX] * (prompt_len + 3) + [*answer, EOS]
    return {"input_ids": input_ids, "labels": labels}


def generate_mixed_tiny(seed: int = MIXED_TINY_SEED) -> list[dict[str, list[int]]]:
    """The ``mixed_tiny`` samples, in the order they are shipped."""
    rng = random.Random(seed)
    content = list(range(FIRST_CONTENT_TOKEN, VOCAB_SIZE))
    shuffled = content[:]
    rng.shuffle(shuffled)
    mapping = [0] * VOCAB_SIZE
    for source, target in zip(content, shuffled, strict=True):
        mapping[source] = target
    lengths = [n for band in MIXED_TINY_BANDS for n in _band_lengths(rng, *band)]
    rng.shuffle(lengths)
    return [_sample(rng, length, mapping) for length in lengths]


def write_jsonl(samples: list[dict[str, list[int]]], path: Path) -> None:
    """Writes one compact JSON object per line."""
    with path.open("w", encoding="utf-8", newline="\n") as handle:
        for sample in samples:
            handle.write(json.dumps(sample, separators=(",", ":")) + "\n")


def main() -> None:
    """Regenerates ``mixed_tiny.jsonl`` next to this file and prints its length statistics."""
    samples = generate_mixed_tiny()
    path = Path(__file__).with_name("mixed_tiny.jsonl")
    write_jsonl(samples, path)
    lengths = sorted(len(s["input_ids"]) for s in samples)
    supervised = sum(sum(t != IGNORE_INDEX for t in s["labels"]) for s in samples)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    print(f"samples {len(lengths)}, tokens {sum(lengths)}, supervised tokens {supervised}")
    print(f"min {lengths[0]}, median {lengths[len(lengths) // 2]}, max {lengths[-1]}")
    for low, high in ((16, 255), (256, 1023), (1024, 2048)):
        band = [n for n in lengths if low <= n <= high]
        print(f"{low:>5}-{high:<5} {len(band):>4} samples {sum(band):>7} tokens")


if __name__ == "__main__":
    main()
