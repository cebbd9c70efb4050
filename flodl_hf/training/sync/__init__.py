"""The averaging plane and the synchronisation policies the trainer runs on it.

Everything here sits on ``torch.distributed``: gloo on CPU, NCCL between GPUs, and a
gloo group for averaging when a cohort mixes CPU and GPU workers. There is no transport
of our own. Two pure functions hold El Che's arithmetic (:func:`plan_window`, :func:`deal`)
so they can be tested without processes; :class:`Comm` wraps the few collectives the
trainer needs and turns a dead or silent peer into a :class:`WorkerLostError`.

The policies and their arithmetic are in :mod:`flodl_hf.training.sync.policies`, the process
groups and collectives in :mod:`flodl_hf.training.sync.comm`, and the packing of parameters into
the collectives' buffers in :mod:`flodl_hf.training.sync.packing`.
"""

from flodl_hf.core.errors import TrainerConfigError, TrainerError, WorkerLostError
from flodl_hf.training.sync.choice import Cadence, ElChe, Link, choose, ms_text, settle_windows
from flodl_hf.training.sync.comm import Comm, Heartbeat, LeadGradients, PendingWindow, default_backend, resolve_device
from flodl_hf.training.sync.packing import blocks
from flodl_hf.training.sync.policies import (NEST_GAP, PROBE_MAX_WORLD, DiLoCo, OuterOptimizer, Plan, deal,
                                             inner_candidates, live_overrun_ms, nest_tiers, plan_window, probe_tiers,
                                             rounding_wait, split_by_speed)

__all__ = ["ElChe", "Cadence", "Link", "choose", "settle_windows", "ms_text", "DiLoCo", "Plan", "plan_window",
           "live_overrun_ms", "NEST_GAP", "nest_tiers", "probe_tiers", "PROBE_MAX_WORLD", "inner_candidates",
           "rounding_wait", "split_by_speed", "deal", "OuterOptimizer", "Comm", "LeadGradients", "Heartbeat",
           "PendingWindow", "default_backend", "resolve_device", "blocks", "TrainerError", "TrainerConfigError",
           "WorkerLostError"]
