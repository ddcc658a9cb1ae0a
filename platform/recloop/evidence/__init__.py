"""Statistics behind the loop's decisions (pure: numpy and scipy only, no IO).

- ``sequential``: always-valid confidence sequences (mixture SPRT), CUPED, cluster-robust means;
- ``interleaving``: team-draft interleaving of two rankings and its per-request credit;
- ``offpolicy``: logged propensities (epsilon-greedy, Plackett-Luce) and the IPS / SNIPS / doubly
  robust estimates of a candidate's CTR from them;
- ``ranking``: per-request (grouped) AUC and NDCG, the paired bootstrap over users, Holm's correction
  and the sample size a paired AUC comparison needs (power);
- ``calibration``: Platt scaling fitted on training rows only.

The canary, the gate, the monitor and the simulator's evaluation panel use these; each function says
what it assumes.
"""
