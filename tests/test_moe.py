"""The mixture-of-experts decoders' own checks against transformers 5.25 in the same run (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE): the config defaults and the experts' count under either config.json name; the router's logits, weights and picks per sparse layer torch.equal to transformers', every expert
picked by some token and the tokens' picks differing; the file layout (the hub's and save_pretrained's per-expert keys,
merged on load and split on export by the family's ``key_merges``; the module layout loads too; a missing expert is a
typed error); Qwen2-MoE's sliding layers from its own rule when a config.json has no ``layer_types``; sampled
``model.generate``; LoRA both ways with PEFT (Mixtral: the attention projections; Qwen2-MoE:
the shared expert's and the dense layers' too); a training step with Mixtral's router jitter noise; hand mutations of
the routing that the parity tables would catch; ``output_router_logits`` (the router logits, the aux
loss, the loss with it, a training step on it); the options refused. The forwards on both attention paths, every head,
the losses, caches, dtype casts, gradients and export round trips are in the shared tables (tests/cases/mixtral.py,
tests/cases/qwen2_moe.py, tests/cases/qwen3_moe.py, tests/cases/olmoe.py)."""

from __future__ import annotations

import inspect
import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from flodl_hf.auto import load_model
from flodl_hf.core.errors import CheckpointFormatError, ConfigError, InputError
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers, reference_model
from flodl_hf.core.registry import get_family

from decoder_checks import case_fields
from helpers import (assert_config_defaults_equal, assert_model_generate_equal,  # noqa: F401  (one_thread: a fixture)
                     assert_training_step_equal, dropout_acted, export_as_save_pretrained, make_checkpoint, model_pair,
                     one_thread)
from test_decoder import _left_padded

pytestmark = pytest.mark.usefixtures("one_thread")

TOP2, TOP3, WIDE = "mixtral-hd24-4experts-top2", "mixtral-hd24-6experts-top3-window4", "mixtral-1024-4experts"
QTOP2, QTOP3, QWIDE = ("qwen2_moe-hd24-4experts-norm-dense1", "qwen2_moe-hd24-6experts-top3-step2-window4",
                       "qwen2_moe-1024-4experts")
Q3TOP2, Q3TOP3, Q3WIDE = ("qwen3_moe-hd24-4experts-norm-bias-dense1", "qwen3_moe-hd24-6experts-top3-step2-window4",
                          "qwen3_moe-768-1layer")
OTOP2, OTOP3, OWIDE = "olmoe-hd24-4experts-norm-bias", "olmoe-hd24-6experts-top3-clip", "olmoe-768-1layer"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# per family: its top-2 and top-3 variants (layer 0 sparse in the first, layer 1 in the second), the file key of
# an expert's up projection and of a router
FAMILIES = {"mixtral": (TOP2, TOP3, "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
                        "model.layers.{layer}.block_sparse_moe.gate.weight"),
            "qwen2_moe": (QTOP2, QTOP3, "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
                          "model.layers.{layer}.mlp.gate.weight"),
            "qwen3_moe": (Q3TOP2, Q3TOP3, "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
                          "model.layers.{layer}.mlp.gate.weight"),
            "olmoe": (OTOP2, OTOP3, "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
                      "model.layers.{layer}.mlp.gate.weight")}


def _pair(variant: str, impl: str = "sdpa", **overrides):
    """The causal LM's checkpoint of ``variant``, and ours and transformers' model of it."""
    source = make_checkpoint(case_fields(variant), "causal_lm")
    return (source, *model_pair(source, "causal_lm", impl, **overrides))


def _logits(model, batch) -> torch.Tensor:
    with torch.inference_mode():
        return model(**batch, use_cache=False).logits


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_config_defaults_are_transformers(model_type):
    # RoPE compared below; Qwen2MoeConfig rewrites sliding_window (0 without use_sliding_window), mlp_only_layers
    # (None -> []) and layer_types (filled in): compared through what they decide; OlmoeConfig fills in the KV heads
    ours, theirs, _ = assert_config_defaults_equal(
        model_type, {"rope_parameters", "rope_scaling", "rope_theta", "sliding_window", "mlp_only_layers",
                     "layer_types"},
        {"num_experts_per_tok", "rms_norm_eps", "num_key_value_heads", "output_router_logits"},
        lambda ours, name: ours.kv_heads if name == "num_key_value_heads" else getattr(ours, name))
    assert ours.rope().theta == theirs.rope_parameters["rope_theta"] and ours.num_experts == theirs.num_experts
    assert ours.layer_kinds() == list(getattr(theirs, "layer_types", None) or ours.layer_kinds())
    assert ours.window("sliding_attention") == (getattr(theirs, "sliding_window", None) or None)


