"""LoRA on our native modules, exchanged with PEFT bit for bit.

``add_lora(model, ...)`` puts a low-rank adapter on the named linear layers of a model, with
PEFT's names, PEFT's matching rules and PEFT's arithmetic, so an adapter trained here is a PEFT
adapter and one that PEFT wrote loads here:

- targets are PEFT's module-name suffixes (``query``, ``value``, ``q_lin``, ``query_proj``,
  ``Wqkv``...): a list matches a module whose name is an entry or ends in ``"." + entry``, a string
  is a regex over the whole name (``peft.tuners.tuners_utils.check_target_module_exists``);
  ``None`` takes PEFT's default for the model type (:data:`PEFT_DEFAULT_TARGETS`, the entries of
  ``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` for our families;
  tests/test_lora.py compares the two);
- a target is a :class:`LoraLinear`: the linear layer itself, its ``weight`` and ``bias`` kept
  under their keys and frozen, plus ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]`` and
  ``lora_dropout``; its forward is PEFT's ``lora.Linear.forward`` op for op:
  ``F.linear(x, W, b) + lora_B(lora_A(dropout(x))) * scaling``, ``scaling = alpha / r`` (rsLoRA:
  ``alpha / sqrt(r)``);
- init is PEFT's, RNG draws included: ``nn.Linear(in, r)`` then ``nn.Linear(r, out)`` are built (each
  draws its default init), then A gets ``kaiming_uniform_(a=sqrt(5))`` and B zeros; targets are
  visited in ``named_modules()`` order, which is transformers' order, so the same seed gives PEFT's A;
- ``modules_to_save`` (PEFT's rule: a module whose name ends with an entry) stay trainable and go
  into the adapter file; PEFT's task classes add their heads (``classifier``/``score`` for SEQ_CLS and
  TOKEN_CLS, ``qa_outputs`` for QUESTION_ANS), and so does :func:`add_lora` for the task type (by default
  the model's task's; ``load_adapter`` takes the adapter's). A module to save that shares a weight with
  another (a tied LM head) trains its own copy, as PEFT's ``ModulesToSaveWrapper`` does;
- on a float16 / bfloat16 base the adapter weights are float32, as PEFT's (``autocast_adapter_dtype``);
- a decoder tied to the input embeddings is never adapted: a target that matches one is refused;
- a ``Conv1D`` target (GPT-2's ``c_attn``..., a module declaring ``fan_in_fan_out = True``) is a
  :class:`LoraConv1D`, as PEFT adapts it with ``fan_in_fan_out`` (which it sets by the layer's type, so the
  field's value in an adapter_config.json changes nothing);
- PEFT's ``exclude_modules``, ``layers_to_transform`` / ``layers_pattern``, ``rank_pattern`` /
  ``alpha_pattern`` (:meth:`LoraConfig.selects`, :meth:`LoraConfig.rank_and_alpha`) and DoRA (``use_dora``:
  a trainable ``lora_magnitude_vector`` per layer, ``DoraLinearVariant``'s forward and merge op for op);
- PEFT's ``trainable_token_indices`` (:class:`TrainableTokensEmbedding`, PEFT's ``TrainableTokensWrapper``):
  the listed embedding rows trained as a delta (``<embedding>.token_adapter.trainable_tokens_delta`` in the
  file), an output layer tied to the input embeddings following them (:class:`TiedTrainableTokensLinear`),
  an untied one named by the object with rows of its own (:class:`TrainableTokensLinear`);
- PEFT's ``target_parameters`` (:class:`LoraParameters`, PEFT's ``ParamWrapper``): LoRA on Parameters by name, an
  MoE's stacked experts (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) above all, each a low-rank update
  per expert, folded into the Parameter for the module's forward as PEFT folds it (``baddbmm``).

Out: :func:`save_adapter` (a LoRA model) and ``flodl_hf.roundtrip.adapters.export_adapter`` (a trainer checkpoint)
write ``adapter_config.json`` and ``adapter_model.safetensors`` under PEFT's keys
(``base_model.model.<module>.lora_A.weight``); ``flodl_hf.roundtrip.adapters.merged_checkpoint_state`` gives the
merged weights that ``export --checkpoint`` writes as an HF-canonical directory. In: :func:`load_adapter`
(or ``AutoModelFor*.from_pretrained(BASE, adapter=DIR)``) reads what ``PeftModel.save_pretrained``
wrote. ``flodl_hf.roundtrip.verify.verify_adapter`` is ``verify-export`` on an adapter directory.

The modules: ``config`` (:class:`LoraConfig`, PEFT's task types, settings checks), ``layers`` (the adapted layers),
``patterns`` (the settings' regular expressions, their matching bounded), ``targets`` (which modules are adapted),
``adapt`` (:func:`add_lora`, merging, undoing a refused one), ``peft_format`` (the adapter directory), ``base`` (the
base an adapter depends on), ``checkpoint`` (LoRA in trainer checkpoints).
"""

