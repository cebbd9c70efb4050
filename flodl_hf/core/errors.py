"""Typed errors. Each names the file, key or field at fault and says what to do."""

from __future__ import annotations


class FlodlHFError(Exception):
    """Base class of every error flodl-hf raises on purpose."""


class SourceNotFoundError(FlodlHFError, FileNotFoundError):
    """A checkpoint source (local path or hub id) could not be resolved."""


class CheckpointFormatError(FlodlHFError, ValueError):
    """A weights file is corrupt, truncated, of an unknown format, or holds non-tensors."""


class ConfigError(FlodlHFError, ValueError):
    """config.json is missing, unreadable, or asks for something we refuse (remote code)."""


class UnsupportedModelError(FlodlHFError, ValueError):
    """The checkpoint's model_type or architecture is not registered here."""


class WeightsMismatchError(FlodlHFError, ValueError):
    """Strict loading found missing keys or shape mismatches. Nothing was loaded."""

    def __init__(self, source: str, missing: list[str], mismatched: list[tuple[str, tuple, tuple]],
                 unexpected: list[str] | None = None) -> None:
        self.missing = list(missing)
        self.mismatched = list(mismatched)
        self.unexpected = list(unexpected or [])
        lines = [f"cannot load weights from {source}: nothing was loaded."]
        if self.missing:
            lines.append(f"  missing keys ({len(self.missing)}): " + ", ".join(self.missing))
        for key, want, got in self.mismatched:
            lines.append(f"  shape mismatch for {key}: model expects {tuple(want)}, checkpoint has {tuple(got)}")
        if self.unexpected:
            lines.append(f"  unexpected keys ({len(self.unexpected)}): " + ", ".join(self.unexpected))
        lines.append("  Check that config.json matches the weights, or pass num_labels= to build a fresh head.")
        super().__init__("\n".join(lines))


class MissingHeadError(FlodlHFError, ValueError):
    """A task one-liner was given a checkpoint without that task's head; it never predicts with a random one."""


class RegistryError(FlodlHFError, ImportError):
    """The model families could not be imported: the registry would be partial, so nothing is served."""


class InputError(FlodlHFError, ValueError):
    """User input to a task or a model forward is unusable (e.g. a text with no mask token)."""


class OutputExistsError(FlodlHFError, FileExistsError):
    """An output path is an existing file, or an existing directory that may not be replaced."""


class TrainerError(FlodlHFError, RuntimeError):
    """Training cannot go on (a worker vanished, workers diverged, a checkpoint does not fit)."""


class TrainerConfigError(FlodlHFError, ValueError):
    """The Trainer was given arguments that cannot work together."""


class WorkerLostError(TrainerError):
    """A collective failed: another worker died or stopped answering within the timeout."""


class SampleError(FlodlHFError):
    """A sample could not be downloaded, verified or unpacked."""


class AdapterError(FlodlHFError, ValueError):
    """A LoRA adapter cannot be added or read (no target matched, a file or field is missing)."""


class AdapterBaseMismatchError(AdapterError):
    """An adapter does not belong to this base model (shapes differ, or the recorded sha256 does)."""


class UnsupportedAdapterError(AdapterError):
    """adapter_config.json asks for a PEFT type or option flodl-hf does not implement."""


class CheckpointWriteError(TrainerError, OSError):
    """A trainer checkpoint could not be written (the disk is full); nothing of it was kept, the earlier
    checkpoints are intact. An OSError too, so ``except OSError`` still sees a failed write."""


class NonFiniteScoresError(InputError):
    """Sampling met next-token scores that no token can be drawn from (NaN or infinite logits of a broken model)."""


class UnsupportedFeatureError(FlodlHFError, NotImplementedError):
    """A transformers call that flodl-hf deliberately does not implement (push_to_hub: no network access); the
    message says what to do instead."""


def push_to_hub_refused(what: str) -> UnsupportedFeatureError:
    """The error of ``<what>.push_to_hub(...)`` (and of ``save_pretrained(..., push_to_hub=True)``): flodl-hf opens no
    network connection of its own, so it names the two steps that do the same."""
    return UnsupportedFeatureError(
        f"{what}.push_to_hub: not supported (flodl-hf makes no network access); save locally with "
        f"{what}.save_pretrained(directory), then upload that directory with huggingface_hub: "
        "HfApi().upload_folder(folder_path=directory, repo_id=...) (or `hf upload <repo_id> <directory>`)")


class ImageError(InputError):
    """An image cannot be read or processed (corrupt, truncated, not an image, empty, past PIL's decompression-bomb
    limit, of a channel count the processor cannot take); the message names its path or its index in the batch."""
