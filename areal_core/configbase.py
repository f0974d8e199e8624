"""Base class for typed config sections: unknown keys and wrong types are errors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. Strict: no unknown keys, no silent str->number coercion."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=False, validate_assignment=True)
