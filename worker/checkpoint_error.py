"""The error a checkpoint that cannot be served raises, in a module of its own so that what only checks a path
(launch.py's argument parsing) does not import torch with the loader."""


class CheckpointError(RuntimeError):
    pass


def check_shape(full, expected: tuple[int, ...], what: str) -> None:
    """A checkpoint tensor of another shape than the model's config makes it would load a wrong slice
    silently, or fail inside a copy with torch's words: CheckpointError naming both shapes."""
    shape = tuple(full.shape)
    if shape != tuple(expected):
        raise CheckpointError(f"its {what} is {list(shape)}, but this model's config makes it {list(expected)}")
