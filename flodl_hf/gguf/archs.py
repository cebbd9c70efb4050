"""The architecture table: which GGUF architectures load into which family, the metadata keys that become config
fields, and the value transforms llama.cpp's converter applied to tensors (undone on the way in, redone on the way
out).

Written from transformers 5.25's legacy GGUF loader (``integrations/ggml.py``: GGUF_CONFIG_MAPPING and its
defaults; ``modeling_gguf_pytorch_utils.py``: the tensor processors and the architecture renames), which is the
reference a loaded file is compared with. Only the architectures that loader maps and that flodl-hf has a family for
are here; any other is refused with the list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The metadata keys (after ``{arch}.``) most decoders share, and the config field each sets.
_DECODER = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_EXPERTS = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"}
_GEMMA = {**_DECODER, "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"}
_NO_ROPE_THETA = {k: v for k, v in _DECODER.items() if k != "rope.freq_base"}


@dataclass(frozen=True)
class Arch:
    """One GGUF architecture: the family it loads into, its config keys and its tensor transforms."""

    gguf: str                                   # general.architecture, as llama.cpp writes it
    model_type: str                             # the family's model_type
    keys: dict[str, str]                        # "{arch}.<key>" -> config field
    defaults: dict[str, object] = field(default_factory=dict)
    permute_qk: bool = False                    # LLaMA's q/k rows interleaved per head (convert_hf_to_gguf's permute)
    norm_offset: bool = False                   # Gemma's RMSNorm weights stored as w + 1
    transposed: tuple[str, ...] = ()            # GPT-2's Conv1D weights, stored as nn.Linear's
    experts: bool = False                       # stacked experts as ffn_{gate,up,down}_exps


ARCHS: dict[str, Arch] = {a.model_type: a for a in (
    Arch("llama", "llama", {**_DECODER, "rope.dimension_count": "head_dim"}, permute_qk=True),
    # llama.cpp writes Mistral as llama (export only: a llama file loads as LLaMA; transformers 5.25's Mistral rule,
    # general.name "mistral", fails in its own tensor mapping, as gguf has no "mistral" architecture)
    Arch("llama", "mistral", {**_DECODER, "rope.dimension_count": "head_dim"}, permute_qk=True),
    Arch("qwen2", "qwen2", _DECODER),
    Arch("qwen2moe", "qwen2_moe", {**_DECODER, **_EXPERTS}, experts=True),
    Arch("qwen3", "qwen3", _DECODER),
    # llama.cpp's Qwen3-MoE always renormalises the top-k weights
    Arch("qwen3moe", "qwen3_moe", {**_DECODER, **_EXPERTS, "attention.key_length": "head_dim"},
         defaults={"norm_topk_prob": True}, experts=True),
    Arch("phi3", "phi3", _DECODER),
    Arch("gemma2", "gemma2", _GEMMA, norm_offset=True),
    Arch("gemma3", "gemma3_text", _GEMMA, norm_offset=True),
    Arch("gpt2", "gpt2", {"block_count": "n_layer", "context_length": "n_ctx", "embedding_length": "n_embd",
                          "feed_forward_length": "feed_forward_length", "attention.head_count": "n_head",
                          "attention.layer_norm_epsilon": "layer_norm_epsilon"},
         transposed=("attn_qkv.weight", "ffn_down.weight", "ffn_up.weight", "attn_output.weight")),
    Arch("starcoder2", "starcoder2", {"block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
                                      "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
                                      "attention.head_count": "num_attention_heads",
                                      "attention.head_count_kv": "num_key_value_heads",
                                      "attention.layer_norm_epsilon": "norm_epsilon"}),
    Arch("stablelm", "stablelm", {**{k: v for k, v in _NO_ROPE_THETA.items() if "rms" not in k},
                                  "attention.layer_norm_epsilon": "layer_norm_eps"}),
)}

# general.architecture -> the entry it loads as
BY_GGUF = {a.gguf: a for a in ARCHS.values() if a.model_type != "mistral"}
# The tokenizer ids transformers copies into the config.
TOKEN_IDS = {"tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
             "tokenizer.ggml.unknown_token_id": "unk_token_id", "tokenizer.ggml.padding_token_id": "pad_token_id"}


def supported() -> str:
    """The supported GGUF architectures, for error messages."""
    return ", ".join(sorted(BY_GGUF))


def arch_for(architecture: str) -> Arch | None:
    """The entry for a file's general.architecture (None: not supported)."""
    return BY_GGUF.get(architecture)


def qk_heads(gguf_name: str, config: dict) -> int | None:
    """The head count LLaMA's q/k permutation of this tensor runs over (None: not a q or k tensor)."""
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is None or kv_heads is None:
        return None
    if ".attn_q." in gguf_name:
        return heads
    if ".attn_k." in gguf_name:
        return kv_heads
    return None


def unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k row permutation undone: per head, the (2, half) interleave back to (half, 2)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k row permutation (LlamaModel.permute): the inverse of ``unpermute``."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
