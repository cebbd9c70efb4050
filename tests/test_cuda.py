"""CUDA: parity against transformers on the GPU and a mixed GPU + CPU cohort. Skipped without a GPU.

The full check of a CUDA machine (every family, forward ratio, El Che over NCCL) is
``scripts/gpu_check.py``; these are the few cases the suite runs where a GPU exists.
"""

from __future__ import annotations

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.parity import compare_outputs, make_batch, reference_model

from helpers import make_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SMALL = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 64}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_bert_on_cuda_matches_transformers_on_cuda(impl):
    source = make_checkpoint(SMALL, "seqcls")
    ours = load_model(source, "seqcls", dtype=torch.float32, attn_implementation=impl).cuda().eval()
    theirs = reference_model(source, "seqcls", impl).cuda()
    batch = {k: v.cuda() for k, v in make_batch(ours.config, "seqcls").items()}
    with torch.inference_mode():
        diffs, _ = compare_outputs(ours(**batch), theirs(**batch), ["logits"])
    # The same kernels on both sides give 0; a different cuBLAS or attention kernel choice stays tiny.
    assert diffs["logits"] < 1e-4, diffs


def test_training_step_on_cuda_matches_transformers():
    source = make_checkpoint(SMALL, "seqcls")
    grads = []
    for model in (load_model(source, "seqcls", dtype=torch.float32, attn_implementation="eager"),
                  reference_model(source, "seqcls", "eager")):
        model = model.cuda().train()
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        batch = {k: v.cuda() for k, v in make_batch(model.config, "seqcls").items()}
        model(**batch, labels=torch.tensor([0, 1], device="cuda")).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    common = set(grads[0]) & set(grads[1])
    assert common and max((grads[0][n] - grads[1][n]).abs().max().item() for n in common) < 1e-4