def _router_outputs(layers, gate_of) -> list:
    records: list = []
    hooks = [gate_of(layer).register_forward_hook(lambda m, i, o: records.append(o)) for layer in layers]
    return records, hooks


def _sparse(layers) -> list:
    return [layer for layer in layers if hasattr(layer.mlp, "gate")]


@pytest.mark.parametrize("variant", [TOP2, TOP3, WIDE, QTOP2, QTOP3, QWIDE, Q3TOP2, Q3TOP3, Q3WIDE, OTOP2, OTOP3,
                                     OWIDE])
def test_router_equals_transformers_and_every_expert_is_picked(variant):
    """Per sparse layer, the router's logits, weights and picks torch.equal transformers'; every expert is picked by
    some token of the parity batch and the tokens' picks differ (so every expert's rows are compared)."""
    _, ours, theirs = _pair(variant)
    batch = make_batch(ours.config, "causal_lm")
    mine, a = _router_outputs(_sparse(ours.backbone.layers), lambda layer: layer.mlp.gate)
    ref, b = _router_outputs(_sparse(theirs.model.layers), lambda layer: layer.mlp.gate)
    assert torch.equal(_logits(ours, batch), _logits(theirs, batch))
    for hook in a + b:
        hook.remove()
    config = ours.config
    sparse = [i for i in range(config.num_hidden_layers) if getattr(config, "sparse", lambda i: True)(i)]
    assert len(mine) == len(ref) == len(sparse) >= 1
    experts = ours.config.num_experts
    for (logits, weights, picks), (their_logits, their_weights, their_picks) in zip(mine, ref):
        assert torch.equal(logits, their_logits) and torch.equal(weights, their_weights)
        assert torch.equal(picks, their_picks)
        assert picks.shape[-1] == ours.config.num_experts_per_tok
        assert set(picks.unique().tolist()) == set(range(experts))
        assert len({tuple(sorted(row)) for row in picks.tolist()}) > 1


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_export_writes_save_pretrained_s_per_expert_keys(model_type, tmp_path):
    """Export: the keys transformers' save_pretrained writes (per expert), verify-export at diff 0, and our
    ``hf_state_dict`` torch.equal to transformers' file, tensor by tensor."""
    _, variant, expert_key, gate_key = FAMILIES[model_type]
    source = make_checkpoint(case_fields(variant), "causal_lm")
    written, _ = export_as_save_pretrained(source, tmp_path)
    assert expert_key.format(layer=1, expert=5) in written and gate_key.format(layer=1) in written
    assert not any("gate_up_proj" in k or k.endswith("experts.down_proj") for k in written)
    theirs = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    ours = load_model(source, "causal_lm").hf_state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_module_layout_loads_and_a_missing_expert_is_refused(model_type, tmp_path):
    """A file in the module layout (transformers' in-memory ``mlp.experts.gate_up_proj``) loads to the same logits;
    a hub-layout file without one expert's up projection is a CheckpointFormatError naming it."""
    variant, _, expert_key, _ = FAMILIES[model_type]
    source, ours, theirs = _pair(variant)
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(source / "config.json", fused / "config.json")
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(fused / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(str(fused / "model.safetensors"))
    batch = make_batch(ours.config, "causal_lm")
    assert torch.equal(_logits(load_model(fused, "causal_lm").eval(), batch), _logits(theirs, batch))
    holed = tmp_path / "holed"
    shutil.copytree(source, holed)
    tensors = load_file(str(holed / "model.safetensors"))
    missing = expert_key.format(layer=0, expert=2)
    del tensors[missing]
    save_file(tensors, str(holed / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match=missing.replace(".", r"\.")):
        load_model(holed, "causal_lm")


def test_key_merges_invert_and_are_a_no_op_elsewhere():
    key_map = get_family("mixtral").key_map()
    gen = torch.Generator().manual_seed(0)
    state = {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 10, 4, generator=gen),
             "model.layers.0.mlp.experts.down_proj": torch.randn(3, 4, 5, generator=gen),
             "model.layers.0.mlp.gate.weight": torch.randn(3, 4, generator=gen),
             "model.norm.weight": torch.randn(4, generator=gen)}
    files = key_map.to_hf_state(state)
    assert torch.equal(files["model.layers.0.block_sparse_moe.experts.1.w3.weight"],
                       state["model.layers.0.mlp.experts.gate_up_proj"][1, 5:])
    assert len(files) == 3 * 3 + 2
    back = key_map.merge(files)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert key_map.to_native("layers.1.block_sparse_moe.experts.2.w3.weight") == "layers.1.mlp.experts.gate_up_proj"
    assert key_map.to_hf("model.layers.0.mlp.gate.weight") == "model.layers.0.block_sparse_moe.gate.weight"
    plain = get_family("mistral").key_map()
    assert plain.merges == () and plain.merge(files) is files and plain.to_hf_state(state) == state


def test_qwen2_moe_sliding_layers_without_layer_types(tmp_path):
    """A config.json without ``layer_types`` (save_pretrained writes them, older files do not): Qwen2-MoE's own rule
    (with use_sliding_window, the even-indexed layers below max_window_layers; Qwen2's is the layers from it on)
    picks layer 0 of three, as transformers' config; the logits torch.equal transformers' on the same directory."""
    root = tmp_path / "no-layer-types"
    shutil.copytree(make_checkpoint(case_fields(QTOP3), "causal_lm"), root)
    config = json.loads((root / "config.json").read_text())
    assert config.pop("layer_types") == ["sliding_attention", "full_attention", "full_attention"]
    (root / "config.json").write_text(json.dumps(config))
    ours = load_model(root, "causal_lm").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = reference_model(root, "causal_lm", "sdpa")
    assert ours.config.layer_kinds() == theirs.config.layer_types
    batch = make_batch(ours.config, "causal_lm")
    assert torch.equal(_logits(ours, batch), _logits(theirs, batch))


ALIASES = [(TOP2, "num_local_experts", "num_experts"), (Q3TOP2, "num_local_experts", "num_experts"),
           (OTOP2, "num_experts", "num_local_experts")]


@pytest.mark.parametrize("variant,written,alias", ALIASES, ids=[a[0] for a in ALIASES])
def test_the_experts_count_under_its_other_name(variant, written, alias, tmp_path):
    """The experts' count under the config's attribute_map alias (the Qwen3-MoE hub files' ``num_experts``,
    save_pretrained's ``num_local_experts``; OLMoE's the other way round): the same model as transformers' on the same
    directory; with both names given, the one that is not a transformers config field wins, as there (set after
    the fields): Mixtral's ``num_experts``, Qwen3-MoE's and OLMoE's ``num_local_experts``."""
    root = tmp_path / "alias"
    shutil.copytree(make_checkpoint(case_fields(variant), "causal_lm"), root)
    config = json.loads((root / "config.json").read_text())
    config[alias] = config.pop(written)
    (root / "config.json").write_text(json.dumps(config))
    ours = load_model(root, "causal_lm").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = reference_model(root, "causal_lm", "sdpa")
    assert ours.config.num_experts == theirs.config.num_experts == 4
    batch = make_batch(ours.config, "causal_lm")
    assert torch.equal(_logits(ours, batch), _logits(theirs, batch))
    config.update(num_experts=7, num_local_experts=5)
    both = get_family(config["model_type"]).config_class.from_dict(config)
    winner = config["num_experts" if variant == TOP2 else "num_local_experts"]
    assert both.num_experts == quiet_transformers().AutoConfig.for_model(**config).num_experts == winner


@pytest.mark.parametrize("variant", [TOP3, QTOP2, Q3TOP3, OTOP3])
def test_model_generate_sampled_equals_transformers(variant):
    _, ours, theirs = _pair(variant, "sdpa")
    ids, mask = _left_padded(ours.config.vocab_size)
    for kwargs in (dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9), dict(do_sample=False)):
        assert_model_generate_equal(ours, theirs, ids, mask, **kwargs)


