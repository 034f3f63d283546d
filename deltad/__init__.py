"""deltad: streams fresh embedding rows from an online TorchRec trainer to many predictors."""

__version__ = "0.1.0"
