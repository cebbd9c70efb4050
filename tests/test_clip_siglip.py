"""CLIP and SigLIP beyond the parity table (tests/cases/clip*.py, siglip*.py, which compares every output field, the
towers' records included): the features, the losses and every gradient, position interpolation at other image sizes,
the two EOS pooling rules, the recorded hidden states and attentions, typed errors for bad input, the text tower's
older file layout, and LoRA in and out with the real peft. Every comparison is with transformers (or peft) in the
same run, ``torch.equal``."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from flodl_hf import lora
from flodl_hf.auto import load_model
from flodl_hf.core.errors import AdapterError, ConfigError, InputError
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers, reference_model

from cases import CASES
from helpers import assert_training_step_equal, make_checkpoint, model_pair, one_thread  # noqa: F401 (fixture)
from test_lora import _peft_name, _peft_trainable, _perturb

pytestmark = pytest.mark.usefixtures("one_thread")


def _fields(variant: str) -> dict:
    """The config fields of a variant of tests/cases."""
    return next(f for c, t, f in CASES if c.removesuffix(f"-{t}") == variant)


def _equal(a, b, where: str) -> None:
    """Every tensor field of transformers' record ``b`` (and of its nested records) equal in ours, ``a``."""
    compared = 0
    for name, value in b.items():
        mine = getattr(a, name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(mine, value), f"{where}: {name} differs by {(mine - value).abs().max().item()}"
            compared += 1
        elif isinstance(value, tuple):
            assert len(mine) == len(value), f"{where}: {name} has {len(mine)} entries, transformers' {len(value)}"
            for i, (x, y) in enumerate(zip(mine, value)):
                assert torch.equal(x, y), f"{where}: {name}[{i}] differs by {(x - y).abs().max().item()}"
            compared += len(value)
        elif hasattr(value, "items"):
            _equal(mine, value, f"{where}.{name}")
            compared += 1
    assert compared, f"{where}: nothing compared"


DUALS = [pytest.param(case, impl, id=f"{case}-{impl}") for case in ("clip-hd24", "siglip-hd24")
         for impl in ("sdpa", "eager")] + [pytest.param("clip-768", "sdpa", id="clip-768-sdpa")]


@pytest.mark.parametrize("case,impl", DUALS)
def test_features_loss_and_every_gradient_equal_transformers(case, impl):
    """get_text_features / get_image_features (the towers' records with the features as pooler_output), then a
    training step with return_loss=True (CLIP's contrastive loss, SigLIP's sigmoid loss): the loss, the parameters'
    order and every gradient torch.equal."""
    ours, theirs = model_pair(make_checkpoint(_fields(case), "base"), "base", impl)
    batch = make_batch(ours.config, "base")
    with torch.inference_mode():
        _equal(ours.get_text_features(batch["input_ids"], batch["attention_mask"]),
               theirs.get_text_features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]), "text")
        _equal(ours.get_image_features(batch["pixel_values"]),
               theirs.get_image_features(pixel_values=batch["pixel_values"]), "image")
    loss = assert_training_step_equal(ours, theirs, {**batch, "return_loss": True})
    assert loss > 0 and all(p.grad is not None and p.grad.any() for p in ours.parameters())


