"""Writes quickstart.ipynb (run: python examples/notebooks/make_quickstart.py)."""

from pathlib import Path

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# lightning-skrull in a notebook\n\n"
        "Plan one global batch of the bundled mixed-length dataset, draw the plan, compare its "
        "estimated time with static context parallelism, then run a short fit on CPU with "
        "2 processes (one CP group of 2 ranks)."
    ),
    nbf.v4.new_code_cell(
        "from lightning_skrull.data import load_bundled_dataset\n"
        "from lightning_skrull.scheduling import CostModel, plan_global_batch, simulate\n"
        "from transformers import Qwen2Config\n"
        "\n"
        "data = load_bundled_dataset('mixed_tiny')\n"
        "lengths = data.lengths[:32]\n"
        "print('longest', max(lengths), 'shortest', min(lengths), 'tokens', sum(lengths))\n"
        "\n"
        "plan = plan_global_batch(lengths, dp_size=2, cp_size=2, bucket_size=1024, policy='skrull')\n"
        "for dp_rank, mbs in enumerate(plan.micro_batches):\n"
        "    for mb in mbs:\n"
        "        print(f'DP {dp_rank}:', mb.tokens_per_cp_rank(lengths, 2), 'tokens per CP rank,',\n"
        "              len(mb.distributed_ids), 'distributed of', len(mb.sequence_ids))"
    ),
    nbf.v4.new_markdown_cell(
        "Estimated iteration time of each policy with a cost model of a 0.5B Qwen2.5-shaped "
        "model (H100-class defaults; fit the constants to your cluster with `fit_cost_model`)."
    ),
    nbf.v4.new_code_cell(
        "config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,\n"
        "                     num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)\n"
        "cost = CostModel.from_hf_config(config)\n"
        "for policy in ('skrull', 'dacp', 'static', 'sorted', 'round_robin'):\n"
        "    p = plan_global_batch(lengths, dp_size=2, cp_size=2, bucket_size=1024,\n"
        "                          cost_model=cost, policy=policy)\n"
        "    print(f'{policy:12s} {simulate(p, lengths, cost) * 1e3:8.3f} ms')"
    ),
    nbf.v4.new_code_cell(
        "%matplotlib inline\n"
        "from lightning_skrull.viz import plot_plan\n"
        "\n"
        "fig = plot_plan(plan, lengths)"
    ),
    nbf.v4.new_markdown_cell(
        "A short fit: a tiny random Qwen2.5-architecture model, 2 CPU processes forked from the "
        "notebook (`start_method='fork'`, the only way Lightning starts processes from a "
        "notebook), one CP group of 2 ranks. The training step is the model's own loss."
    ),
    nbf.v4.new_code_cell(
        "import lightning.pytorch as L\n"
        "from lightning_skrull import SkrullDataModule, SkrullStrategy\n"
        "from lightning_skrull.causal_lm import SkrullCausalLM\n"
        "\n"
        "L.seed_everything(0)\n"
        "model = SkrullCausalLM(\n"
        "    model={'model_type': 'qwen2', 'vocab_size': 256, 'hidden_size': 32,\n"
        "           'intermediate_size': 64, 'num_hidden_layers': 2, 'num_attention_heads': 4,\n"
        "           'num_key_value_heads': 2, 'max_position_embeddings': 4096},\n"
        "    learning_rate=3e-3,\n"
        ")\n"
        "trainer = L.Trainer(\n"
        "    accelerator='cpu', devices=2, max_steps=3, logger=False, enable_checkpointing=False,\n"
        "    enable_progress_bar=False, enable_model_summary=False,\n"
        "    strategy=SkrullStrategy(cp_size=2, bucket_size=1024, start_method='fork'),\n"
        ")\n"
        "trainer.fit(model, SkrullDataModule(train_data='bundled:mixed_tiny', global_batch_size=16))\n"
        "print('train_loss', float(trainer.callback_metrics['train_loss']))"
    ),
]
nb = nbf.v4.new_notebook(
    cells=cells,
    metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
)
nbf.write(nb, Path(__file__).with_name("quickstart.ipynb"))
