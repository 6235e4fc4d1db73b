"""Fleet deployment: placing replicas on Ray, and replacing them one at a time."""
