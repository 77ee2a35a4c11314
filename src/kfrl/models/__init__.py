"""Model building blocks: the builtin tiny model and HF directory I/O."""
import os
from pathlib import Path


def cache_dir() -> Path:
    """kfrl's per-machine cache (builtin models, downloaded checkpoints): $KFRL_CACHE_DIR or ~/.cache/kfrl."""
    return Path(os.environ.get("KFRL_CACHE_DIR") or Path.home() / ".cache" / "kfrl").expanduser()