@pytest.mark.parametrize("case", ["clip-vision-hd24", "siglip-vision-hd24", "clip-hd24"])
def test_interpolate_pos_encoding_at_other_sizes_equals_transformers(case):
    """Images of another size (96 x 80 for a 64-pixel model: a 6 x 5 grid of patches) with
    interpolate_pos_encoding=True: the position table resized bicubically, as transformers does; at the model's own
    size it is the table itself. Without it, CLIP refuses another size (as transformers does) with a typed error,
    and SigLIP takes any size of as many patches (64 x 70), as transformers does."""
    fields = _fields(case)
    ours, theirs = model_pair(make_checkpoint(fields, "base"), "base", "sdpa")
    batch = make_batch(ours.config, "base")
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for size in ((96, 80), (64, 64), (48, 48)):
            pixels = torch.randn(2, 3, *size, generator=gen)
            inputs = {**batch, "pixel_values": pixels, "interpolate_pos_encoding": True}
            _equal(ours(**inputs), theirs(**inputs), f"{size}")
        pixels = torch.randn(2, 3, 64, 70, generator=gen)
        if fields["model_type"] == "siglip_vision_model":
            _equal(ours(pixel_values=pixels), theirs(pixel_values=pixels), "64x70")
        else:
            with pytest.raises(ValueError):
                theirs(**{**batch, "pixel_values": pixels})
            with pytest.raises(InputError, match="pixel_values are 64x70 pixels.*interpolate_pos_encoding"):
                ours(**{**batch, "pixel_values": pixels})


@pytest.mark.parametrize("case,rule", [("clip-text-hd24", "argmax"), ("clip-text-eos-hd24", "first eos")])
def test_text_tower_pools_by_its_config_s_eos_rule(case, rule):
    """eos_token_id 2 (the checkpoints before transformers' PR 24773): the highest id of each row; any other: the
    first position holding eos_token_id. On rows where the two rules pick different positions, each model pools
    the position of its own rule, and equals transformers'."""
    ours, theirs = model_pair(make_checkpoint(_fields(case), "text_projection"), "text_projection", "eager")
    eos = ours.config.eos_token_id
    ids = torch.tensor([[7, 300, 500, 9, 500, 3], [511, 4, 5, 500, 6, 8]])
    picked = ids.argmax(-1) if rule == "argmax" else (ids == eos).int().argmax(-1)
    assert picked.tolist() == ([2, 0] if rule == "argmax" else [2, 3])
    with torch.inference_mode():
        out = ours.backbone(input_ids=ids)
        assert torch.equal(out.pooler_output, out.last_hidden_state[torch.arange(2), picked])
        _equal(ours(input_ids=ids), theirs(input_ids=ids), rule)


@pytest.mark.parametrize("case", ["clip-hd24", "siglip-hd24"])
def test_hidden_states_attentions_and_tuples_equal_transformers(case):
    """output_hidden_states and output_attentions (eager) reach both towers' records, as transformers records them
    (each layer's input and output, the last before the final norm); return_dict=False gives the nested tuples."""
    ours, theirs = model_pair(make_checkpoint(_fields(case), "base"), "base", "eager")
    batch = make_batch(ours.config, "base")
    with torch.inference_mode():
        a = ours(**batch, output_hidden_states=True, output_attentions=True)
        b = theirs(**batch, output_hidden_states=True, output_attentions=True)
        layers = ours.config.text.num_hidden_layers
        assert len(b.text_model_output.hidden_states) == layers + 1
        assert len(b.vision_model_output.attentions) == ours.config.vision.num_hidden_layers
        _equal(a, b, case)
        ta, tb = ours(**batch, return_dict=False), theirs(**batch, return_dict=False)
        assert [type(x) for x in ta] == [type(x) for x in tb]
        assert [len(x) for x in ta if isinstance(x, tuple)] == [len(x) for x in tb if isinstance(x, tuple)]
        assert all(torch.equal(x, y) for x, y in zip(ta[:4], tb[:4]))


