"""recloop: continuous retraining for GPU deep-learning recommenders.

One concept per module; the map of modules and of the data flowing between them is ARCHITECTURE.md at
the top of the checkout.
"""

__version__ = "0.1.0"
