"""Stand-in for verl.checkpoint_engine.base (tests/verl/standin/README.md)."""


class CheckpointEngine:
    """verl's base class of checkpoint engines."""


class CheckpointEngineRegistry:
    _registry: dict = {}

    def register(backend: str):  # verl's: a plain function in the class body
        def wrapper(cls):
            CheckpointEngineRegistry._registry[backend] = cls
            return cls

        return wrapper

    @classmethod
    def get(cls, backend: str):
        if backend not in cls._registry:
            raise ValueError(f"Checkpoint engine {backend} not registered, registered: {sorted(cls._registry)}")
        return cls._registry[backend]

    @classmethod
    def new(cls, backend: str, *args, **kwargs):
        return cls.get(backend)(*args, **kwargs)
