"""recloop: continuous retraining for GPU deep-learning recommenders.

One concept per module; the map of modules and of the data flowing between them is ARCHITECTURE.md at
the top of the checkout.
"""

import os

__version__ = "0.1.0"

# MLflow's usage telemetry writes ~/.config/mlflow/telemetry.json (outside RECLOOP_HOME) and sends usage
# data: off in every process that imports recloop, and in the servers and workers it starts (they inherit
# the environment), before MLflow is first imported. A value set by the user wins.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
