"""The names of the tags recloop keeps on registered versions: the vocabulary the registry, the canary, serving
and the monitor share (what each tag holds is described where it is written).
"""

CANARY_TAG = "canary"  # the canary's state on a challenger (recloop.canary.tag.CanaryTag), one JSON tag
LOAD_FAILED_TAG = "serving.load_failed"  # set by serving: {"reason", "at"}; the controller rolls back on it
KPI_BASELINE_TAG = "kpi.baseline"  # set at promotion: {"ctr", "auc", "impressions"} the champion earned
ROLLED_BACK_TAG = "rolled_back"  # set on a champion rolled back: who, why, when
