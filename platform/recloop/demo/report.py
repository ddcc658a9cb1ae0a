"""The demo's summary and its HTML report (a jinja2 template): a row per day, the decisions and the
efficacy figures."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
from jinja2 import Environment
from markupsafe import Markup

from recloop.demo.records import DayRecord, DemoConfig
from recloop.settings import Settings


def summarize(records: list[DayRecord], config: DemoConfig, freshness: list[float], last_full_day: int) -> dict:
    days = [asdict(r) for r in records]
    summary: dict = {"days": days, "config": asdict(config),
                     "full_retrains": sum(r.retrain in ("full (drift)", "full (kpi_decay)") for r in records),
                     "freshness_seconds": [round(f, 1) for f in freshness]}
    summary["recommend"] = {"clicks_per_day": {r.day: r.recommend_clicks for r in records if r.recommend_requests},
                            "vs_oracle": {r.day: r.recommend_vs_oracle for r in records if r.recommend_requests},
                            "retriever_oracle_recall": {r.day: r.retriever_oracle_recall for r in records
                                                        if r.retriever_oracle_recall is not None},
                            "popularity_oracle_recall": {r.day: r.popularity_oracle_recall for r in records
                                                         if r.popularity_oracle_recall is not None}}
    served = {r.day: r.vs_oracle for r in records if r.vs_oracle is not None}
    baseline = {r.day: r.baseline_vs_oracle for r in records if r.baseline_vs_oracle is not None}
    before = [served[d] for d in served if d < config.drift_day]
    if config.drift != "none" and before and config.drift_day + 2 in served:
        pre = float(np.mean(before))
        recovered = served[config.drift_day + 2]
        summary["efficacy"] = {
            "pre_drift_vs_oracle": round(pre, 4), "drift_day_vs_oracle": round(served.get(config.drift_day, np.nan), 4),
            "two_cycles_after_vs_oracle": round(recovered, 4), "recovery": round(recovered / pre, 4),
            "never_retrain_two_cycles_after": round(baseline.get(config.drift_day + 2, np.nan), 4),
            "never_retrain_recovery": round(baseline.get(config.drift_day + 2, np.nan) / pre, 4),
            "target": ">= 0.95 of the pre-drift level within two cycles",
            "met": bool(recovered / pre >= 0.95)}
    return summary


def write_report(settings: Settings, records: list[DayRecord], summary: dict, config: DemoConfig) -> Path:
    """An HTML page: the per-day table and plots of online KPI and AUC with retrain, promotion and drift markers."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    days = [r.day for r in records]
    figure = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=(
        "Served ranking vs the oracle (expected clicks)", "Offline AUC on each day's held-out hours",
        "The recommendation path: retrieval's oracle recall and /recommend vs the catalog oracle"))
    figure.add_trace(go.Scatter(x=days, y=[r.vs_oracle for r in records], name="recloop (served)",
                                mode="lines+markers"), row=1, col=1)
    figure.add_trace(go.Scatter(x=days, y=[r.baseline_vs_oracle for r in records], name="never retrained",
                                mode="lines+markers", line={"dash": "dot"}), row=1, col=1)
    for name, values in (("candidate", [r.candidate_auc for r in records]), ("champion", [r.champion_auc for r in records]),
                         ("oracle", [r.oracle_auc for r in records])):
        figure.add_trace(go.Scatter(x=days, y=values, name=f"{name} AUC", mode="lines+markers"), row=2, col=1)
    for name, values in (("retriever oracle recall", [r.retriever_oracle_recall for r in records]),
                         ("popularity oracle recall", [r.popularity_oracle_recall for r in records]),
                         ("/recommend vs catalog oracle", [r.recommend_vs_oracle for r in records])):
        figure.add_trace(go.Scatter(x=days, y=values, name=name, mode="lines+markers"), row=3, col=1)
    for r in records:  # one marker per day, its events in one label: markers never overlap
        events = _day_events(r)
        if events:
            color = "red" if any(e.startswith(("rolled back", "drift", "kpi")) for e in events) else "purple"
            figure.add_vline(x=r.day, line={"color": color, "dash": "dash"}, annotation_text="<br>".join(events),
                             annotation_position="top right", annotation_font_size=11, row=1, col=1)
            for row in (2, 3):  # labelled once, on the first plot
                figure.add_vline(x=r.day, line={"color": color, "dash": "dash"}, row=row, col=1)
    if config.drift != "none":
        figure.add_vrect(x0=config.drift_day - 0.5, x1=config.days - 0.5, fillcolor="red", opacity=0.05,
                         line_width=0)
    figure.update_yaxes(title_text="expected clicks / oracle's", row=1, col=1)
    figure.update_yaxes(title_text="AUC", row=2, col=1)
    figure.update_yaxes(title_text="share", row=3, col=1)
    figure.update_layout(height=1050, width=1100, title=f"recloop demo — {config.days} days, drift "
                         f"'{config.drift}' from day {config.drift_day}", xaxis3_title="simulated day")
    from recloop.canary import explain

    html = _REPORT.render(records=records, summary=summary, efficacy=summary.get("efficacy"), fmt=as_text, config=config,
                          decisions=[m for r in records for m in r.decisions], columns=explain.COLUMNS,
                          notes=_raw_ctr_notes(records), raw_ctr_note=explain.RAW_CTR_NOTE,
                          recovery=(summary.get("recovery") or {}).get("headline"), paired=summary.get("paired") or {},
                          plot=Markup(figure.to_html(full_html=False, include_plotlyjs=True)))
    path = settings.home.resolve() / "reports" / "demo.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html)
    return path


