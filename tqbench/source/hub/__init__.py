"""Checkpoints on the Hugging Face hub: headers read with range requests, shards downloaded as a conversion needs
them. Every byte goes through huggingface_hub's own client (its session, URL rules, retries, cache layout)."""
