"""The argument dataclass base every architecture's ``ModelArgs`` extends."""

from __future__ import annotations

import inspect
from dataclasses import dataclass


@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict):
        """Build from a config dict, ignoring keys this architecture does not use."""
        names = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in names})
