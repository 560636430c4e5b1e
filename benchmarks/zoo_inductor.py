"""``make bench-zoo-inductor``: ``compiler="inductor"`` on ordinary Hugging Face models.

Small configurations (2 layers, width 64, random weights; ``transformers`` configs, nothing
downloaded) of the architectures users train: decoder LMs (GPT-NeoX, Mistral, Qwen2, OPT,
Gemma, Phi, Falcon), encoders (BERT, DistilBERT), an encoder-decoder (T5) and vision models
(ViT, ConvNeXt). Each trains one step (forward, the model's own loss, backward) with dropout
off, so that its gradients can be compared with eager's:

- budget: ``--share`` (default 0.6) of eager's measured step peak, in bytes;
- peak: the allocator-measured peak of the optimized step over that budget, and of a short
  last batch (5 of 8 samples) of the same model, which runs the plan of its own shape;
- grad err: max abs gradient difference from eager / max |gradient| (tolerance 1e-3);
- first s: ``optimize`` + the first step (trace, plan, the compiled check, compile); new
  shape s: the first step of the short batch; Inductor's caches as the machine has them
  (``--fresh-cache`` points Inductor at an empty cache directory first);
- compiled: the plans compiled by Inductor, of all the plans made; a graph no compiled plan
  fits runs uncompiled (:class:`~checkmate.CompilerFallbackWarning`);
- warnings: the :class:`~checkmate.BudgetWarning` texts, when there were any.

A row is ``ok`` when both peaks are within the budget and the gradients within the tolerance;
a peak over the budget says whether a warning said so. Writes ``benchmarks/results/zoo_inductor.md`` and ``.csv``.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.csvio import write_rows

RESULTS_DIR = Path(__file__).resolve().parent / "results"
VOCAB = 512
SEQ = 64
BATCH = 8
SHORT = 5
GRAD_TOL = 1e-3


def _models() -> dict[str, tuple[Callable[[], nn.Module], str]]:
    """name -> (build with random weights, input kind: ``text`` or ``image``)."""
    import transformers as T

    shape: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    two: dict[str, Any] = {"vocab_size": VOCAB, **shape}
    small: dict[str, Any] = {**two, "intermediate_size": 128}

    def lm(config: Any) -> Callable[[], nn.Module]:
        return lambda: T.AutoModelForCausalLM.from_config(config)

    # OPT, Phi and Falcon apply dropout functionally from their configs (no nn.Dropout to zero)
    nodrop_opt: dict[str, Any] = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}
    return {
        "gpt-neox": (lm(T.GPTNeoXConfig(**small)), "text"),
        "mistral": (lm(T.MistralConfig(num_key_value_heads=2, **small)), "text"),
        "qwen2": (lm(T.Qwen2Config(num_key_value_heads=2, **small)), "text"),
        "opt": (lm(T.OPTConfig(ffn_dim=128, word_embed_proj_dim=64, **two, **nodrop_opt)), "text"),
        "gemma": (lm(T.GemmaConfig(num_key_value_heads=1, head_dim=16, **small)), "text"),
        "phi": (lm(T.PhiConfig(resid_pdrop=0.0, embd_pdrop=0.0, **small)), "text"),
        "falcon": (lm(T.FalconConfig(hidden_dropout=0.0, attention_dropout=0.0, **two)), "text"),
        "bert": (lambda: T.BertForMaskedLM(T.BertConfig(**small)), "text"),
        "distilbert": (
            lambda: T.DistilBertForMaskedLM(
                T.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128)
            ),
            "text",
        ),
        "t5": (
            lambda: T.T5ForConditionalGeneration(
                T.T5Config(
                    vocab_size=VOCAB,
                    d_model=64,
                    d_kv=16,
                    d_ff=128,
                    num_layers=2,
                    num_heads=4,
                    decoder_start_token_id=0,
                    pad_token_id=0,
                    dropout_rate=0.0,
                )
            ),
            "text",
        ),
        "vit": (
            lambda: T.ViTForImageClassification(
                T.ViTConfig(image_size=32, patch_size=4, num_labels=10, intermediate_size=128, **shape)
            ),
            "image",
        ),
        "convnext": (
            lambda: T.ConvNextForImageClassification(
                T.ConvNextConfig(
                    num_stages=2, hidden_sizes=[32, 64], depths=[2, 2], num_labels=10, image_size=64
                )
            ),
            "image",
        ),
    }


class _Step(nn.Module):
    """The model and its own loss: ``forward(x, labels) -> loss``."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__()
        self.model = model
        self.kind = kind

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.kind == "image":
            return self.model(pixel_values=x, labels=labels).loss  # type: ignore[no-any-return]
        return self.model(input_ids=x, labels=labels).loss  # type: ignore[no-any-return]


