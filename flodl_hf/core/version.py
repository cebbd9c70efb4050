"""The version of flodl-hf, stamped into what it writes (exports, verify-matrix reports), and the range of torch and
transformers it is tested on."""

from __future__ import annotations

__version__ = "0.4.0"

# The oldest and newest releases the tests pass on (README, "Versions"). CI runs the whole suite on the pinned pair
# (scripts/setup.sh: torch 2.13.0 with the newest transformers) and the parity, loss, generate and LoRA tests
# (marked range_end) on the oldest pair, in a second environment that .ci/run builds.
TESTED_RANGE = {"torch": ("2.6.0", "2.14.1"), "transformers": ("5.24.0", "5.25.0")}


def tested(name: str, installed: str) -> bool:
    """Whether ``installed`` (a version string such as "2.13.0+cpu") lies in the tested range of ``name``."""
    from packaging.version import Version
    low, high = TESTED_RANGE[name]
    return Version(low) <= Version(Version(installed).base_version) <= Version(high)