def _day_events(record: DayRecord) -> list[str]:
    """What happened to the models on a day, for its marker: drift, retrains, promotions, rollbacks."""
    events = [record.drift] if record.drift not in ("-", "ok") else []
    if record.retrain.startswith("full"):
        events.append(record.retrain.replace(" (", " retrain (", 1) if "(" in record.retrain else "full retrain")
    for action in record.canary:
        verb, _, version = action.split(":")[0].partition(" ")
        label = {"promote": "promoted", "rollback": "rolled back"}.get(verb)
        if label:
            events.append(f"{label} {version}".strip())
    return events


_REPORT = Environment(autoescape=True).from_string("""<!doctype html>
<html><head><meta charset="utf-8"><title>recloop demo</title>
<style>body{font-family:sans-serif;margin:24px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td.moves{white-space:nowrap;text-align:left}
table.decisions td{text-align:left;vertical-align:top}</style></head><body>
<h1>recloop demo</h1>
{% for name, found in (paired.headline or {}).items() %}{% set policy, other = name.split(" - ") %}
<p><b>Loop efficacy (same panel, paired)</b>: on day
{{ paired.day }} {{ "the champion's" if policy == "champion" else "the ranking as served (the champion, and within the
running canary's share of users the challenger's)" }} normalized reward is {{ "%+.3f" % found.difference }} [95% CI
{{ "%+.3f" % found.low }}, {{ "%+.3f" % found.high }}] against the {{ other.replace("_", " ") }} model's on the same panel
requests (user-cluster interval; 0 is random, 1 the oracle).</p>{% endfor %}
{% if recovery %}<p><b>Loop efficacy (twin worlds)</b>: on day {{ summary.recovery.day }} the champion's normalized
reward on the evaluation panel is {{ "%.1f%%" % (recovery.champion.recovery * 100) }} [95% CI
{{ "%.1f%%" % (recovery.champion.low * 100) }}, {{ "%.1f%%" % (recovery.champion.high * 100) }}] of the no-drift
twin's (never retrained: {{ "%.1f%%" % (recovery.never_retrained.recovery * 100) }}); target ≥ 95% (lower bound):
{{ "met" if summary.recovery.met else "not met" }}.</p>{% endif %}
{% if efficacy %}<p>Served clicks relative to the oracle: two cycles after the drift the served ranking earns
{{ "%.1f%%" % (efficacy.recovery * 100) }} of its pre-drift share of the oracle's clicks (never retrained:
{{ "%.1f%%" % (efficacy.never_retrain_recovery * 100) }}){% if not recovery and not paired.headline %}; target ≥ 95%:
{{ "met" if efficacy.met else "not met" }}{% else %} (served traffic, one run, no interval: the
{{ "twin-world" if recovery else "same-panel" }} figure above is the efficacy measure){% endif %}.</p>{% endif %}
<table><tr><th>day</th><th>events</th><th>requests</th><th>drift</th><th>retrain</th><th>candidate AUC</th>
<th>champion AUC</th><th>oracle AUC</th><th>gate</th><th>canary</th><th>champion</th><th>online CTR (/rank, by version)</th>
<th>champion CTR (monitor, as Evidently plots it)</th>
<th>served / oracle</th><th>never retrained / oracle</th></tr>
{% for r in records %}<tr><td>{{ r.day }}</td><td>{{ "{:,}".format(r.events) }}</td><td>{{ r.requests }}</td>
<td>{{ r.drift }}</td><td>{{ r.retrain }}</td><td>{{ fmt(r.candidate_auc) }}</td><td>{{ fmt(r.champion_auc) }}</td>
<td>{{ fmt(r.oracle_auc) }}</td><td>{{ r.gate }}</td><td class="moves">{% for c in r.canary %}{{ c.split(":")[0] }}{% if not loop.last %}<br>{% endif %}{% else %}-{% endfor %}{% if r.decisions %} (<a href="#canary-decisions">why</a>){% endif %}</td>
<td>{{ r.champion or "-" }}</td>
<td>{% for v, c in r.online_ctr.items() %}v{{ v }}: {{ "%.3f" % c }}{% if not loop.last %}, {% endif %}{% else %}-{% endfor %}</td>
<td class="monitor-ctr">{{ "%.3f" % r.monitor_ctr if r.monitor_ctr is not none else "-" }}</td>
<td>{{ fmt(r.vs_oracle) }}</td><td>{{ fmt(r.baseline_vs_oracle) }}</td></tr>
{% endfor %}</table>
<h2 id="canary-decisions">Canary decisions: why each model moved</h2>
<p>Each step, promotion and rollback the canary controller made between the rounds of a day's traffic (a
canary starts when its challenger passes the gate: the retrain column), with the evidence that decided it. The ranker's
canary is interleaved: its online CTR evidence is the interleaved credit (challenger − champion, relative, with
its always-valid interval); the raw CTRs beside it are for reference only ({{ raw_ctr_note }}).</p>
{% if decisions %}<table class="decisions"><tr><th>day</th><th>model</th><th>version</th>{% for c in columns[1:] %}<th>{{ c }}</th>{% endfor %}</tr>
{% for m in decisions %}<tr><td>{{ m.day }}</td><td>{{ m.model }}</td><td>v{{ m.version }} (champion v{{ m.champion }})</td>
{% for c in columns[1:] %}<td>{{ m[c] }}</td>{% endfor %}</tr>
{% endfor %}</table>{% else %}<p>No canary moved.</p>{% endif %}
{% for note in notes %}<p class="raw-ctr-note"><b>Why a lower raw CTR was promoted.</b> {{ note }}</p>{% endfor %}
<h2>Evaluation panel (normalized reward: 0 random, 1 the oracle; 95% user-cluster interval)</h2>
<table><tr><th>day</th><th>live champion</th><th>as served (a running canary's share included)</th><th>never
retrained</th>{% if config.daily_full %}<th>daily full retrain (upper reference)</th>{% endif %}<th>NDCG@{{ config.shown }}
(champion)</th></tr>
{% for r in records if r.panel %}<tr><td>{{ r.day }}</td>
{% for policy in (["champion", "served", "never_retrained", "daily_full"] if config.daily_full else ["champion", "served", "never_retrained"]) %}
{% set f = r.panel.get(policy) %}<td>{% if f %}{{ "%.3f" % f.normalized_reward }} [{{ "%.3f" % f.low }}, {{ "%.3f" % f.high }}]{% else %}-{% endif %}</td>
{% endfor %}<td>{{ fmt(r.panel.champion.ndcg) }}</td></tr>
{% endfor %}</table>
<h2>The recommendation path (/recommend: retrieve {{ config.retrieve_k }} → filter → rank → order → top {{ config.shown }})</h2>
<table><tr><th>day</th><th>retriever candidate</th><th>retriever gate</th>
<th>oracle recall@{{ config.retrieve_k }}</th><th>popularity's</th><th>retriever champion</th><th>requests</th>
<th>popularity answers</th><th>clicks</th><th>expected clicks / catalog oracle's</th></tr>
{% for r in records %}<tr><td>{{ r.day }}</td><td>{{ r.retriever_version or "-" }}</td><td>{{ r.retriever_gate }}</td>
<td>{{ fmt(r.retriever_oracle_recall) }}</td><td>{{ fmt(r.popularity_oracle_recall) }}</td>
<td>{{ r.retriever_champion or "-" }}</td><td>{{ r.recommend_requests }}</td><td>{{ r.popularity_answers }}</td>
<td>{{ r.recommend_clicks }}</td><td>{{ fmt(r.recommend_vs_oracle) }}</td></tr>
{% endfor %}</table>
{{ plot }}
<p>Freshness (events landed → challenger serving canary traffic): {{ summary.freshness_seconds }} s.
Total {{ summary.seconds }} s.</p></body></html>
""")


def as_text(value) -> str:
    return "-" if value is None or value != value else f"{value:.4f}"


def _raw_ctr_notes(records: list[DayRecord]) -> list[str]:
    """The promotions (rollbacks) whose challenger's raw online CTR on the day was below (above) its
    champion's: what decided them instead, in a sentence per move."""
    from recloop.canary import explain

    notes = []
    for record in records:
        for move in record.decisions:
            mine, theirs = record.online_ctr.get(str(move["version"])), record.online_ctr.get(str(move["champion"]))
            if move["model"] == "ranker" and explain.raw_ctr_disagrees(move["action"], theirs, mine):
                notes.append(f"Day {record.day}: v{move['version']} was {'promoted' if move['action'] == 'promote' else 'rolled back'} "
                             f"while its online CTR that day ({mine:.3f}) was {'below' if move['action'] == 'promote' else 'above'} "
                             f"v{move['champion']}'s ({theirs:.3f}). The interleaved evidence decided: "
                             f"{move['online CTR evidence (what decides)']}; {explain.RAW_CTR_NOTE}.")
    return notes
