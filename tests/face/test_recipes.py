"""The Llama 3.1, Gemma 3, Mistral Small 3.2 and gpt-oss recipes: their memory figures are the
analytical memory model's, they fit the GPU they name, and each one trains a tiny model of its
family (gpt-oss's stored in MXFP4, as the released checkpoint is).

The published ``config.json`` values of each checkpoint are written out below (no network
here). The memory model (:mod:`benchmarks.memory_estimate`) reads each whole
config: the text decoder with its norms and head (Gemma 3's tied), and the vision tower and
projector of the two vision-language checkpoints. Every figure in a
recipe's header (GiB, KiB and K-token numbers) must be one computed here: a header that drifts
from the code fails.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import (
    CHAT_VOCAB,
    GPT_OSS_MXFP4,
    PLAIN_TEMPLATE,
    make_tokenizer,
    save_mxfp4_gpt_oss,
    tiny_config,
)

from benchmarks.memory_estimate import (
    MemoryStrategy,
    activation_bytes_per_token,
    activation_bytes_per_token_checkpointed,
    largest_bucket,
    model_state_bytes,
    parameter_count,
)
from lightning_skrull import SkrullDataModule
from lightning_skrull.causal_lm import SkrullCausalLM
from lightning_skrull.cli import TINY_CPU_TRAINER, PlanStatsPrinter, SkrullCLI
from lightning_skrull.scheduling.shapes import ModelShape

CONFIGS = Path(__file__).parents[2] / "examples" / "configs"
GIB = 2**30
KIB = 2**10
DEVICES = {"80 GB": 81_559 * 2**20, "141 GB": 143_771 * 2**20}
"""Device memory as CUDA reports it (benchmarks/memory_table.py): H100 80GB, H200."""
MARGIN = 0.1
"""Share of the device kept free, as ``bucket_size="auto"`` and ``largest_bucket`` keep it."""

# ----------------------------------------------------------------------------- published configs
LLAMA_3_1_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}
"""meta-llama/Llama-3.1-8B-Instruct (``LlamaForCausalLM``; 8.03B parameters)."""

GEMMA_3_27B: dict[str, Any] = {
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "query_pre_attn_scalar": 168,
        "sliding_window": 1024,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    },
    "vision_config": {
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "image_size": 896,
        "patch_size": 14,
        "vision_use_head": False,
    },
    "mm_tokens_per_image": 256,
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "image_token_index": 262144,
}
"""google/gemma-3-27b-it (``Gemma3ForConditionalGeneration``; 27.4B parameters, the head tied to
the embedding; every sixth layer global, the others sliding over 1024 keys)."""

MISTRAL_SMALL_3_2_24B: dict[str, Any] = {
    "model_type": "mistral3",
    "text_config": {
        "model_type": "mistral",
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 131072,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000000.0,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "head_dim": 64,
        "image_size": 1540,
        "patch_size": 14,
        "rope_theta": 10000.0,
    },
    "image_token_index": 10,
    "spatial_merge_size": 2,
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -1,
    "tie_word_embeddings": False,
}
"""mistralai/Mistral-Small-3.2-24B-Instruct-2506 (``Mistral3ForConditionalGeneration``; 24.0B
parameters, an untied head; no sliding window)."""


GPT_OSS_20B: dict[str, Any] = {
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "vocab_size": 201088,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "initial_context_length": 4096,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "rms_norm_eps": 1e-5,
    "router_aux_loss_coef": 0.9,
    "output_router_logits": False,
    "tie_word_embeddings": False,
    "quantization_config": GPT_OSS_MXFP4,
}
"""openai/gpt-oss-20b (``GptOssForCausalLM``; 20.91B parameters, an untied head; layers alternate
a 128-token sliding window and full attention; the experts stored in MXFP4)."""


def hf_config(fields: dict[str, Any]) -> Any:
    """The transformers config of ``fields`` (``model_type`` plus the published values)."""
    from transformers import AutoConfig

    rest = dict(fields)
    return AutoConfig.for_model(rest.pop("model_type"), **rest)


def meta_model(fields: dict[str, Any]) -> torch.nn.Module:
    """The checkpoint's model class built on the meta device (no memory): its exact parameters."""
    from lightning_skrull.models.loading import auto_model_class

    config = hf_config(fields)
    with torch.device("meta"):
        return auto_model_class(config).from_config(config)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- recipes
