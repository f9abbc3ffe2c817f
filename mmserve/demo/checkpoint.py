"""Where the bundled demo checkpoint lives."""

from __future__ import annotations

from pathlib import Path

# The checkpoint is committed under samples/ beside the package sources (an editable install,
# as README's commands make, keeps it there).
DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "samples" / "demo-model"


def demo_model_path() -> Path:
    """The bundled demo checkpoint, used when no model is given."""
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"no model given and the bundled demo model is not at {DEMO_MODEL_DIR}; pass the "
            "path of a local Hugging Face LLaVA checkpoint directory (or install mmserve from "
            "its source tree with `pip install -e .`).")
    return DEMO_MODEL_DIR
