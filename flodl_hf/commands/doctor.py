"""``flodl-hf doctor``: this machine's CPU, BLAS and threads; the shortcut's verdicts; a parity self-test."""

from __future__ import annotations

import argparse
import json


def run(args: argparse.Namespace) -> int:
    from flodl_hf.roundtrip.doctor import doctor
    report = doctor(parity=not args.no_parity)
    if args.json:
        print(json.dumps({"machine": report.machine, "proofs": report.proofs, "parity": report.parity,
                          "exact": report.exact, "seconds": round(report.seconds, 2)}, indent=2))
    else:
        print(report.format())
    return 0 if report.exact or args.no_parity else 1


def register_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="is this machine exact? CPU, BLAS, threads, shortcut proofs, parity self-test")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-parity", action="store_true", help="skip the parity self-test (machine and proofs only)")
    p.set_defaults(func=run)