@dataclass(frozen=True)
class Recipe:
    """What a recipe's memory figures depend on (and the file they are checked against)."""

    file: str
    config: dict[str, Any]
    strategy: MemoryStrategy
    device: str
    checkpoint_class: str
    compared: tuple[MemoryStrategy, ...] = ()
    """Other strategies whose model states the header names (same layout)."""
    alternatives: tuple[tuple[MemoryStrategy, int, str], ...] = ()
    """Other ``(strategy, world size, device)`` the header suggests: states and largest bucket."""
    dense_head: bool = False
    """The header names what the dense loss's head would keep per token."""


RECIPES = [
    Recipe("llama3.1-8b.yaml", LLAMA_3_1_8B, "fsdp_world", "80 GB", "LlamaForCausalLM",
           compared=("ddp", "zero2", "fsdp_cp")),
    Recipe("gemma3-27b.yaml", GEMMA_3_27B, "fsdp_cp", "141 GB", "Gemma3ForConditionalGeneration",
           compared=("zero2", "fsdp_world"), alternatives=(("fsdp_world", 32, "80 GB"),),
           dense_head=True),
    Recipe("mistral-small-3.2-24b.yaml", MISTRAL_SMALL_3_2_24B, "fsdp_cp", "80 GB",
           "Mistral3ForConditionalGeneration", compared=("zero2",),
           alternatives=(("fsdp_cp", 16, "141 GB"),)),
    Recipe("gpt-oss-20b.yaml", GPT_OSS_20B, "fsdp_world", "80 GB", "GptOssForCausalLM",
           compared=("ddp", "zero2", "fsdp_cp"), dense_head=True),
]  # fmt: skip


def load(recipe: Recipe) -> tuple[dict[str, Any], str]:
    """The recipe's YAML and its header (the comment lines before the first key)."""
    text = (CONFIGS / recipe.file).read_text()
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("# "))
    return yaml.safe_load(text), " ".join(header)


def layout(values: dict[str, Any]) -> tuple[int, int, int]:
    """``(world size, cp_size, bucket_size)`` of a parsed recipe."""
    trainer = values["trainer"]
    args = trainer["strategy"]["init_args"]
    return trainer["devices"] * trainer["num_nodes"], args["cp_size"], args["bucket_size"]


def gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def kilo_tokens(tokens: int) -> str:
    return f"{tokens / 1000:.1f}K"


@dataclass(frozen=True)
class Figures:
    """A recipe's memory figures, the memory model's."""

    states: float
    per_token: float
    peak: float
    largest: int
    text: tuple[str, ...]
    """Every figure as the header writes it."""


