"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), served as the chat
completion it translates into."""
