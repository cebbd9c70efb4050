"""PEFT's ``trainable_token_indices`` (selected embedding rows trained alongside LoRA), both ways with the real
peft in the same run: BERT MLM (its decoder tied to the word embeddings, with a bias), BERT sequence
classification (head dim 24 and real width, hidden 768 with 12 heads of 64) and a LLaMA causal LM with tied
embeddings, and Gemma's scaled embeddings; the list form (the input embeddings) and the object form ({module name: ids}). Each case:
init equal to peft's, peft's adapter in (outputs torch.equal), one training step (loss and every gradient,
the delta's included, torch.equal; the embedding matrix gets none), ours out (peft loads it with no missing or
unexpected key, outputs equal, and peft's own save of it is our file, key for key and bit for bit), and merged
(merge_and_unload: the same weights and outputs as peft's)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")

from safetensors.torch import load_file

from flodl_hf import lora
from flodl_hf.auto import AutoConfig, load_model
from flodl_hf.core.errors import AdapterError, UnsupportedAdapterError
from flodl_hf.roundtrip.parity import make_batch, reference_model

from cases import CASES
from helpers import make_checkpoint, one_thread  # noqa: F401 (a fixture)
from test_lora import _peft_name, _peft_trainable, assert_step_equal_to_peft

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA_TIED = "llama-hd24-bias-tied-llama3-causal_lm"
GEMMA = "gemma-hd24-scaled-bias-causal_lm"   # a scaled embedding (times sqrt(hidden)), tied lm_head
TARGETS = {"bert": ["query", "value"], "llama": ["q_proj", "v_proj"], "gemma": ["q_proj", "v_proj"],
           "gptj": ["q_proj", "v_proj"]}
EMBEDDINGS = {"bert": "word_embeddings", "llama": "embed_tokens", "gemma": "embed_tokens", "gptj": "wte"}


def _case(case_id: str):
    task, fields = next((t, f) for c, t, f in CASES if c == case_id)
    return task, fields


def _ids(batch: dict, vocab: int) -> list[int]:
    """Two ids that occur in the batch (so their rows get gradients through the lookup), unsorted, and the last
    id of the vocabulary (which does not: only a tied output layer gives it a gradient)."""
    seen = batch["input_ids"][0, 1:3].tolist()
    assert vocab - 1 not in seen
    return [seen[1], seen[0], vocab - 1]


def _equal_logits(ours, theirs, batch) -> None:
    with torch.no_grad():
        a, b = ours(**batch).logits, theirs(**batch).logits
    assert torch.equal(a, b), f"max abs diff {(a - b).abs().max().item()}"


ROWS = [
    pytest.param("bert-hd24-mlm", "list", id="bert-hd24-mlm-tied-decoder"),
    pytest.param("bert-hd24-seqcls", "list", id="bert-hd24-seqcls"),
    pytest.param("bert-hd24-seqcls", "dict", id="bert-hd24-seqcls-dict"),
    pytest.param("bert-768-seqcls", "list", id="bert-768-seqcls"),
    pytest.param(LLAMA_TIED, "list", id="llama-hd24-causal_lm-tied"),
    pytest.param(LLAMA_TIED, "dict", id="llama-hd24-causal_lm-tied-dict"),
    pytest.param(GEMMA, "list", id="gemma-hd24-causal_lm-scaled-tied"),
    # an untied output layer named in the object: a delta of its own (GPT-J's lm_head has a bias, which PEFT's
    # wrapped forward leaves out while unmerged); and both layers of an untied LLaMA, each with its own delta
    pytest.param("gptj-hd24-causal_lm", "output", id="gptj-hd24-causal_lm-untied-output"),
    pytest.param("llama-1024-gqa-causal_lm", "both", id="llama-1024-causal_lm-untied-both"),
]


@pytest.mark.parametrize("case_id,form", ROWS)
def test_trainable_tokens_round_trip_with_peft(case_id, form, tmp_path):
    warnings.simplefilter("ignore")
    task, fields = _case(case_id)
    family = fields["model_type"]
    source = make_checkpoint(fields, task)
    config = AutoConfig.from_pretrained(source)
    batch = make_batch(config, task)
    ids = _ids(batch, config.vocab_size)
    tokens = {"list": ids, "dict": {EMBEDDINGS[family]: ids}, "output": {"lm_head": ids},
              "both": {EMBEDDINGS[family]: ids, "lm_head": ids[:2]}}[form]
    task_type = lora.PEFT_TASK_TYPES.get(task, "CAUSAL_LM" if task == "causal_lm" else None)
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family], task_type=task_type,
                                  trainable_token_indices=tokens)

    # Init: the same seed gives peft's LoRA A and a delta equal to the chosen rows.
    torch.manual_seed(11)
    theirs = peft.get_peft_model(reference_model(source, task, "eager"), peft_config)
    fresh = load_model(source, task)
    torch.manual_seed(11)
    lora.add_lora(fresh, r=4, alpha=8, target_modules=TARGETS[family], trainable_token_indices=tokens)
    inits = {_peft_name(n): p for n, p in theirs.named_parameters() if p.requires_grad}
    mine = {n: p for n, p in fresh.named_parameters() if p.requires_grad}
    assert set(mine) == set(inits)
    deltas = [n for n in mine if n.endswith(".trainable_tokens_delta")]
    assert len(deltas) == (2 if form == "both" else 1) and mine[deltas[0]].shape == (3, config.hidden_size)
    assert all(torch.equal(p, inits[n]) for n, p in mine.items())

    # In: peft's adapter (perturbed, saved) loads here; outputs equal in eval mode.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in _peft_trainable(theirs):
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    theirs.save_pretrained(str(tmp_path / "from-peft"))
    ours = load_model(source, task, adapter=tmp_path / "from-peft")
    ours.set_attn_implementation("eager")
    assert ours.lora_config.trainable_token_indices == tokens
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == {_peft_name(n) for n, _ in
                                                                          _peft_trainable(theirs)}
    theirs.eval(), ours.eval()
    _equal_logits(ours, theirs, batch)

    # One training step: loss and every gradient equal (the delta's: its rows only); the embedding gets none.
    assert_step_equal_to_peft(ours, theirs, task, batch)
    delta = dict(ours.named_parameters())[deltas[0]]
    assert (delta.grad[:2] != 0).any(dim=1).all(), "the rows in the batch get gradients"
    with torch.no_grad():
        for p in ours.parameters():
            if p.requires_grad:
                p.sub_(0.5 * p.grad)
    wrapped = deltas[0].replace("trainable_tokens_delta", "weight")  # the (first) layer whose rows train
    before = dict(load_model(source, task).named_parameters())[wrapped]
    assert torch.equal(dict(ours.named_parameters())[wrapped], before), "the matrix itself stays frozen"

    # Out: peft loads our directory (no missing or unexpected key), outputs equal, and peft's own save of it is
    # our file bit for bit and our config's trainable_token_indices.
    ours.eval()
    out = lora.save_adapter(ours, tmp_path / "to-peft")
    written = json.loads((out / lora.ADAPTER_CONFIG).read_text())
    assert written["trainable_token_indices"] == tokens
    back = peft.PeftModel.from_pretrained(reference_model(source, task, "eager"), str(out)).eval()
    assert back.peft_config["default"].trainable_token_indices == tokens
    assert set(peft.utils.load_peft_weights(str(out))) == set(peft.utils.get_peft_model_state_dict(back))
    _equal_logits(ours, back, batch)
    back.save_pretrained(str(tmp_path / "peft-again"))
    mine_file = load_file(str(out / lora.ADAPTER_WEIGHTS))
    theirs_file = load_file(str(tmp_path / "peft-again" / lora.ADAPTER_WEIGHTS))
    assert sorted(mine_file) == sorted(theirs_file)
    assert any(k.endswith(".token_adapter.trainable_tokens_delta") for k in mine_file)
    for key, tensor in theirs_file.items():
        assert mine_file[key].dtype == tensor.dtype and torch.equal(mine_file[key], tensor), key
    again = json.loads((tmp_path / "peft-again" / lora.ADAPTER_CONFIG).read_text())
    assert again["trainable_token_indices"] == written["trainable_token_indices"]

    # Merged: the rows written into the (tied) embedding matrix, as peft's merge_and_unload writes them.
    with torch.no_grad():
        merged_theirs = back.merge_and_unload()
        merged_ours = lora.merge_and_unload(ours)
        assert not lora.token_layers(merged_ours)
        hf = dict(merged_theirs.state_dict())
        for key, tensor in merged_ours.state_dict().items():
            assert torch.equal(tensor, hf[key]), key
        assert not torch.equal(merged_ours.state_dict()[wrapped], before)
        _equal_logits(merged_ours, merged_theirs, batch)


def test_tied_output_layer_follows_the_rows_and_merge_unmerge_round_trip():
    """The tied lm_head reads the same replaced rows (PEFT's tied adapter); merge writes them into the shared
    matrix and unmerge puts the originals back, bit for bit."""
    warnings.simplefilter("ignore")
    task, fields = _case(LLAMA_TIED)
    model = load_model(make_checkpoint(fields, task), task).eval()
    original = model.get_input_embeddings().weight.detach().clone()
    lora.add_lora(model, r=4, target_modules=["q_proj"], trainable_token_indices=[3, 9])
    head = model.get_output_embeddings()
    assert isinstance(head, lora.TiedTrainableTokensLinear) and head.weight is model.get_input_embeddings().weight
    delta = model.model.embed_tokens.trainable_tokens_delta
    with torch.no_grad():
        delta.add_(1.0)
    hidden = torch.randn(2, fields["hidden_size"])
    replaced = model.get_input_embeddings().weight.detach().clone()
    replaced[[3, 9]] = delta.detach()
    assert torch.equal(head(hidden), torch.nn.functional.linear(hidden, replaced))
    assert torch.equal(model.get_input_embeddings()(torch.tensor([9, 1])), replaced[[9, 1]])
    lora.merge(model)
    assert torch.equal(model.get_input_embeddings().weight[[3, 9]], delta)
    lora.unmerge(model)
    assert torch.equal(model.get_input_embeddings().weight, original)


@pytest.mark.parametrize("tokens,error,match", [
    pytest.param([1, 512], AdapterError, r"trainable_token_indices holds token ids \[512\] out of the vocabulary",
                 id="out-of-vocab"),
    pytest.param([1, -2], AdapterError, "'trainable_token_indices' holds negative token ids", id="negative"),
    pytest.param([4, 4], AdapterError, "'trainable_token_indices' lists token ids \\[4\\] more than once",
                 id="duplicate"),
    pytest.param([], AdapterError, "'trainable_token_indices' is an empty list", id="empty"),
    pytest.param(["a"], AdapterError, "'trainable_token_indices' is", id="not-ints"),
    pytest.param({"nothing_here": [1]}, AdapterError, "trainable_token_indices -> 'nothing_here' matches no module",
                 id="no-module"),
    pytest.param({"decoder": [1]}, UnsupportedAdapterError, "trainable_token_indices targets cls.predictions.decoder",
                 id="output-layer"),
])
def test_bad_trainable_token_indices_are_typed_errors_naming_the_field(tokens, error, match):
    task, fields = _case("bert-hd24-mlm")
    model = load_model(make_checkpoint(fields, task), task)
    with pytest.raises(error, match=match):
        lora.add_lora(model, r=4, target_modules=["query"], trainable_token_indices=tokens)
    assert not lora.is_lora(model) and not lora.token_layers(model)


def test_a_module_to_save_cannot_also_train_rows():
    task, fields = _case("bert-hd24-seqcls")
    model = load_model(make_checkpoint(fields, task), task)
    with pytest.raises(AdapterError, match="trainable_token_indices targets bert.embeddings.word_embeddings, which "
                                           "is a module to save"):
        lora.add_lora(model, r=4, target_modules=["query"], modules_to_save=["word_embeddings"],
                      trainable_token_indices=[1])


def test_an_adapter_file_with_an_id_out_of_the_vocabulary_names_the_file_and_field(tmp_path):
    warnings.simplefilter("ignore")
    task, fields = _case("bert-hd24-seqcls")
    source = make_checkpoint(fields, task)
    theirs = peft.get_peft_model(reference_model(source, task, "eager"), peft.LoraConfig(
        r=4, target_modules=["query"], task_type="SEQ_CLS", trainable_token_indices=[1, 2]))
    theirs.save_pretrained(str(tmp_path))
    path = tmp_path / lora.ADAPTER_CONFIG
    data = json.loads(path.read_text())
    data["trainable_token_indices"] = [1, 4096]
    path.write_text(json.dumps(data))
    model = load_model(source, task)
    with pytest.raises(AdapterError, match=r"adapter_config.json: trainable_token_indices holds token ids \[4096\]"):
        lora.load_adapter(model, tmp_path)
    assert not lora.is_lora(model)
    data["trainable_token_indices"] = {"word_embeddings": "1"}
    path.write_text(json.dumps(data))
    with pytest.raises(AdapterError, match="adapter_config.json: field 'trainable_token_indices' is"):
        lora.load_adapter(model, tmp_path)


def test_trainer_checkpoint_exports_the_rows_as_peft_reads_them(tmp_path):
    """Through the trainer: the checkpoint holds the delta (not the embedding matrix), exports as a PEFT adapter
    that peft loads with outputs equal to ours, and merged as a directory that verify-export passes."""
    warnings.simplefilter("ignore")
    from flodl_hf.cli import main
    from flodl_hf.training.checkpoints import latest_checkpoint, load_checkpoint
    from flodl_hf.training.trainer import Trainer
    from flodl_hf.roundtrip.verify import verify_export
    task, fields = _case("bert-hd24-seqcls")
    source = make_checkpoint(fields, task)
    model = load_model(source, task)
    torch.manual_seed(0)
    lora.add_lora(model, r=4, alpha=8, target_modules=["query", "value"], trainable_token_indices=[5, 17, 3])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 24, (16, 10), generator=gen)  # the chosen ids occur
    labels = torch.randint(0, fields["num_labels"], (16,), generator=gen)
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(10, dtype=torch.long), "labels": labels[i]}
            for i in range(16)]
    Trainer(model, lambda m, b: m(**b), lambda ps: torch.optim.AdamW(ps, lr=1e-2), data, batch_size=4,
            max_steps=4, sync="none", seed=2, checkpoint_dir=tmp_path / "run", progress=False, report=False).fit()
    final = latest_checkpoint(tmp_path / "run")
    state = load_checkpoint(final)
    assert "bert.embeddings.word_embeddings.trainable_tokens_delta" in state["model"]
    assert "bert.embeddings.word_embeddings.weight" not in state["model"]
    assert main(["export", "--checkpoint", str(final), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    theirs = peft.PeftModel.from_pretrained(reference_model(source, task, "sdpa"), str(tmp_path / "adapter"))
    assert set(peft.utils.load_peft_weights(str(tmp_path / "adapter"))) == set(
        peft.utils.get_peft_model_state_dict(theirs))
    batch = make_batch(model.config, task)
    _equal_logits(model.eval(), theirs.eval(), batch)
    assert main(["verify-export", str(tmp_path / "adapter")]) == 0
    assert main(["export", "--checkpoint", str(final), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = verify_export(tmp_path / "merged")
    assert merged.ok, merged.format_table()


def test_bfloat16_base_keeps_a_float32_delta_as_peft(tmp_path):
    """PEFT's cast_adapter_dtype upcasts the delta on a bfloat16 base; it is cast to the weight's dtype in the
    forward: outputs and files equal."""
    warnings.simplefilter("ignore")
    from helpers import model_pair
    task, fields = _case(LLAMA_TIED)
    source = make_checkpoint(fields, task)
    ours, reference = model_pair(source, task, "eager", torch.bfloat16)
    theirs = peft.get_peft_model(reference, peft.LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM",
                                                            trainable_token_indices=[1, 5]))
    with torch.no_grad():
        for _, p in _peft_trainable(theirs):
            p.add_(0.25)
    theirs.save_pretrained(str(tmp_path / "in"))
    lora.load_adapter(ours, tmp_path / "in")
    assert ours.model.embed_tokens.trainable_tokens_delta.dtype == torch.float32
    _equal_logits(ours.eval(), theirs.eval(), make_batch(ours.config, task))
    lora.save_adapter(ours, tmp_path / "out")
    a, b = (load_file(str(tmp_path / d / lora.ADAPTER_WEIGHTS)) for d in ("in", "out"))
    assert sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
