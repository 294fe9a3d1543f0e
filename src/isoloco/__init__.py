"""isoloco: low-communication distributed training where synchronisation is a model merge."""

__version__ = "0.2.0"
