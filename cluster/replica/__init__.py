"""A replica as a Ray actor: the scheduler actor (tensor-parallel rank 0), its subscribers' outboxes,
its metrics and the executors over real engines."""