def figures(recipe: Recipe) -> Figures:
    """The recipe's figures from the memory model and the published config (a vision-language
    one whole: its text decoder, tied head and vision tower)."""
    values, _ = load(recipe)
    world, cp, bucket = layout(values)
    shape = ModelShape.from_hf_config(hf_config(recipe.config))
    capacity = DEVICES[recipe.device]
    states = model_state_bytes(shape, recipe.strategy, cp_size=cp, world_size=world).total
    per_token = activation_bytes_per_token_checkpointed(shape, chunked_loss=True)
    largest = largest_bucket(
        shape,
        recipe.strategy,
        capacity,
        cp_size=cp,
        world_size=world,
        activation_checkpointing=True,
    )
    count = parameter_count(shape)
    peak = states + bucket * per_token
    text_figures = [
        gib(states),
        f"{round(per_token / KIB)} KiB",
        gib(bucket * per_token),
        gib(peak),
        gib(capacity),
        gib((1 - MARGIN) * capacity),
        kilo_tokens(largest),
        recipe.device,
        f"{round(2 * count.total / 1e9)} GB",
    ]
    if count.vision:
        text_figures.append(f"{count.vision / 1e9:.2f}B")
    if recipe.dense_head:
        dense = activation_bytes_per_token(shape, chunked_loss=False).head
        text_figures.append(f"{dense / 2**20:.1f} MiB")
    for other, other_world, device in recipe.alternatives:
        text_figures.append(
            gib(model_state_bytes(shape, other, cp_size=cp, world_size=other_world).total)
        )
        tokens = largest_bucket(
            shape,
            other,
            DEVICES[device],
            cp_size=cp,
            world_size=other_world,
            activation_checkpointing=True,
        )
        text_figures += [kilo_tokens(tokens), device]
    for other in recipe.compared:
        text_figures.append(
            gib(model_state_bytes(shape, other, cp_size=cp, world_size=world).total)
        )
    return Figures(states=states, per_token=per_token, peak=peak, largest=largest,
                   text=tuple(text_figures))  # fmt: skip


IDS = [r.file for r in RECIPES]


def test_the_recipes_ship() -> None:
    assert {r.file for r in RECIPES} <= {p.name for p in CONFIGS.glob("*.yaml")}


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_the_published_config_is_the_checkpoint_the_recipe_names(recipe: Recipe) -> None:
    # the class the CLI loads, and the parameter count of the model card; the memory model's
    # count equals the Hugging Face model's exactly (vision tower and tied head included)
    values, _ = load(recipe)
    model = meta_model(recipe.config)
    assert type(model).__name__ == recipe.checkpoint_class
    total = sum(p.numel() for p in model.parameters())
    card = {
        "llama3.1-8b.yaml": (8.03, 0.05),
        "gemma3-27b.yaml": (27.4, 0.05),
        "mistral-small-3.2-24b.yaml": (24.0, 0.05),
        "gpt-oss-20b.yaml": (20.91, 0.005),
    }
    billions, within = card[recipe.file]
    assert total / 1e9 == pytest.approx(billions, abs=within)
    assert parameter_count(ModelShape.from_hf_config(hf_config(recipe.config))).total == total
    hub = {
        "llama3.1-8b.yaml": "meta-llama/Llama-3.1-8B-Instruct",
        "gemma3-27b.yaml": "google/gemma-3-27b-it",
        "mistral-small-3.2-24b.yaml": "mistralai/Mistral-Small-3.2-24B-Instruct-2506",
        "gpt-oss-20b.yaml": "openai/gpt-oss-20b",
    }[recipe.file]
    assert values["model"]["model"] == values["data"]["tokenizer"] == hub


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_the_recipe_fits_the_gpu_its_header_names(recipe: Recipe) -> None:
    values, header = load(recipe)
    strategy = values["trainer"]["strategy"]
    args = strategy["init_args"]
    assert strategy["class_path"] == "lightning_skrull.SkrullFSDPStrategy"
    shard = {"fsdp_cp": "cp", "fsdp_world": "world"}[recipe.strategy]
    assert args["shard"] == shard
    assert args["activation_checkpointing"] is True
    assert values["trainer"]["precision"] == "bf16-mixed"  # what the memory model counts
    assert values["model"]["torch_dtype"] == "bfloat16"
    assert args.get("chunked_loss", True)  # the chunked loss, as the memory model counts
    world, cp, bucket = layout(values)
    assert f"DP={world // cp} x CP={cp}" in header
    assert f"bucket_size {bucket}" in header
    assert recipe.device.replace(" ", "") in header.replace(" ", "")
    capacity = DEVICES[recipe.device]
    fig = figures(recipe)
    limit = (1 - MARGIN) * capacity
    assert fig.peak <= limit, (recipe.file, fig.peak / GIB, limit / GIB)
    assert bucket <= fig.largest
    # the check can fail: a bucket 4x larger does not fit
    assert fig.states + 4 * bucket * fig.per_token > limit


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_the_header_figures_are_the_memory_model_s(recipe: Recipe) -> None:
    _, header = load(recipe)
    expected = figures(recipe).text
    for figure in expected:
        assert figure in header, (recipe.file, figure)
    written = re.findall(r"\d+(?:\.\d+)? (?:GiB|KiB|MiB|GB)|\d+\.\dK\b", header)
    stray = sorted(set(written) - set(expected))
    assert not stray, (recipe.file, stray)


