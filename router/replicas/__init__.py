"""The router's side of the replicas: choosing one for a request, its client (submits, aborts, deltas),
and a request's life on it."""
