"""The error a checkpoint that cannot be served raises, in a module of its own so that what only checks a path
(launch.py's argument parsing) does not import torch with the loader."""

from pathlib import Path


class CheckpointError(RuntimeError):
    pass


# what a model folder holds, as the errors below ask for one
_FOLDER = "a Hugging Face model folder (config.json, *.safetensors, tokenizer files)"


def folder_problem(model: str) -> str | None:
    """What keeps `model` from being a model folder, said as a user fixes it: it is not there, it is a file, or
    it has no config.json. None for a folder with one."""
    path = Path(model)
    if not path.exists():
        return f"there is no file or folder {model}: give a local {_FOLDER.removeprefix('a ')} or a GGUF file"
    if not path.is_dir():
        return f"{model} is a file: give the Hugging Face model folder that holds it, or a GGUF file (*.gguf)"
    if not (path / "config.json").is_file():
        return f"{model} has no config.json: give {_FOLDER}"
    return None


def check_shape(full, expected: tuple[int, ...], what: str) -> None:
    """A checkpoint tensor of another shape than the model's config makes it would load a wrong slice
    silently, or fail inside a copy with torch's words: CheckpointError naming both shapes."""
    shape = tuple(full.shape)
    if shape != tuple(expected):
        raise CheckpointError(f"its {what} is {list(shape)}, but this model's config makes it {list(expected)}")
