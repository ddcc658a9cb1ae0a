"""The canary: a passed challenger serves a sticky, growing share of users until guardrails promote it or
roll it back.

``decision`` is the pure core (routing, ``decide``); ``controller`` reads the serving journal and MLflow,
acts, and logs each decision. Import the controller as ``recloop.canary.controller``: this package's
top level stays pure so serving can import it without the controller's IO.
"""

from recloop.canary.decision import (
    Action,
    CanaryConfig,
    CanaryDecision,
    CanaryState,
    Variant,
    VariantStats,
    decide,
    position,
    route,
)

__all__ = ["Action", "CanaryConfig", "CanaryDecision", "CanaryState", "Variant", "VariantStats", "decide",
           "position", "route"]