@pytest.mark.parametrize("variant,targets", [(TOP2, ATTENTION),
                                             (QTOP2, ATTENTION + ["gate_proj", "up_proj", "down_proj"]),
                                             (Q3TOP2, ATTENTION), (OTOP2, ATTENTION)])
def test_lora_on_the_causal_lm_both_ways_with_peft(variant, targets, tmp_path):
    """test_lora's round trip (PEFT's adapter in, a training step, ours out to PEFT, merged) on the causal LM: Mixtral's
    attention projections (its all-linear, with which PEFT adapts the router and the stacked experts too:
    tests/test_lora_target_parameters.py), Qwen2-MoE's and its shared expert's and dense layer's SwiGLU."""
    from test_lora import test_peft_round_trip_and_training_step as peft_round_trip
    peft_round_trip("causal_lm", case_fields(variant), targets, 8, True, tmp_path)


def _router_batch(config, masked: bool) -> dict:
    batch = make_batch(config, "causal_lm")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    if not masked:
        batch = {"input_ids": batch["input_ids"]}
    return {**batch, "labels": labels, "use_cache": False}


@pytest.mark.parametrize("variant", [TOP3, QTOP2, Q3TOP3, OTOP2])
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no-mask"])
def test_router_logits_and_aux_loss_equal_transformers(variant, masked):
    """``output_router_logits=True``: each sparse layer's router logits, the aux loss (load_balancing_loss_func, over
    the unmasked tokens or every row) and the loss with ``router_aux_loss_coef`` times it torch.equal transformers',
    from the causal LM and the bare backbone; the config's ``output_router_logits`` is the default."""
    source, ours, theirs = _pair(variant)
    batch = _router_batch(ours.config, masked)
    with torch.inference_mode():
        a, b = ours(**batch, output_router_logits=True), theirs(**batch, output_router_logits=True)
        plain = ours(**batch).loss
    assert a.aux_loss is not None and not torch.equal(a.loss, plain)
    for name in ("loss", "aux_loss", "logits"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert len(a.router_logits) == len(b.router_logits) == len(_sparse(ours.backbone.layers))
    assert all(torch.equal(x, y) for x, y in zip(a.router_logits, b.router_logits))
    base = reference_model(source, "base", "sdpa")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.inference_mode():
        mine, ref = ours.backbone(**inputs, output_router_logits=True), base(**inputs, output_router_logits=True)
    assert all(torch.equal(x, y) for x, y in zip(mine.router_logits, ref.router_logits, strict=True))
    on = load_model(source, "causal_lm", output_router_logits=True).eval()
    with torch.inference_mode():
        assert torch.equal(on(**batch).loss, a.loss) and on(**batch, output_router_logits=False).aux_loss is None
        mine, ref = (m(**batch, output_router_logits=True, return_dict=False) for m in (ours, theirs))
    assert len(mine) == len(ref) and all(torch.equal(x, y) for x, y in zip(mine[:3], ref[:3]))  # loss, aux, logits


def test_router_logits_on_a_cached_step_is_a_typed_error():
    """Generating with ``output_router_logits`` in the config: the aux loss of a cached step has a mask wider than the
    step's tokens; transformers fails with a shape error, flodl-hf with an InputError saying what to pass."""
    source = make_checkpoint(case_fields(TOP2), "causal_lm")
    ids, mask = _left_padded(1000)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=2, eos_token_id=[], pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = quiet_transformers().AutoModelForCausalLM.from_pretrained(str(source), output_router_logits=True)
        with pytest.raises(RuntimeError, match="must match the size"):
            theirs.generate(**kwargs)
    with pytest.raises(InputError, match="pass output_router_logits=False"):
        load_model(source, "causal_lm", output_router_logits=True).generate(**kwargs)


@pytest.mark.parametrize("variant", [TOP2, QTOP3])
def test_training_step_with_the_aux_loss_equals_transformers(variant):
    """A training step on the loss with the aux loss added: the loss and every gradient (the routers' too, through
    the aux loss) torch.equal transformers'."""
    _, ours, theirs = _pair(variant, "eager")
    assert_training_step_equal(ours, theirs, {**_router_batch(ours.config, True), "output_router_logits": True})


def test_training_step_with_router_jitter_equals_transformers():
    """``router_jitter_noise`` multiplies the router's input by uniform noise in training only: the loss and every
    gradient torch.equal transformers' from the same seed, and the noise changes the loss."""
    _, ours, theirs = _pair(TOP2, "eager", router_jitter_noise=0.3)
    batch = make_batch(ours.config, "causal_lm")
    batch = {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100), "use_cache": False}
    loss = assert_training_step_equal(ours, theirs, batch)
    assert dropout_acted(ours, batch, loss)


