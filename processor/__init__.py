"""eosflow's engine: public API, graph compilation, task runtime, checkpoints, runners, CLI."""

__version__ = "0.1.0.dev0"

__all__ = ["__version__"]
