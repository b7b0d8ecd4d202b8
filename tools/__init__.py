"""torch_mla's maintained tools, run from the repository root as ``python -m tools.NAME``."""
