"""Small pieces both edge and server need (tokenizer fingerprint, draft export metadata, TLS
credentials, addresses, timed waits, ...): no torch, no model."""
