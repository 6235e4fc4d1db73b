"""What can be known of a model folder before anything starts, checked in the order a user fixes
things: the folder, its config.json, the architecture, the weights, the tokenizer. Each problem is one
ModelFolderError whose message says what is wrong and what to change."""

from __future__ import annotations

import json
from pathlib import Path

from worker.checkpoint_error import folder_problem


class ModelFolderError(ValueError):
    pass


# the files a tokenizer is made from (any one set): tokenizer_config.json alone only configures one
_TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def check_model_folder(model: str, *, load_format: str = "auto", need_tokenizer: bool = True) -> None:
    if (problem := folder_problem(model)) is not None:
        raise ModelFolderError(problem)
    path = Path(model)
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"{config_file} cannot be read as JSON: {e}") from e
    from worker.models import MODELS, SERVED_ARCHITECTURES

    archs = config.get("architectures") or []
    if isinstance(archs, str):
        raise ModelFolderError(f'{config_file}: "architectures" is a list of names: write ["{archs}"]')
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelFolderError(f'{config_file}: "architectures" is a list of names, not {json.dumps(archs)}')
    if not any(a in MODELS for a in archs):
        raise ModelFolderError(
            f"{model} is a {', '.join(archs) or config.get('model_type', 'model of no named architecture')}"
            f", which this server does not run; it runs {', '.join(SERVED_ARCHITECTURES)}"
        )
    if load_format == "auto":
        _check_weights(path)
    if need_tokenizer and not any(all((path / f).exists() for f in files) for files in _TOKENIZER_FILES):
        raise ModelFolderError(
            f"{model} has no tokenizer files ({' or '.join(' with '.join(files) for files in _TOKENIZER_FILES)}); "
            "the HTTP server needs one to read prompts"
        )


def _check_weights(path: Path) -> None:
    from safetensors import safe_open

    from worker.loader import CheckpointError, safetensors_files

    if not any(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").exists():
        hint = " (only *.safetensors weights are read: convert the *.bin ones)" if any(path.glob("*.bin")) else ""
        raise ModelFolderError(f"{path} has no *.safetensors weights{hint}; --load-format dummy runs on random ones")
    try:
        files = safetensors_files(path)
    except CheckpointError as e:
        raise ModelFolderError(str(e)) from e
    for file in files:
        try:
            with safe_open(str(file), framework="pt"):  # reads the header, which must cover the whole file
                pass
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            raise ModelFolderError(
                f"{file} is not a whole safetensors file (truncated or damaged: {e}); download it again"
            ) from e