def test_bad_inputs_and_configs_are_typed_errors_naming_what_is_wrong(tmp_path):
    source = make_checkpoint(_fields("clip-hd24"), "base")
    model = load_model(source)
    batch = make_batch(model.config, "base")
    pixels = batch["pixel_values"]
    cases = [
        ({"pixel_values": pixels[:, :2]}, "pixel_values has 2 channels, the model takes 3"),
        ({"pixel_values": torch.cat([pixels, pixels[:, :1]], 1)}, "pixel_values has 4 channels"),
        ({"pixel_values": pixels.long()}, "pixel_values has dtype torch.int64"),
        ({"pixel_values": pixels[0]}, r"pixel_values has shape \(3, 64, 64\)"),
        ({"pixel_values": pixels.tolist()}, "pixel_values is a list"),
        ({"pixel_values": pixels[..., :8, :8], "interpolate_pos_encoding": True}, "smaller than one 16-pixel patch"),
        ({"pixel_values": torch.cat([pixels, pixels[:1]]), "return_loss": True}, "2 texts .* 3 images"),
        ({"input_ids": batch["input_ids"] + 600}, "outside the vocabulary"),
        ({"position_ids": torch.arange(13)[None] + 20}, "position_ids holds position 32"),
        ({"input_ids": None}, "input_ids is required"),
        ({"pixel_values": None}, "pixel_values is a NoneType"),
    ]
    for change, message in cases:
        with pytest.raises(InputError, match=message):
            model(**{**batch, **change})
    config = json.loads((source / "config.json").read_text())
    for changes, message in [({"text_config": "clip"}, "text_config is a str"),
                             ({"vision_config": {**config["vision_config"], "num_attention_heads": 5}},
                              "vision_config.*num_attention_heads"),
                             ({"text_config": {**config["text_config"], "hidden_act": "swiglu"}},
                              "text_config.*hidden_act")]:
        broken = tmp_path / f"broken-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(source, broken)
        (broken / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(ConfigError, match=message):
            load_model(broken)


@pytest.mark.parametrize("case,task", [("clip-text-hd24", "base"), ("clip-vision-hd24", "vision_projection"),
                                       ("siglip-vision-hd24", "base")])
def test_a_tower_s_file_under_its_old_prefix_loads_and_exports_today_s_keys(case, task, tmp_path):
    """Hub checkpoints of a tower alone hold its keys under ``text_model.`` / ``vision_model.`` (transformers before
    5 nested the tower; 5.25 strips the prefix on load): the file loads, equal to transformers'; save_pretrained
    writes the keys transformers 5.25 writes for a model of its own (no prefix on a bare tower), which it loads back."""
    source = make_checkpoint(_fields(case), task)
    prefix = "text_model." if "text" in case else "vision_model."
    old = tmp_path / "old"
    shutil.copytree(source, old)
    tensors = load_file(str(source / "model.safetensors"))
    if task == "base":
        tensors = {prefix + k: v for k, v in tensors.items()}
    assert all(k.startswith(prefix) or "projection" in k for k in tensors)
    save_file(tensors, str(old / "model.safetensors"), metadata={"format": "pt"})
    ours, theirs = model_pair(old, task, "sdpa")
    batch = make_batch(ours.config, task)
    with torch.inference_mode():
        _equal(ours(**batch), theirs(**batch), case)
    ours.save_pretrained(tmp_path / "ours")
    assert set(load_file(str(tmp_path / "ours" / "model.safetensors"))) == \
        set(load_file(str(source / "model.safetensors")))
    back = reference_model(tmp_path / "ours", task, "sdpa")
    with torch.inference_mode():
        _equal(ours(**batch), back(**batch), f"{case} exported")


LORA = [pytest.param("clip-hd24", ["q_proj", "v_proj"], 4, False, id="clip-hd24-attn-r4"),
        pytest.param("clip-hd24", ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "text_projection",
                                   "visual_projection"], 8, True, id="clip-hd24-all-r8-rslora"),
        # fc1 and fc2 include the attention-pooling head's MLP
        pytest.param("siglip-hd24", ["q_proj", "v_proj", "fc1", "fc2"], 4, False, id="siglip-hd24-r4")]