from flodl_hf.lora.adapt import add_lora, merge, merge_and_unload, unmerge
from flodl_hf.lora.base import base_paths, base_reference
from flodl_hf.lora.checkpoint import (checkpoint_entry, load_checkpoint_adapter, load_trainer_state, trainer_entry,
                                      trainer_model_state)
from flodl_hf.lora.config import (BIAS_MODES, PEFT_TASK_TYPES, TASK_MODULES_TO_SAVE, TASK_OF_PEFT_TASK_TYPE,
                                  TASK_TYPE_MODULES_TO_SAVE, LoraConfig, lora_settings)
from flodl_hf.lora.layers import (LoraConv1D, LoraLinear, LoraParameters, TiedTrainableTokensLinear,
                                  TrainableTokensEmbedding, TrainableTokensLinear)
from flodl_hf.lora.patterns import ALL_LINEAR, MAX_STEPS, check_patterns
from flodl_hf.lora.peft_format import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_STAMP, PEFT_PREFIX, SUPPORTED_PEFT_TYPES,
                                       adapter_state, adapter_task, load_adapter, peft_config_dict, peft_state,
                                       read_adapter_config, read_base_stamp, save_adapter)
from flodl_hf.lora.targets import (MIN_TARGET_MODULES_FOR_OPTIMIZATION, PEFT_DEFAULT_TARGETS, all_linear_targets,
                                   default_targets, is_lora, lora_layers, minimal_targets, parameter_layers,
                                   save_module_names, token_layers, token_targets)

__all__ = [
    # config
    "ALL_LINEAR", "BIAS_MODES", "PEFT_TASK_TYPES", "TASK_MODULES_TO_SAVE", "TASK_OF_PEFT_TASK_TYPE",
    "TASK_TYPE_MODULES_TO_SAVE", "LoraConfig", "lora_settings",
    # layers
    "LoraConv1D", "LoraLinear", "LoraParameters", "TiedTrainableTokensLinear", "TrainableTokensEmbedding",
    "TrainableTokensLinear",
    # patterns
    "MAX_STEPS", "check_patterns",
    # targets
    "MIN_TARGET_MODULES_FOR_OPTIMIZATION", "PEFT_DEFAULT_TARGETS", "all_linear_targets", "default_targets", "is_lora",
    "lora_layers", "minimal_targets", "parameter_layers", "save_module_names", "token_layers", "token_targets",
    # adapt
    "add_lora", "merge", "merge_and_unload", "unmerge",
    # base
    "base_paths", "base_reference",
    # peft_format
    "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "BASE_STAMP", "PEFT_PREFIX", "SUPPORTED_PEFT_TYPES", "adapter_state",
    "adapter_task", "load_adapter", "peft_config_dict", "peft_state", "read_adapter_config", "read_base_stamp",
    "save_adapter",
    # checkpoint
    "checkpoint_entry", "load_checkpoint_adapter", "load_trainer_state", "trainer_entry", "trainer_model_state",
]
