"""Request keys that are none of a model's fields: one that is nearly a field (max_token, temprature) is a 400
naming it and the field it nearly is, since ignored it would leave the request quietly not what was meant;
others (another server's fields, ones that change nothing) are ignored as OpenAI-compatible servers ignore
them, each logged once."""

from __future__ import annotations

import difflib
import functools
import logging
from typing import Any

from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError

log = logging.getLogger(__name__)

# how alike an unknown key and a field must be (difflib's ratio) to take the key for the field misspelled:
# "max_token", "temprature" and "top_logprob" are (0.95), TGI's "max_new_tokens" against "max_tokens" is not (0.83);
# and a misspelling starts as the field does and is at most two characters longer or shorter
_MISSPELLED = 0.85
_LENGTH_APART = 2
# other servers' fields that pass for a misspelling of one here: OpenRouter's fallback `models`, llama.cpp's
# `reasoning_format`; ignored as other unknown keys are
FOREIGN_FIELDS = frozenset({"models", "mode", "reasoning_format"})
_logged: set[tuple[str, str]] = set()


@functools.cache
def _field_names(cls: type[BaseModel]) -> tuple[str, ...]:
    names = set(cls.model_fields)
    names.update(f.alias for f in cls.model_fields.values() if f.alias)
    return tuple(sorted(names))


def _misspelled(key: str, known: tuple[str, ...]) -> list[str]:
    """The field `key` looks like a misspelling of, if one."""
    near = [f for f in known if f[:1] == key[:1] and abs(len(f) - len(key)) <= _LENGTH_APART]
    return difflib.get_close_matches(key, near, n=1, cutoff=_MISSPELLED)


def _log_ignored(model: str, key: str) -> None:
    if (model, key) not in _logged and len(_logged) < 1_000:  # a client sending random keys logs a bounded set
        _logged.add((model, key))
        log.info("%s: the field %r is not one this server reads; ignored", model, key[:100])


class KnownFields(BaseModel):
    """A request model whose misspelled keys are refused (see the module)."""

    @model_validator(mode="before")
    @classmethod
    def _misspelled_fields(cls, data: Any) -> Any:
        """A key that is none of this model's fields but nearly one (max_token, temprature) is a 400 naming
        it, with the field it nearly is: ignored, it would leave the request quietly not what was meant.
        Other unknown keys (another server's fields, ones that change nothing) are ignored, each logged
        once."""
        if isinstance(data, dict):
            known = _field_names(cls)
            for key in data:
                if isinstance(key, str) and key not in known:
                    close = [] if key in FOREIGN_FIELDS else _misspelled(key, known)
                    if close:
                        raise PydanticCustomError(
                            "misspelled_field",
                            "is not a field here: did you mean {meant}?",
                            {"field": key, "meant": close[0]},
                        )
                    _log_ignored(cls.__name__, key)
        return data
