"""One replica's scheduler: admission, prefill and decode, the batch descriptions, KV pages, request
slots and the prefix cache."""