def _batch(kind: str, n: int, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``n``: token ids (their own labels), or images of the side the model's
    config names, with class labels."""
    g = torch.Generator().manual_seed(n)
    if kind == "image":
        return torch.randn(n, 3, image_size, image_size, generator=g), torch.randint(0, 10, (n,), generator=g)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return x, x.clone()


@dataclass
class Row:
    model: str
    status: str = "ok"
    eager_peak: int | None = None
    budget: int | None = None
    peak: int | None = None
    short_peak: int | None = None
    grad_err: float | None = None
    first_s: float | None = None
    new_shape_s: float | None = None
    warned: str = ""
    plans: int | None = None  # plans made (both batch shapes)
    compiled: int | None = None  # of them, compiled by Inductor (the others fell back, uncompiled)

    @property
    def over(self) -> bool:
        """A step measured over the budget."""
        return any(
            p is not None and self.budget is not None and p > self.budget
            for p in (self.peak, self.short_peak)
        )


def status(row: Row) -> str:
    """``ok``, or what went wrong: a peak over the budget (and whether a warning said so),
    gradients beyond the tolerance."""
    if row.over:
        return "over the budget, " + ("warned" if row.warned else "unwarned")
    if row.grad_err is None or row.grad_err > GRAD_TOL:
        return "gradients differ" + ("" if row.grad_err is None else f" ({row.grad_err:.1e})")
    return "ok"


def measure(name: str, build: Callable[[], nn.Module], kind: str, share: float, time_limit: float) -> Row:
    """One model: eager's peak and gradients, then the optimized step's (see the module docstring)."""
    import checkmate
    from checkmate.memory import measure_peak

    row = Row(model=name)
    try:
        torch.manual_seed(0)
        base = build().train()
        for mod in base.modules():  # gradients comparable with eager's: no random masks
            if isinstance(mod, nn.Dropout):
                mod.p = 0.0
        image_size = int(getattr(getattr(base, "config", None), "image_size", 0))
        x, y = _batch(kind, BATCH, image_size)
        eager = _Step(copy.deepcopy(base), kind)
        row.eager_peak = measure_peak(lambda: eager(x, y).backward())
        eager.zero_grad(set_to_none=True)
        eager(x, y).backward()
        want = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
        row.budget = int(share * row.eager_peak)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", checkmate.BudgetWarning)
            t0 = time.perf_counter()
            opt = checkmate.optimize(
                _Step(copy.deepcopy(base), kind), row.budget, compiler="inductor", time_limit=time_limit
            )
            opt(x, y).backward()
            row.first_s = time.perf_counter() - t0
            got = {n: p.grad for n, p in opt.named_parameters() if p.grad is not None}
            scale = max(float(g.abs().max()) for g in want.values())
            row.grad_err = max(
                (float((got[n] - g).abs().max()) if n in got else float("inf")) for n, g in want.items()
            ) / max(scale, 1e-30)
            for _ in range(2):  # a training loop's next steps (the whole step is checked at one)
                opt.zero_grad(set_to_none=True)
                opt(x, y).backward()
            opt.zero_grad(set_to_none=True)
            row.peak = measure_peak(lambda: opt(x, y).backward())
            xs, ys = _batch(kind, SHORT, image_size)
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            opt(xs, ys).backward()
            row.new_shape_s = time.perf_counter() - t0
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                opt(xs, ys).backward()
            opt.zero_grad(set_to_none=True)
            row.short_peak = measure_peak(lambda: opt(xs, ys).backward())
        records = checkmate.plans_of(opt)
        row.plans, row.compiled = len(records), sum(r.compiler == "inductor" for r in records)
        texts = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
        row.warned = " | ".join(dict.fromkeys(t.split("; ")[0][:200] for t in texts))
        row.status = status(row)
    except Exception as exc:  # a model's failure is a row, not the end of the run
        row.status = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return row


def _x(v: int | None, budget: int | None) -> str:
    return "-" if v is None or not budget else f"{v / budget:.3f}x"


def render(rows: list[Row], share: float, seconds: float, command: str) -> str:
    lines = [
        '# `compiler="inductor"` on ordinary Hugging Face models (measured)',
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch thread(s); torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; `{command}`, {seconds / 60:.1f} min.",
        "",
        f"Each model: 2 layers, width 64, random weights, batch {BATCH} (text: {SEQ} tokens), one "
        f"training step with its own loss, dropout off. Budget = {share:g} x eager's measured step "
        f"peak, in bytes. Peak = allocator-measured peak of the optimized step over the budget; short = "
        f"a last batch of {SHORT}. Grad err = max abs gradient difference from eager / max |gradient| "
        f"(tolerance {GRAD_TOL:g}). First = optimize + first step (trace, plan, the compiled check, "
        "compile), s; new shape = the short batch's first step, s. Compiled = plans compiled by Inductor, "
        "of the plans made (a graph no compiled plan fits runs uncompiled, with a CompilerFallbackWarning).",
        "",
        "| model | eager peak MiB | budget MiB | peak | short batch | grad err | first s | new shape s | compiled | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        mib = lambda v: "-" if v is None else f"{v / 2**20:.2f}"  # noqa: E731
        lines.append(
            f"| {r.model} | {mib(r.eager_peak)} | {mib(r.budget)} | {_x(r.peak, r.budget)} | "
            f"{_x(r.short_peak, r.budget)} | {'-' if r.grad_err is None else f'{r.grad_err:.1e}'} | "
            f"{'-' if r.first_s is None else f'{r.first_s:.0f}'} | "
            f"{'-' if r.new_shape_s is None else f'{r.new_shape_s:.0f}'} | "
            f"{'-' if r.plans is None else f'{r.compiled} of {r.plans}'} | {r.status} |"
        )
    warned = [r for r in rows if r.warned]
    if warned:
        lines += ["", "BudgetWarnings:", ""] + [f"- {r.model}: {r.warned}" for r in warned]
    ok = sum(r.status == "ok" for r in rows)
    whole = sum(r.plans is not None and r.plans > 0 and r.compiled == r.plans for r in rows)
    lines += [
        "",
        f"{ok} of {len(rows)} models held the budget with eager's gradients; "
        f"{whole} of {len(rows)} ran every plan compiled by Inductor.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--share", type=float, default=0.6, help="budget as a share of eager's step peak")
    ap.add_argument("--time-limit", type=float, default=5.0, help="seconds per plan")
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--fresh-cache", action="store_true", help="Inductor's caches in a new empty directory")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "zoo_inductor")
    args = ap.parse_args(argv)
    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="zoo_inductor_")
    torch.set_num_threads(1)
    models = _models()
    names = [n for n in models if not args.only or n in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(models) if args.only else set()
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(sorted(unknown))}: choose from {', '.join(models)}")
    start = time.perf_counter()
    rows: list[Row] = []
    command = "python -m benchmarks.zoo_inductor " + " ".join(argv if argv is not None else sys.argv[1:])
    for name in names:
        build, kind = models[name]
        row = measure(name, build, kind, args.share, args.time_limit)
        print(row, flush=True)
        rows.append(row)
        write_rows(rows, args.out.with_suffix(".csv"), Row)  # after each row: an interrupted run keeps it
        args.out.with_suffix(".md").write_text(
            render(rows, args.share, time.perf_counter() - start, command.strip())
        )
    print(args.out.with_suffix(".md").read_text())
    return 0 if all(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
