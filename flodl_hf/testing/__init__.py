"""Test helpers that ship with flodl-hf: :mod:`flodl_hf.testing.netns` turns one machine into N hosts."""
