"""Deploying the router: the replicas and the router actors on Ray, their supervision, and draining."""
