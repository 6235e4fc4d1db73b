"""The error a checkpoint that cannot be served raises, in a module of its own so that what only checks a path
(launch.py's argument parsing) does not import torch with the loader."""


class CheckpointError(RuntimeError):
    pass