@pytest.mark.parametrize("case,targets,r,rslora", LORA)
def test_lora_in_and_out_with_peft(case, targets, r, rslora, tmp_path):
    """PEFT has no default LoRA targets for clip or siglip, and neither has flodl-hf (a typed error asking for
    target_modules). With targets named: PEFT's initial draws, an adapter PEFT wrote loading here with equal
    outputs, one training step on the model's own loss with equal gradients, and ours loading back into PEFT."""
    peft = pytest.importorskip("peft")
    for model_type in ("clip", "siglip", "clip_text_model", "siglip_vision_model"):
        with pytest.raises(AdapterError, match="target_modules"):
            lora.default_targets(model_type)
    warnings.simplefilter("ignore")
    source = make_checkpoint(_fields(case), "base")
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, use_rslora=rslora)
    torch.manual_seed(11)
    theirs = peft.get_peft_model(reference_model(source, "base", "eager"), config)
    fresh = load_model(source)
    torch.manual_seed(11)
    lora.add_lora(fresh, r=r, alpha=2 * r, target_modules=targets, use_rslora=rslora)
    inits = {_peft_name(n): p for n, p in theirs.named_parameters() if "lora_" in n}
    assert set(inits) == {n for n, _ in fresh.named_parameters() if "lora_" in n}
    assert all(torch.equal(p, inits[n]) for n, p in fresh.named_parameters() if "lora_" in n)
    _perturb(_peft_trainable(theirs), 1)
    theirs.save_pretrained(str(tmp_path / "from-peft"))
    ours = load_model(source, adapter=tmp_path / "from-peft", attn_implementation="eager")
    batch = {**make_batch(ours.config, "base"), "return_loss": True}
    theirs.eval()
    with torch.no_grad():
        _equal(ours(**batch), theirs(**batch), "from peft")
    ours.train(), theirs.train()
    loss = ours(**batch).loss
    reference = theirs(**batch).loss
    assert torch.equal(loss, reference)
    loss.backward(), reference.backward()
    grads = {_peft_name(n): p.grad for n, p in _peft_trainable(theirs)}
    trainable = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    assert set(trainable) == set(grads) and trainable
    for name, p in trainable.items():
        assert torch.equal(p.grad, grads[name]), name
    with torch.no_grad():
        for p in trainable.values():
            p.sub_(0.5 * p.grad)
    out = lora.save_adapter(ours.eval(), tmp_path / "to-peft")
    back = peft.PeftModel.from_pretrained(reference_model(source, "base", "eager"), str(out)).eval()
    assert set(peft.utils.load_peft_weights(str(out))) == set(peft.utils.get_peft_model_state_dict(back))
    with torch.no_grad():
        _equal(ours(**batch), back(**batch), "to peft")


def test_the_registry_names_transformers_classes():
    """Each model type loads under transformers' class names: AutoModel for the dual models and the towers,
    the projection classes and SigLIP's text tower by their own names (transformers has no Auto class for them)."""
    from flodl_hf.core.registry import get_family, parse_architecture
    names = {"clip": "CLIPModel", "clip_text_model": "CLIPTextModel", "clip_vision_model": "CLIPVisionModel",
             "siglip": "SiglipModel", "siglip_vision_model": "SiglipVisionModel"}
    for model_type, name in names.items():
        assert get_family(model_type).architecture("base") == name and parse_architecture(name)[1] == "base"
    assert parse_architecture("CLIPTextModelWithProjection")[1] == "text_projection"
    assert parse_architecture("CLIPVisionModelWithProjection")[1] == "vision_projection"
    assert parse_architecture("SiglipTextModel") == (get_family("siglip_text_model"), "text_model")
    transformers = quiet_transformers()
    for name in ("CLIPTextModelWithProjection", "CLIPVisionModelWithProjection", "SiglipTextModel"):
        assert hasattr(transformers, name)
    from flodl_hf.auto import AutoModel
    from flodl_hf.families.clip import CLIPModel, CLIPVisionModelWithProjection
    assert type(AutoModel.from_pretrained(make_checkpoint(_fields("clip-hd24"), "base"))) is CLIPModel
    source = make_checkpoint(_fields("clip-vision-hd24"), "vision_projection")
    assert type(CLIPVisionModelWithProjection.from_pretrained(source)) is CLIPVisionModelWithProjection
    assert type(load_model(source)) is CLIPVisionModelWithProjection  # the task from config.json's architectures
