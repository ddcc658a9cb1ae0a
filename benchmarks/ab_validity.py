"""Are the canary's CTR intervals valid when a few users make most of the requests, or an arm has few users?

    python benchmarks/ab_validity.py [--reps 1000] [--json out.json]

Users' activity is lognormal with spread ``sigma`` (0.5: even, 2.0: a handful of users make most requests); each
request shows 10 items clicked at the user's own rate (Beta(2, 10)), times ``1 + effect`` in the challenger's
arm. Users are split by a coin at the canary's ``share``; looks are taken once the challenger has
``requests`` requests (the canary judges nothing before ``min_requests``). Each look is judged by
``evidence.sequential.ab_difference`` two ways, on the same requests:

- **plain**: the delta-method variance of the two arms' CTR ratio over user clusters (``cap_quantile=None,
  small_sample=False``: what the A/B canary and the retriever's canary ran before);
- **shipped**: users' impressions capped at the pooled 90th percentile, the leverage correction and the
  Student's t widening for the arms' effective numbers of users (the defaults).

and, for identical arms, by ``interleaving_difference`` (the ranker's interleaved canary: each click credited to
the team that placed it, a fair coin for identical rankers). Reported: for identical arms, the share of looks
whose interval excludes 0 at ``alpha`` 0.001 with ``tau`` 1 (the sharpest one-look check: a valid interval keeps
it at or below alpha); for a 20 %-worse challenger, the share found "significantly worse" at the shipped canary's
``alpha`` 0.05 and ``tau`` 0.05 (the rollback's power); for identical arms at those settings, the share found
significantly worse (a false rollback at one look). Found after
``tests/test_serve.py::test_a_good_challenger_is_stepped_up_and_promoted`` rolled an identical challenger back
once ("significantly worse … always-valid at alpha 0.001").
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from common import machine, use_source_tree

use_source_tree()

from recloop.evidence.sequential import ab_difference, interleaving_difference  # noqa: E402

PLAIN = {"cap_quantile": None, "small_sample": False}


def look(rng: np.random.Generator, *, users: int, share: float, requests: int, sigma: float, effect: float):
    """One canary look: (champion's, challenger's) (clicks, shown, user) per request and the interleaved
    credits of the same requests as if every one had been interleaved."""
    activity = rng.lognormal(0.0, sigma, users)
    rate = rng.beta(2, 10, users)
    arm = rng.random(users) < share
    if not arm.any():
        arm[rng.integers(users)] = True
    # requests arrive by activity; keep drawing until the challenger has ``requests`` of its own
    p = activity / activity.sum()
    total = int(requests / max(p[arm].sum(), 1e-9) * 1.05) + 1
    who = rng.choice(users, total, p=p)
    inside = arm[who]
    last = np.flatnonzero(inside)[requests - 1] if inside.sum() >= requests else total - 1
    who, inside = who[: last + 1], inside[: last + 1]
    clicks = rng.binomial(10, np.minimum(rate[who] * np.where(inside, 1.0 + effect, 1.0), 1.0))
    shown = np.full(len(who), 10)
    credited = rng.binomial(clicks, 0.5)
    return (clicks[~inside], shown[~inside], who[~inside]), (clicks[inside], shown[inside], who[inside]), \
        (clicks - credited, credited, who)


def rates(rng, reps: int, **shape) -> dict:
    found = {k: 0 for k in ("plain_false", "shipped_false", "interleaved_false", "plain_false_005",
                            "shipped_false_005", "plain_power", "shipped_power")}
    for _ in range(reps):
        a, b, interleaved = look(rng, effect=0.0, **shape)
        for name, options in (("plain", PLAIN), ("shipped", {})):
            strict = ab_difference(*a, *b, tau=1.0, alpha=0.001, **options)
            found[f"{name}_false"] += strict.high < 0 or strict.low > 0
            canary = ab_difference(*a, *b, tau=0.05, alpha=0.05, **options)
            found[f"{name}_false_005"] += canary.high < 0
        credit = interleaving_difference(*interleaved, tau=1.0, alpha=0.001)
        found["interleaved_false"] += credit.high < 0 or credit.low > 0
        a, b, _ = look(rng, effect=-0.2, **shape)
        for name, options in (("plain", PLAIN), ("shipped", {})):
            found[f"{name}_power"] += ab_difference(*a, *b, tau=0.05, alpha=0.05, **options).high < 0
    return {k: v / reps for k, v in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    rows = []
    for users, share in ((300, 0.5), (300, 0.05), (3000, 0.05)):
        for sigma in (0.5, 1.0, 2.0):
            for requests in (200, 2000):
                shape = {"users": users, "share": share, "requests": requests, "sigma": sigma}
                row = {**shape, "reps": args.reps, **rates(rng, args.reps, **shape)}
                rows.append(row)
                print(f"{users} users, share {share:.0%}, sigma {sigma}, {requests} challenger requests: identical "
                      f"significant at alpha 0.1 %: plain {row['plain_false']:.2%}, shipped {row['shipped_false']:.2%}, "
                      f"interleaved {row['interleaved_false']:.2%}; identical 'worse' at the canary's 5 %: plain "
                      f"{row['plain_false_005']:.2%}, shipped {row['shipped_false_005']:.2%}; 20 % worse found: plain "
                      f"{row['plain_power']:.1%}, shipped {row['shipped_power']:.1%}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": machine(), "arguments": vars(args), "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
