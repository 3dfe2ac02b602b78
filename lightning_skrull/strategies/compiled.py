"""``torch.compile`` under the Skrull strategies.

A user compiles in one of three ways:

- ``self.model = torch.compile(AutoModelForCausalLM.from_pretrained(...))``: an
  ``OptimizedModule`` whose ``_orig_mod`` is the model (the strategy finds the model inside it);
- ``self.model.compile()`` (``nn.Module.compile``, in place; also per decoder layer);
- ``trainer.fit(torch.compile(module))``: Lightning unwraps the LightningModule and compiles its
  step methods (``LightningModule._compiler_ctx``); Lightning itself refuses it under strategies
  other than DDP and FSDP1.

Under :class:`~lightning_skrull.SkrullStrategy` all three train exactly as the eager model does:
the Skrull attention is excluded from compilation
(:data:`~lightning_skrull.attention.dispatch.COMPILE_REASON`), so dynamo breaks the graph at each
layer's attention and compiles the rest. :class:`~lightning_skrull.SkrullFSDPStrategy` and
:class:`~lightning_skrull.SkrullZero2Strategy` refuse a compiled model at setup
(:func:`refuse_compiled`, with their reasons).
"""

from __future__ import annotations

from torch import nn
from torch._dynamo.eval_frame import OptimizedModule


def compiled_forms(module: nn.Module) -> list[str]:
    """How ``module`` (or something inside it) was compiled, one entry per compiled piece:
    ``"torch.compile(<name>)"`` for an ``OptimizedModule`` submodule,
    ``"<name>.compile()"`` for a submodule compiled in place, ``"torch.compile(module)"`` for a
    LightningModule compiled whole and unwrapped by Lightning. Empty when nothing is compiled.
    """
    forms: list[str] = []
    if getattr(module, "_compiler_ctx", None) is not None:
        forms.append("torch.compile(module)")
    for name, sub in module.named_modules(remove_duplicate=False):
        shown = name or "module"
        if isinstance(sub, OptimizedModule):
            forms.append(f"torch.compile({shown})")
        elif getattr(sub, "_compiled_call_impl", None) is not None:
            forms.append(f"{shown}.compile()")
    return forms


def refuse_compiled(module: nn.Module, strategy: str, reason: str) -> None:
    """Refuse a compiled model under ``strategy``, for ``reason``.

    Raises:
        ValueError: ``module`` holds a compiled piece (:func:`compiled_forms`); the message names
            it, the reason and the fix.
    """
    forms = compiled_forms(module)
    if not forms:
        return
    shown = ", ".join(forms[:3]) + (f" and {len(forms) - 3} more" if len(forms) > 3 else "")
    raise ValueError(
        f"{shown}: a compiled model is not supported under {strategy}: {reason}. Train the "
        "model uncompiled under this strategy, or compiled (torch.compile of the model, "
        "model.compile() or trainer.fit(torch.compile(module))) under SkrullStrategy (DDP), "
        "where it trains as the eager model does."
    )
