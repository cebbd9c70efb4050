"""Parity: our native model against transformers' ``AutoModelFor*`` on the same padded batch.

Exact means ``torch.equal`` on every output field (CPU, float32). Both models are
loaded from the same source in the same process and fed the same batch: two
sequences of different lengths (the shorter one padded), token types set where
the family has them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flodl_hf.core import io
from flodl_hf.auto import AutoConfig, load_model, task_of
from flodl_hf.core.errors import WeightsMismatchError
from flodl_hf.core.config import BaseConfig
from flodl_hf.core.outputs import ModelOutput
from flodl_hf.core.registry import get_family
from flodl_hf.core.registry import TaskField, get_task
from flodl_hf.core.vision_layers import pair

# task -> transformers' Auto class name, read from the task registry
REFERENCE_CLASSES = TaskField("auto_class")


@dataclass
class ParityResult:
    source: str
    task: str
    attn_implementation: str
    diffs: dict[str, float] = field(default_factory=dict)   # field -> max abs diff
    equal: dict[str, bool] = field(default_factory=dict)    # field -> torch.equal
    skipped: str | None = None                              # why no comparison was made

    @property
    def exact(self) -> bool:
        return bool(self.equal) and all(self.equal.values())


def make_batch(config: BaseConfig, task: str, lengths: tuple[int, ...] = (13, 8), seed: int = 0,
               num_choices: int = 2) -> dict[str, torch.Tensor]:
    """A padded batch: random ids (never the pad id), the pad id at padded positions, token types where used; a
    family with inputs of its own makes them (``example_inputs``: CLIP's and SigLIP's texts and images); for a
    family whose backbone takes pixels, ``image_batch``."""
    family = get_family(config.model_type)
    own = getattr(family, "example_inputs", None)
    if own is not None:
        return own(config, task, lengths, seed)
    if "pixel_values" in family.backbone_class.input_names:
        return image_batch(config, task, len(lengths), seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = config.vocab_size
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    width = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=gen)
    ids = torch.where(ids == pad, (ids + 1) % vocab, ids)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, pad)
    batch = {"input_ids": ids, "attention_mask": mask}
    if getattr(config, "type_vocab_size", 0) >= 2:
        types = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            types[row, n // 2:n] = 1
        batch["token_type_ids"] = types
    if task in ("mc", "double_heads"):  # (B, S) -> (B, choices, S); GPT-2's double heads take choices too
        batch = {k: torch.stack([v.roll(c, dims=0) for c in range(num_choices)], dim=1) for k, v in batch.items()}
    return batch


def image_batch(config: BaseConfig, task: str, rows: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random normal pixel values at the config's image size; masked image modeling also masks about half the
    patches at random (``bool_masked_pos``)."""
    gen = torch.Generator().manual_seed(seed)
    (height, width), patch = pair(config.image_size, "image_size"), pair(config.patch_size, "patch_size")
    batch = {"pixel_values": torch.randn(rows, config.num_channels, height, width, generator=gen)}
    if task == "masked_image_modeling":
        patches = (height // patch[0]) * (width // patch[1])
        batch["bool_masked_pos"] = torch.randint(0, 2, (rows, patches), generator=gen).bool()
    return batch


def quiet_transformers():
    """transformers (imported on first use), with its logging and progress bars off: we print our own report."""
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def reference_model(source: str | Path, task: str, attn_implementation: str, revision: str | None = None):
    """transformers' AutoModelFor* on the same files we load (resolved by our loader: samples/, a
    weights file's directory, a hub snapshot), float32, eval mode."""
    transformers = quiet_transformers()
    cls = getattr(transformers, get_task(task).auto_class)
    source = io.resolve(source, revision).root
    kwargs = {"dtype": torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return cls.from_pretrained(str(source), **kwargs).eval()


def compare_outputs(ours, theirs, fields: list[str]) -> tuple[dict[str, float], dict[str, bool]]:
    diffs, equal = {}, {}
    for name in fields:
        a, b = getattr(ours, name), getattr(theirs, name, None)
        if isinstance(a, ModelOutput) and b is not None:  # a tower's record inside a dual model's (CLIP's)
            inner = compare_outputs(a, b, a.keys())
            diffs.update({f"{name}.{k}": v for k, v in inner[0].items()})
            equal.update({f"{name}.{k}": v for k, v in inner[1].items()})
            continue
        if not isinstance(a, torch.Tensor):  # a decoder's KV cache: compared step by step in tests/test_decoder.py
            continue
        if b is None:
            raise AssertionError(f"transformers' output has no field {name!r}")
        if a.shape != b.shape:
            diffs[name], equal[name] = float("inf"), False
            continue
        diffs[name] = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        equal[name] = torch.equal(a, b)
    return diffs, equal


@torch.inference_mode()
def check_parity(source: str | Path, task: str = "auto", attn_implementation: str = "sdpa",
                 revision: str | None = None, batch: dict[str, torch.Tensor] | None = None) -> ParityResult:
    """Load ``source`` natively and with transformers; compare every output field on one padded batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ours = load_model(source, task, dtype=torch.float32, revision=revision,
                              attn_implementation=attn_implementation)
        except WeightsMismatchError as exc:
            own = task_of(AutoConfig.from_pretrained(source, revision=revision))
            if task in ("auto", own):
                raise
            # e.g. a 5-label classifier read as a 1-output multiple-choice head: not this checkpoint's head
            return ParityResult(str(source), task, attn_implementation,
                                skipped=f"this {own} checkpoint cannot hold a {task} head "
                                        f"({str(exc).splitlines()[1].strip()})")
    task = ours.task
    if ours.load_report.fresh:
        # Both sides would hold independent random heads: there is nothing to compare.
        return ParityResult(str(source), task, attn_implementation,
                            skipped=f"the checkpoint has no weights for this head ({ours.load_report.fresh[0]}, ...)")
    family = get_family(ours.config.model_type)
    ref_impl = attn_implementation if attn_implementation in family.attn_implementations and \
        len(family.attn_implementations) > 1 else None
    theirs = reference_model(source, task, ref_impl, revision)
    if batch is None:
        batch = make_batch(ours.config, task)
    out_ours = ours(**batch)
    out_theirs = theirs(**batch)
    diffs, equal = compare_outputs(out_ours, out_theirs, out_ours.keys())
    return ParityResult(str(source), task, attn_implementation, diffs, equal)
