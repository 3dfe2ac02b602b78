"""An analytical estimate of activation memory per token of a Hugging Face decoder step.

What autograd keeps per token for the backward of one training step (packed tokens, flash-style
attention without a score matrix, no activation checkpointing), from the model's config alone.
It explains the measured line of ``bucket_size="auto"`` (``alpha`` bytes per token) and says how
much of it the LM head takes with the dense loss and with the chunked one.

Per decoder layer, with ``b`` bytes per activation element (2 for bf16, 4 for float32), ``h``
the hidden size, ``h_kv`` the key/value width and ``f`` the MLP width:

- each of the two RMSNorms keeps its float32 copy of the input (``4h``) and its normalised
  output in the compute dtype (``b h``): ``2 (4 + b) h``;
- attention keeps q (``b h``), k and v (``2 b h_kv``) and its output (``b h``, also o_proj's
  input);
- the SwiGLU MLP keeps the gate and up projections, the SiLU output and their product
  (``4 b f``).

The head, dense (transformers' ``lm_head`` then ``ForCausalLMLoss``): the logits (``b V``), their
float32 copy when ``b < 4`` (``4 V``), log-softmax's float32 output (``4 V``), and the float32
gradient of the logits in backward (``4 V``), all alive at the head's backward, when every layer's
activations still are. Chunked (:mod:`~lightning_skrull.models.chunked_loss`): the final norm
(``(4 + b) h``) and the hidden states' gradient made in forward (``b h``); one chunk's logits are
a constant, not a per-token cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ActivationEstimate:
    """Estimated activation bytes per token of one training step.

    Attributes:
        layers: all decoder layers together.
        head: the final norm, the LM head and the loss.
    """

    layers: float
    head: float

    @property
    def total(self) -> float:
        """Bytes per token of the whole step."""
        return self.layers + self.head


def activation_bytes_per_token(
    config: Any, *, chunked_loss: bool, bytes_per_element: int = 2
) -> ActivationEstimate:
    """Estimate activation bytes per token for a decoder with this Hugging Face ``config``.

    Args:
        config: a transformers config with ``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (optional,
            default: MHA), ``head_dim`` (optional) and ``vocab_size``; or a
            :class:`~lightning_skrull.scheduling.cost_model.ModelShape` (``num_layers``).
        chunked_loss: the chunked LM head + cross-entropy instead of the dense logits.
        bytes_per_element: bytes of the compute dtype (2: bf16 / fp16, 4: float32).

    Returns:
        The per-token estimate, split into layers and head.
    """
    h = int(config.hidden_size)
    f = int(config.intermediate_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    b = bytes_per_element
    norms = 2 * (4 + b) * h
    attention = b * (2 * q_width + 2 * kv_width)
    mlp = 4 * b * f
    num_layers = getattr(config, "num_hidden_layers", None) or config.num_layers
    layers = int(num_layers) * (norms + attention + mlp)
    vocab = int(config.vocab_size)
    final_norm = (4 + b) * h
    if chunked_loss:
        head = final_norm + b * h
    else:
        head = final_norm + b * vocab + (4 * vocab if b < 4 else 0) + 4 * vocab + 4 * vocab
    return ActivationEstimate(layers=float(layers), head=float(head))