def _no_renormalisation(self, hidden_states):
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    top, index = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
    return logits, top, index


def _eager_experts(self, hidden_states, top_k_index, top_k_weights):
    """transformers' eager MixtralExperts loop (per expert, index_add_): another sum order and other matmul shapes."""
    out = torch.zeros_like(hidden_states)
    for expert in range(self.num_experts):
        token, pos = torch.where(top_k_index == expert)
        if token.numel():
            gate, up = torch.nn.functional.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            h = torch.nn.functional.linear(self.act(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, h * top_k_weights[token, pos, None])
    return out


def _ungated_shared_expert(self, hidden_states):
    """Qwen2-MoE's block with the shared expert added without its sigmoid gate."""
    batch, length, hidden = hidden_states.shape
    flat = hidden_states.view(-1, hidden)
    _, weights, index = self.gate(flat)
    return (self.experts(flat, index, weights) + self.shared_expert(flat)).reshape(batch, length, hidden)


MUTATIONS = [(TOP3, "no-renormalisation"), (TOP3, "eager-experts-loop"), (TOP3, "top-k-minus-one"),
             (QTOP3, "eager-experts-loop"), (QTOP2, "norm-topk-prob-ignored"), (QTOP2, "shared-expert-ungated"),
             (Q3TOP2, "norm-topk-prob-ignored"), (Q3TOP3, "window-ignored"), (OTOP2, "norm-topk-prob-ignored"),
             (OTOP3, "clip-qkv-ignored")]


@pytest.mark.parametrize("variant,mutation", MUTATIONS, ids=[f"{v}-{m}" for v, m in MUTATIONS])
def test_routing_mutations_leave_transformers(variant, mutation, monkeypatch):
    """Each op of the routing matters: with one changed on our side, the logits leave transformers' (so the parity
    tables would catch it)."""
    from flodl_hf.families import mixtral
    _, ours, theirs = _pair(variant)
    batch = make_batch(ours.config, "causal_lm")
    reference = _logits(theirs, batch)
    assert torch.equal(_logits(ours, batch), reference)
    blocks = [layer.mlp for layer in _sparse(ours.backbone.layers)]
    if mutation == "no-renormalisation":
        monkeypatch.setattr(mixtral.MixtralTopKRouter, "forward", _no_renormalisation)
    elif mutation == "eager-experts-loop":
        monkeypatch.setattr(mixtral.MixtralExperts, "forward", _eager_experts)
    elif mutation == "top-k-minus-one":
        for block in blocks:
            block.gate.top_k -= 1
    elif mutation == "norm-topk-prob-ignored":
        for block in blocks:
            block.gate.norm_topk_prob = False
    elif mutation == "window-ignored":  # Qwen3-MoE's window on every layer
        monkeypatch.setattr(type(ours.config), "layer_kinds", lambda self: ["full_attention"] * self.num_hidden_layers)
    elif mutation == "clip-qkv-ignored":  # OLMoE's clamp of the normed q, k and v
        ours.config.clip_qkv = None
    else:
        from flodl_hf.families import qwen2_moe
        monkeypatch.setattr(qwen2_moe.Qwen2MoeSparseMoeBlock, "forward", _ungated_shared_expert)
    assert not torch.equal(_logits(ours, batch), reference)


REFUSED = {"mixtral": [("num_experts_per_tok", 5), ("num_local_experts", 0), ("router_jitter_noise", -0.1)],
           "qwen2_moe": [("num_experts_per_tok", 5), ("num_experts", 0), ("decoder_sparse_step", 0),
                         ("layer_types", ["sliding_attention", "full_attention"])],
           "qwen3_moe": [("num_experts_per_tok", 5), ("num_local_experts", 0), ("decoder_sparse_step", 0),
                         ("layer_types", ["full_attention", "full_attention"])],
           "olmoe": [("num_experts_per_tok", 5), ("num_experts", 0), ("clip_qkv", 0.0), ("head_dim", 32)]}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_bad_options_and_other_experts_implementations_are_refused(model_type):
    source = make_checkpoint(case_fields(FAMILIES[model_type][0]), "causal_lm")
    for field, value in REFUSED[model_type]:
        with pytest.raises(ConfigError, match=field):
            load_model(source, "causal_lm", **{field: value})
    ours = load_model(source, "causal_lm")
    with pytest.raises(InputError, match="experts_implementation"):
        load_model(source, "causal_lm", experts_implementation="eager")
    # MixtralForCausalLM.forward's positional order: output_router_logits before logits_to_keep
    causal_lm = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}[model_type]
    theirs = list(inspect.signature(getattr(quiet_transformers(), causal_lm).forward).parameters)[1:10]
    assert list(inspect.signature(type(ours).forward).parameters)[1:10] == theirs
    assert json.loads((source / "config.json").read_text())["num_experts_per_tok"] == 2
