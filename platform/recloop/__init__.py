"""recloop: continuous retraining for GPU deep-learning recommenders.

The package is organized one concept per module (see ARCHITECTURE.md): ``settings`` (where things
live), ``schema`` (dataset specs), ``simulate`` (the synthetic world), ``ingest`` (landing files into
the lake), and ``cli`` (the ``recloop`` command).
"""

__version__ = "0.1.0"
