"""AttrDict: a dict whose keys are also attributes, built recursively from a plain config."""

from typing import Any


class AttrDict(dict):
    """``cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA`` and ``cfg["DATA"]["TRAIN"][...]`` both work."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for key, value in list(self.items()):
            self[key] = self._wrap(value)

    @classmethod
    def _wrap(cls, value: Any) -> Any:
        if isinstance(value, AttrDict):
            return value
        if isinstance(value, dict):
            return cls(value)
        if isinstance(value, (list, tuple)):
            return type(value)(cls._wrap(v) for v in value)
        return value

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"config has no key {key!r}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = self._wrap(value)

    def __delattr__(self, key: str) -> None:
        del self[key]

    def to_dict(self) -> dict:
        """A plain nested dict/list copy (for yaml dumps and checkpoints)."""

        def plain(v: Any) -> Any:
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            return v

        return plain(self)
