"""The version of flodl-hf, stamped into what it writes (exports, verify-matrix reports)."""

__version__ = "0.1.0"
