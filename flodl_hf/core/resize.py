"""``model.resize_token_embeddings``, as transformers 5's ``PreTrainedModel.resize_token_embeddings`` does it.

Written from ``modeling_utils.py`` (5.25: ``resize_token_embeddings``, ``_resize_token_embeddings``,
``_get_resized_embeddings``, ``_get_resized_lm_head``, ``_init_added_*_with_mean``, ``tie_weights``'s
``_adjust_bias``), op for op and in its order, so that from the same random state the new rows are the same bits:
a fresh ``nn.Embedding`` / ``nn.Linear`` is built (its constructor draws, as there), its new rows drawn (normal at
``initializer_range``, or with ``mean_resizing`` from the old rows' mean and covariance), the old rows copied in; the
input table keeps its ``Parameter`` (its ``.data`` replaced), so a tied decoder follows it, and the tied decoder's
bias is padded with zeros. An untied output layer gets new parameters. ``config.vocab_size`` is updated.
"""

from __future__ import annotations

import torch
from torch import nn

from flodl_hf.core.errors import InputError, UnsupportedFeatureError
from flodl_hf.core.layers import init_fresh_module_parameter


def _positive(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"resize_token_embeddings: {name}={value!r} must be a positive integer (or None)")
    return value


def _std(config: object) -> float:
    """transformers' ``_init_weights`` spread: ``initializer_range`` (0.02 where it is 0 or absent)."""
    return getattr(config, "initializer_range", None) or 0.02


@torch.no_grad()
def _mean_rows(old: torch.Tensor, new: torch.Tensor, old_rows: int, added: int) -> None:
    """``_init_added_embeddings_weights_with_mean``: the added rows drawn from a normal with the old rows' mean and
    1e-9 times their covariance (their mean where that is not positive definite)."""
    weight = old.to(torch.float32)
    mean = torch.mean(weight, axis=0)
    centered = weight - mean
    covariance = centered.T @ centered / old_rows
    epsilon = 1e-9
    if torch.distributions.constraints.positive_definite.check(epsilon * covariance).all():
        distribution = torch.distributions.multivariate_normal.MultivariateNormal(
            mean, covariance_matrix=epsilon * covariance)
        new[-1 * added:, :] = distribution.sample(sample_shape=(added,)).to(old.dtype)
    else:
        new[-1 * added:, :] = mean[None, :].repeat(added, 1).to(old.dtype)


@torch.no_grad()
def _resized_embedding(embedding: nn.Embedding, rows: int, mean_resizing: bool, std: float) -> None:
    """``_get_resized_embeddings``, in place: the same module and ``Parameter``, its data replaced."""
    old_rows, width = embedding.weight.shape
    if old_rows == rows:
        embedding.num_embeddings = rows
        return
    weight = embedding.weight
    new = nn.Embedding(rows, width, device=weight.device, dtype=weight.dtype)
    if rows > old_rows and not mean_resizing:
        init_fresh_module_parameter(new, "weight", std)
    elif rows > old_rows:
        _mean_rows(weight.data, new.weight.data, old_rows, rows - old_rows)
    n = min(old_rows, rows)
    new.weight.data[:n, :] = weight.data[:n, :]
    weight.data = new.weight.data
    embedding.num_embeddings = rows
    if embedding.padding_idx is not None and rows - 1 < embedding.padding_idx:
        embedding.padding_idx = None


@torch.no_grad()
def _resized_linear(head: nn.Linear, rows: int, mean_resizing: bool, std: float) -> None:
    """``_get_resized_lm_head`` (not transposed): a new weight (and bias) in ``head``; a tied head, whose weight the
    input table already resized, only gets its ``out_features``."""
    old_rows, width = head.weight.shape
    if old_rows == rows:
        head.out_features = rows
        return
    new = nn.Linear(width, rows, bias=head.bias is not None, device=head.weight.device, dtype=head.weight.dtype)
    added = rows - old_rows
    if added > 0 and not mean_resizing:
        init_fresh_module_parameter(new, "weight", std)
        if new.bias is not None:
            init_fresh_module_parameter(new, "bias", std)
    elif added > 0:
        _mean_rows(head.weight.data, new.weight.data, old_rows, added)
        if new.bias is not None:
            bias_mean = torch.mean(head.bias.data, axis=0, dtype=torch.float32)
            bias_std = torch.std(head.bias.data, axis=0).to(torch.float32)
            new.bias.data[-1 * added:].normal_(mean=bias_mean, std=1e-9 * bias_std)
    n = min(old_rows, rows)
    new.weight.data[:n, :] = head.weight.data[:n, :]
    if new.bias is not None:
        new.bias.data[:n] = head.bias.data[:n]
    new.weight.requires_grad_(head.weight.requires_grad)
    head.weight = new.weight
    if new.bias is not None:
        new.bias.requires_grad_(head.bias.requires_grad)
        head.bias = new.bias
    head.out_features = rows


