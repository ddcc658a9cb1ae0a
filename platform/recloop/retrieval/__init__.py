"""Retrieval: the two-tower model's data, training, item index, evaluation, gate, and the filtering and
ordering rules of the recommendation path (retrieve → filter → rank → order).

The model itself is ``recloop.model.retrieval``; this package reads the ranker's training rows (same lake,
same vocabularies), trains and exports item vectors into an ANN index, and judges a candidate.
"""
