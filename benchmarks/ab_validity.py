"""Are the canary's CTR intervals valid when a few users make most of the requests?

    python benchmarks/ab_validity.py [--reps 2000] [--alpha 0.001] [--json out.json]

Two arms of identical models: users split by a coin, each request shows 10 items clicked at the user's own rate
(Beta(2, 10)), users' activity lognormal with spread ``sigma`` (0.5: even, 2.0: a handful of users make most
requests). Each simulated canary look is judged by ``evidence.sequential.ab_difference`` (the A/B canary: ratio
of CTRs, user-cluster delta-method variance, the always-valid interval at ``alpha``) and, on the same requests all
interleaved, by ``interleaving_difference`` (the shipped interleaved canary: each click credited to the team that
placed the item, a fair coin for identical rankers); the share of looks whose interval excludes 0 is the
false-significance rate, which a valid interval keeps at or below ``alpha``. No CUPED (the covariate does not
change the A/B rate here). Found after ``tests/test_serve.py::test_a_good_challenger_is_stepped_up_and_promoted``
rolled an identical challenger back once ("significantly worse … always-valid at alpha 0.001") on 200 requests.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from common import machine, use_source_tree

use_source_tree()

from recloop.evidence.sequential import ab_difference, interleaving_difference  # noqa: E402


def false_significance(rng: np.random.Generator, requests: int, sigma: float, alpha: float,
                       users: int = 300) -> tuple[bool, bool]:
    """(A/B, interleaved): whether each interval excludes 0 on one look at identical arms."""
    activity = rng.lognormal(0.0, sigma, users)
    rate = rng.beta(2, 10, users)
    who = rng.choice(users, requests, p=activity / activity.sum())
    clicks, shown = rng.binomial(10, rate[who]), np.full(requests, 10)
    arm = (rng.random(users) < 0.5)[who]
    a, b = ~arm, arm
    split = ab_difference(clicks[a], shown[a], who[a], clicks[b], shown[b], who[b], tau=1.0, alpha=alpha)
    credited = rng.binomial(clicks, 0.5)  # the challenger team's share of each request's clicks
    interleaved = interleaving_difference(clicks - credited, credited, who, tau=1.0, alpha=alpha)
    return (bool(split.high < 0 or split.low > 0), bool(interleaved.high < 0 or interleaved.low > 0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--alpha", type=float, default=0.001)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from statsmodels.stats.proportion import proportion_confint

    rng = np.random.default_rng(0)
    rows = []
    for sigma in (0.5, 1.0, 1.5, 2.0):
        for requests in (200, 2000):
            found = np.array([false_significance(rng, requests, sigma, args.alpha) for _ in range(args.reps)])
            for column, canary in enumerate(("A/B", "interleaved")):
                hits = int(found[:, column].sum())
                low, high = proportion_confint(hits, args.reps, method="wilson")
                rows.append({"canary": canary, "sigma": sigma, "requests": requests, "rate": hits / args.reps,
                             "low": low, "high": high})
                print(f"{canary:>11}, activity sigma {sigma}, {requests} requests: identical arms significant in "
                      f"{hits / args.reps:.2%} [{low:.2%}, {high:.2%}] of {args.reps} looks (alpha {args.alpha:.2%})",
                      flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": machine(), "arguments": vars(args), "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
