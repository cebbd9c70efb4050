"""The ``train`` command: launch a training script on local workers (``flodl_hf.training.launch.launch``)."""

from __future__ import annotations

import argparse

from flodl_hf.training.launch import launch


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="run a training script on N workers per node (torchrun)",
                              description="Launch SCRIPT as N processes per node through torchrun (one node: standalone; several: "
                                          "c10d rendezvous on node 0, see docs/trainer.md). "
                                          "The script builds a Trainer; it finds the process group on its own.")
    p.add_argument("--workers", type=int, default=1, help="number of worker processes (default 1)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart all workers this many times after a failure; they resume from the last checkpoint")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (hosts); default 1: this machine only")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank in [0, --nnodes)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0, which hosts the rendezvous store")
    p.add_argument("--local-addr", default=None, help="the address other nodes reach this node at")
    p.add_argument("--store-timeout", type=float, default=15.0,
                   help="seconds each rendezvous-store call may take before torchrun gives up (default 15)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    return launch(args.script, args.script_args, workers=args.workers, max_restarts=args.max_restarts,
                  nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                  local_addr=args.local_addr, store_timeout=args.store_timeout)
