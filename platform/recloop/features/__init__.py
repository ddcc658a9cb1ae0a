"""Feature engineering: frame backend (cuDF or pandas), feature ops, vocabularies, state, the job, Feast."""
