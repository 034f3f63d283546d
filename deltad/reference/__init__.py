"""The reference programs built on deltad's public API, installed under this name.

In a source checkout they live at the repository's top level: ``trainer/`` (the reference
online trainer, ``deltad.reference.trainer``) and ``consumers/`` (the reference predictors,
``deltad.reference.consumers``); ``pyproject.toml`` maps those folders here, so installing
deltad adds no top-level name but ``deltad``.
"""
