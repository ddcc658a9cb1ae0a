"""Serving picks up a feature state the moment the features flow publishes it (a version marker checked
per request), not on a timer."""

from __future__ import annotations

from recloop.features.config import FeatureConfig
from recloop.features.definition import FeatureLayout
from recloop.features.job import build_features
from recloop.features.online import DeferredOnline, RequestFeatures, online_reader
from recloop.features.state import StateStore
from recloop.schema import load_spec


def test_serving_reloads_vocabularies_when_the_features_flow_publishes(champion_home, tmp_path, copy_home):
    settings = copy_home(champion_home, tmp_path / "home", feedback_flush_seconds=3600)  # the demo's timer
    spec = load_spec("synthetic")
    features = RequestFeatures(
        settings, spec, FeatureConfig.for_spec(spec), DeferredOnline(lambda: online_reader(settings))
    )
    store = StateStore(FeatureLayout.for_settings(settings).state)
    before = features.state_version
    assert before == store.versions()[-1]
    assert not features.refresh_if_published()  # nothing new: one stat, no load
    loads, as_of = features.reloads, features._state.as_of_us
    seen = features._state.vocabularies["user_id"].table["count"].to_numpy().sum()

    build_features(settings, spec, FeatureConfig.for_spec(spec))  # day 4: ingested, not yet featurized
    assert store.versions()[-1] > before and store.marker.read_text().strip() == str(store.versions()[-1])
    assert features.refresh_if_published()  # the next request sees it, an hour before the flush timer
    assert features.state_version == store.versions()[-1] and features.reloads == loads + 1
    assert features._state.as_of_us > as_of  # day 4's state: its vocabularies count day 4's ids
    assert features._state.vocabularies["user_id"].table["count"].to_numpy().sum() > seen
    assert not features.refresh_if_published()
