"""The front door: auth, validation, tokenization, classification, admission, enqueue, relay."""
