"""The rules of each model family that Skrull trains beyond the dense decoders, one module each.

- :mod:`.moe`: Mixture-of-Experts (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 / V2, GLM-4-MoE,
  gpt-oss): per-token routing, the refused router auxiliary loss and router jitter, experts that
  must be trainable (gpt-oss's MXFP4 ones are refused).
- :mod:`.mla`: DeepSeek's Multi-head Latent Attention (values narrower than the keys, DeepSeek-V2's
  rotary call).
- :mod:`.sinks`: attention sinks (gpt-oss's per-head sink logits, refused on the ``flash``
  backend).
- :mod:`.vision_language`: vision-language checkpoints trained on text only (Gemma 3 4B-27B,
  Mistral Small 3.1 / 3.2): the text config and decoder, the refused images.
- :mod:`.gemma3`: Gemma 3's refused attention soft-capping and bidirectional attention.

:func:`~lightning_skrull.models.check_model` and :func:`~lightning_skrull.models.prepare_model`
apply them. Where a rule has to run inside the attention function, :mod:`lightning_skrull.attention`
holds only the generic mechanism (values of their own width, a per-head sink logit). Nothing is
imported here, so that the modules below can import each other's helpers in any order.
"""
