"""``sync="fsdp"``: the model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``), and its sharded
checkpoints (``torch.distributed.checkpoint``).

Sharding. Every layer (the elements of the model's outermost ``nn.ModuleList`` s: the encoder or decoder
layers) is one FSDP unit, and the root another that holds the rest (embeddings, final norm, head). Each worker
keeps ``1/world`` of every parameter (dim 0, padded), its gradient and its optimizer state; a unit's parameters
are all-gathered before its forward and backward and freed after, and its gradients reduce-scattered (averaged,
as DDP's all-reduce averages them). ``precision="bf16"`` becomes FSDP's ``MixedPrecisionPolicy``: parameters
all-gathered in bfloat16, gradients reduced in float32, the shards and the optimizer float32.

Checkpoints. Each worker writes its own shard of the model and the optimizer state into
``step-XXXXXXXX.dcp/`` (``torch.distributed.checkpoint``, the ``"model"`` and ``"optimizer"`` entries);
worker 0's main file then commits the set (:mod:`flodl_hf.training.checkpoints`). A resume reads the shards
into the sharded model on any number of workers (DCP reshards); ``flodl-hf export --checkpoint`` reads the
full tensors on one CPU process (:mod:`flodl_hf.core.sharded_checkpoint`).
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from flodl_hf.core.errors import TrainerConfigError
from flodl_hf.core.sharded_checkpoint import MODEL, OPTIMIZER

__all__ = ["shard_model", "layer_units", "local_bytes", "no_gradient_sync", "save_shards", "load_shards",
           "full_state_dict", "refuse_replicas"]


def refuse_replicas(other: str) -> TrainerConfigError:
    """The error for ``sync="fsdp"`` with a sync that keeps a full replica on every worker (``other``)."""
    return TrainerConfigError(f"sync='fsdp' does not go with {other}: FSDP keeps 1/world of the model on each "
                              "worker, and El Che's windows and DiLoCo's outer step average full replicas of it; use "
                              "sync='fsdp' alone, or sync='el-che' with a model that fits each worker")


def layer_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as units of their own: the elements of the outermost ``nn.ModuleList`` s (the encoder or
    decoder layers; a mixture of experts' expert list lies inside its layer, which is the unit), each once (a layer
    shared by several positions, as ALBERT's, is one unit)."""
    lists = [m for name, m in model.named_modules() if isinstance(m, nn.ModuleList)
             and not any(isinstance(model.get_submodule(".".join(name.split(".")[:i])), nn.ModuleList)
                         for i in range(1, name.count(".") + 1))]
    seen: dict[int, nn.Module] = {}
    for modules in lists:
        for layer in modules:
            if any(p.numel() for p in layer.parameters()):
                seen.setdefault(id(layer), layer)
    return list(seen.values())


def shard_model(model: nn.Module, device: torch.device, world: int, precision: str | None) -> list[nn.Module]:
    """Shard ``model`` in place over the default process group's ``world`` workers: each layer, then the root.
    Every worker must hold the same weights first (the trainer broadcasts worker 0's). Returns the layers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    layers = layer_units(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # A parameter this worker's batch left without a gradient (an expert no token was routed to) joins the
    # reduce-scatter with zeros, so that every worker reduces the same tensors (and the others' gradients are
    # averaged with this worker's zero, as DDP's find_unused_parameters does).
    model.set_reduce_scatter_unused_params(True)
    return layers


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this worker holds of the parameters, their gradients and the optimizer's state (the local shards
    of a sharded model; the whole tensors of a replica)."""
    params = list(model.parameters())
    out = {"parameters": sum(_local(p).nbytes for p in params),
           "gradients": sum(_local(p.grad).nbytes for p in params if p.grad is not None), "optimizer": 0}
    if optimizer is not None:
        out["optimizer"] = sum(_local(v).nbytes for state in optimizer.state.values() for v in state.values()
                               if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Backward without the gradients' reduce-scatter (the first micro-batches of an accumulated step): the
    unsharded gradients accumulate, and the last micro-batch's backward reduces their sum once."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _model_keys(model: nn.Module, adapter_only: bool) -> set[str] | None:
    """The model entries a checkpoint holds: the adapter's trainable tensors where the base is on disk (LoRA,
    as the unsharded checkpoint saves them), else every entry (None)."""
    if not adapter_only:
        return None
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _states(model: nn.Module, optimizer: torch.optim.Optimizer, adapter_only: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(model, optimizer)
    keys = _model_keys(model, adapter_only)
    if keys is not None:
        model_state = {k: v for k, v in model_state.items() if k in keys}
    return {MODEL: model_state, OPTIMIZER: optim_state}


def save_shards(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, adapter_only: bool) -> None:
    """Every worker writes its shards of the model and the optimizer state into ``directory`` (a fresh one:
    what a killed write left there is removed by worker 0 before the workers meet)."""
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():  # one worker: "assuming the intent is to save in a single process", it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_states(model, optimizer, adapter_only), checkpoint_id=str(directory))


def clear_shards(directory: Path) -> None:
    """Remove a shard directory (a rotated checkpoint's, or what a killed write left)."""
    if directory.is_dir() and not directory.is_symlink():
        shutil.rmtree(directory)


def load_shards(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, adapter_only: bool) -> None:
    """Read ``directory``'s shards into the sharded ``model`` and ``optimizer``, on any number of workers (DCP
    reads each worker's part of every tensor from whichever files hold it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from flodl_hf.core.sharded_checkpoint import SafeReader
    states = _states(model, optimizer, adapter_only)
    with warnings.catch_warnings():  # one worker: "assuming the intent is to load in a single process", it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(states, storage_reader=SafeReader(directory))
    set_state_dict(model, optimizer, model_state_dict=states[MODEL], optim_state_dict=states[OPTIMIZER],
                   options=StateDictOptions(strict=not adapter_only))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole tensors of a (sharded) model's state_dict, on the CPU, on every worker (a collective: every
    worker calls it)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in model.state_dict().items()}
