"""Model building blocks whose tensor-parallel variants differ only in how they shard and load weights."""
