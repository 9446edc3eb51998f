"""Small pieces both edge and server need: tokenizer fingerprint, export metadata."""
