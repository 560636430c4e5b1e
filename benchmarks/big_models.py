"""Billion-parameter model factories for ``checkmate trace --fake`` (``make bench-big``).

Each builds a Hugging Face decoder with a random init in bf16 and returns it with a batch of
token ids; under ``--fake`` nothing is allocated. ``LAYERS`` overrides the depth (a
shallower copy traces faster; :mod:`benchmarks.big` uses it to extrapolate).
"""

from __future__ import annotations

from typing import Any

import torch

#: model name -> number of layers to build instead of the full depth (None: full depth)
LAYERS: dict[str, int | None] = {"llama7b": None, "gpt2xl": None}
#: model name -> (batch, sequence length)
BATCH: dict[str, tuple[int, int]] = {"llama7b": (4, 2048), "gpt2xl": (4, 1024)}


def llama7b() -> tuple[Any, torch.Tensor]:
    """Llama-2-7B's shape: hidden 4096, 32 layers, 32 heads, MLP 11008, vocab 32000."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=LAYERS["llama7b"] or 32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        use_cache=False,
    )
    model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    b, t = BATCH["llama7b"]
    return model, torch.randint(0, cfg.vocab_size, (b, t))


def gpt2xl() -> tuple[Any, torch.Tensor]:
    """GPT-2 XL's shape: n_embd 1600, 48 layers, 25 heads, vocab 50257, 1024 positions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_embd=1600,
        n_layer=LAYERS["gpt2xl"] or 48,
        n_head=25,
        vocab_size=50257,
        n_positions=1024,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    model = GPT2LMHeadModel._from_config(cfg, dtype=torch.bfloat16)
    b, t = BATCH["gpt2xl"]
    return model, torch.randint(0, cfg.vocab_size, (b, t))


#: the scaled-down Llama of :mod:`benchmarks.predict_check` (set there before tracing)
SMALL: dict[str, Any] = {
    "hidden": 512,
    "layers": 4,
    "heads": 8,
    "intermediate": 1376,
    "vocab": 8000,
    "batch": 4,
    "seq": 512,
    "dtype": "bfloat16",
}


class LossStep(torch.nn.Module):
    """A causal LM whose forward returns the training loss (cross entropy in float32), so
    one joint graph holds the whole step: nothing of the step's memory lies outside it."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(ids).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def small_llama() -> tuple[Any, torch.Tensor]:
    """A Llama shaped by ``SMALL`` (random init in its dtype), wrapped in :class:`LossStep`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = SMALL
    cfg = LlamaConfig(
        hidden_size=c["hidden"],
        intermediate_size=c["intermediate"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["heads"],
        vocab_size=c["vocab"],
        max_position_embeddings=max(c["seq"], 128),
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, dtype=getattr(torch, c["dtype"]))
    return LossStep(model), torch.randint(0, cfg.vocab_size, (c["batch"], c["seq"]))