def _stray_vocab_bias(model: nn.Module, output: nn.Module) -> str | None:
    """The name of a vocabulary bias held beside the output layer and not tied to it (an untied BERT-style
    ``cls.predictions.bias``): transformers' families differ on what becomes of it, so it is refused."""
    for name, module in model.named_modules():
        if any(child is output for child in module.children()):
            bias = getattr(module, "bias", None)
            if isinstance(bias, nn.Parameter) and bias is not getattr(output, "bias", None):
                return f"{name}.bias" if name else "bias"
    return None


def resize_token_embeddings(model: nn.Module, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                            mean_resizing: bool = True) -> nn.Embedding:
    """transformers' ``resize_token_embeddings``: the input table (and an LM head, tied or not) to
    ``new_num_tokens`` rows, rounded up to ``pad_to_multiple_of``; old rows kept bit for bit, new rows drawn as
    transformers draws them; ``config.vocab_size`` updated. Returns the input embeddings."""
    new_num_tokens = _positive(new_num_tokens, "new_num_tokens")
    pad_to_multiple_of = _positive(pad_to_multiple_of, "pad_to_multiple_of")
    embedding = model.get_input_embeddings()
    if new_num_tokens is None and pad_to_multiple_of is None:
        return embedding
    kind = type(model).__name__
    if getattr(model, "lora_config", None) is not None:
        raise UnsupportedFeatureError(
            f"{kind}.resize_token_embeddings: the model holds a LoRA adapter (add_lora / load_adapter): resize the "
            "base model before adding the adapter, or fold it in first (lora.merge_and_unload(model))")
    output = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    for what, module, kinds in (("input embeddings", embedding, nn.Embedding),
                                ("output layer", output, (nn.Linear, nn.Embedding))):
        if module is not None and not isinstance(module, kinds):  # transformers' TypeError, typed
            raise UnsupportedFeatureError(f"{kind}.resize_token_embeddings: its {what} is a {type(module).__name__}, "
                                          "not an nn.Embedding or nn.Linear, which is all transformers resizes")
    tied = output is not None and output.weight is embedding.weight
    stray = _stray_vocab_bias(model, output) if output is not None and not tied else None
    if stray is not None:
        raise UnsupportedFeatureError(
            f"{kind}.resize_token_embeddings: {stray} is a vocabulary bias apart from the untied output layer "
            "(tie_word_embeddings=false); transformers' families treat it differently, so resizing it is not "
            "supported: resize a model with tied embeddings, or rebuild the head")
    rows = new_num_tokens if new_num_tokens is not None else embedding.weight.shape[0]
    if pad_to_multiple_of is not None:
        rows = (rows + pad_to_multiple_of - 1) // pad_to_multiple_of * pad_to_multiple_of
    std = _std(model.config)
    _resized_embedding(embedding, rows, mean_resizing, std)
    if output is not None:
        if isinstance(output, nn.Embedding):
            _resized_embedding(output, rows, mean_resizing, std)
        else:
            _resized_linear(output, rows, mean_resizing, std)
    if tied:  # tie_weights' _adjust_bias: the decoder's bias padded with zeros to the table's rows
        bias = getattr(output, "bias", None)
        if bias is not None and bias.shape[0] != rows:
            with torch.no_grad():
                bias.data = nn.functional.pad(bias.data, (0, rows - bias.shape[0]), "constant", 0)
    if hasattr(model.config, "vocab_size"):
        model.config.vocab_size = rows
    return embedding