def test_the_gpt_oss_recipe_dequantizes_its_mxfp4_experts_and_runs_on_sdpa() -> None:
    # The published config stores the experts in MXFP4: the recipe loads them dequantized (the
    # CLI refuses dequantize_mxfp4 for any other checkpoint). Its attention sinks run on sdpa:
    # "auto" picks it, "flash" is refused (tests/models/test_gpt_oss.py). The harmony template renders
    # a turn differently once turns follow it, so only the last one is supervised.
    values, header = load(RECIPES[IDS.index("gpt-oss-20b.yaml")])
    assert GPT_OSS_20B["quantization_config"]["quant_method"] == "mxfp4"
    assert values["model"]["dequantize_mxfp4"] is True
    assert values["trainer"]["strategy"]["init_args"]["attention_backend"] in ("auto", "sdpa")
    assert values["data"]["chat_turns"] == "last"
    for said in ("Mxfp4Config(dequantize=True)", "sdpa", "sinks", "chat_turns: last"):
        assert said in header, said
    # the layer FSDP2 gathers, as the header writes it; the model built from the published
    # config has trainable bf16-able experts (from_config applies no quantization)
    shape = ModelShape.from_hf_config(hf_config(GPT_OSS_20B))
    assert f"{parameter_count(shape).per_layer / 1e9:.2f}B-parameter layer" in header
    assert (shape.sliding_layers, shape.sliding_window, shape.num_layers) == (12, 128, 24)
    experts = meta_model(GPT_OSS_20B).model.layers[0].mlp.experts
    assert type(experts).__name__ == "GptOssExperts"
    assert experts.gate_up_proj.shape == (32, 2880, 2 * 2880)


# ----------------------------------------------------------------------------- end to end
TINY_TEXT = {"vocab_size": 68, "max_position_embeddings": 4096}
IMAGE_TOKEN = 67


def tiny_checkpoint(recipe: Recipe, directory: Path) -> None:
    """A tiny random model of the recipe's family (same ``model_type`` and class) and an offline
    chat tokenizer, saved where the recipe's model and tokenizer paths point."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        LlamaForCausalLM,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
    )

    if recipe.config["model_type"] == "gpt_oss":  # its experts in MXFP4, as released
        save_mxfp4_gpt_oss(directory, vocab_size=TINY_TEXT["vocab_size"])
        make_tokenizer(PLAIN_TEMPLATE).save_pretrained(directory)
        return
    torch.manual_seed(0)
    model: torch.nn.Module
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    vision |= {"num_attention_heads": 2, "image_size": 16, "patch_size": 4}
    if recipe.config["model_type"] == "llama":
        model = LlamaForCausalLM(tiny_config("llama", **TINY_TEXT))
    elif recipe.config["model_type"] == "gemma3":
        text = tiny_config("gemma3_text", **TINY_TEXT).to_dict()
        config = Gemma3Config(
            text_config=text,
            vision_config={**vision, "vision_use_head": False},
            mm_tokens_per_image=4,
            boi_token_index=65,
            eoi_token_index=66,
            image_token_index=IMAGE_TOKEN,
        )
        model = Gemma3ForConditionalGeneration(config)
    else:
        text = tiny_config("mistral", **TINY_TEXT).to_dict()
        config = Mistral3Config(
            text_config=text,
            vision_config={**vision, "head_dim": 8},
            image_token_index=IMAGE_TOKEN,
            spatial_merge_size=2,
        )
        model = Mistral3ForConditionalGeneration(config)
    assert type(model).__name__ == recipe.checkpoint_class
    model.to(torch.bfloat16).save_pretrained(directory)
    make_tokenizer(PLAIN_TEMPLATE).save_pretrained(directory)


def chat_data(path: Path, n: int) -> None:
    """``n`` text-only chat samples of a few turns (JSONL), words of the offline tokenizer."""
    import json
    import random

    words = [w for w in CHAT_VOCAB if not w.startswith("<")]
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            turns = []
            for _ in range(rng.randint(1, 3)):
                turns.append({"role": "user", "content": " ".join(rng.choices(words, k=5))})
                reply = " ".join(rng.choices(words, k=rng.randint(2, 20)))
                turns.append({"role": "assistant", "content": reply})
            f.write(json.dumps({"messages": turns}) + "\n")


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_the_recipe_trains_a_tiny_model_of_its_family(
    recipe: Recipe, tmp_path: Path, world_of_one: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recipe's model and data sections unchanged but for the paths; only the hardware is
    overridden (one CPU process, DP=1 x CP=1, a small bucket, 2 steps)."""
    checkpoint = tmp_path / "checkpoint"
    tiny_checkpoint(recipe, checkpoint)
    chat_data(tmp_path / "train.jsonl", 48)  # the CLI holds out val_split=32 of them
    cli = SkrullCLI(
        SkrullCausalLM,
        SkrullDataModule,
        trainer_defaults={**TINY_CPU_TRAINER, "callbacks": [PlanStatsPrinter()]},
        seed_everything_default=0,
        save_config_callback=None,
        args=[
            "fit",
            "--config",
            str(CONFIGS / recipe.file),
            f"--model.model={checkpoint}",
            f"--data.tokenizer={checkpoint}",
            f"--data.train_data={tmp_path / 'train.jsonl'}",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.num_nodes=1",
            "--trainer.strategy.init_args.cp_size=1",
            "--trainer.strategy.init_args.bucket_size=256",
            "--trainer.max_steps=2",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--data.global_batch_size=8",
            "--data.num_workers=0",
            "--data.num_proc=1",
        ],
    )
    # the checkpoint's class through the CLI's loader (AutoModelForImageTextToText for the
    # vision-language ones), and chat samples rendered by the tokenizer's template
    # (FSDP2 makes the sharded module an instance of a subclass, FSDP<class>)
    classes = [c.__name__ for c in type(cli.model.model).__mro__]
    assert recipe.checkpoint_class in classes, classes
    sample = cli.datamodule.train_dataset.arrays(0)
    assert (sample["labels"] != -100).any() and (sample["labels"] == -100).any()
    out = capsys.readouterr().out
    assert "Skrull run summary (DP=1 x CP=1, 2 steps, policy skrull)" in out
    loss = float(next(line for line in out.splitlines() if "last train loss" in line).split()[-1])
    assert 0 < loss < 10  # a finite loss of a vocabulary of 68 (ln 68 = 4.2 at random)


def test_the_recipe_table_of_the_docs_matches_every_recipe() -> None:
    # docs/lightning.md lists every shipped recipe with its layout and bucket_size
    table = (Path(__file__).parents[2] / "docs" / "lightning.md").read_text()
    rows = {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(r"^\| `([\w.-]+\.yaml)` \|.*?\| (DP=\d+ x CP=\d+) \|.*\| ([\d ]+) \|$",
                             table, re.MULTILINE)
    }  # fmt: skip
    assert set(rows) == {p.name for p in CONFIGS.glob("*.yaml")}
    for name, (written_layout, written_bucket) in rows.items():
        world, cp, bucket = layout(yaml.safe_load((CONFIGS / name).read_text()))
        assert written_layout == f"DP={world // cp} x CP={cp}", name
        assert int(written_bucket.replace(" ", "")) == bucket, name
